"""The unit-level cases of tests/vectors/http_server.json (SPEC §8) through
``oncely.http``, the core's server contract as the Python adapters call it."""

from __future__ import annotations

import json
from typing import Any

import oncely
import pytest
from conftest import load_vectors
from oncely import Code, errors, http

CASES = [c for c in load_vectors("http_server.json") if c["op"] != "sequence"]


def _config(case: dict[str, Any]) -> http.ServerConfig:
    return http.ServerConfig(
        methods=case.get("methods"),
        required=case.get("required", True),
        stored_headers=case.get("stored_headers"),
        grpc_methods=case.get("grpc_methods"),
    )


def _error(e: dict[str, Any]) -> oncely.OncelyError:
    kind = e["kind"]
    if kind == "missing_key":
        return errors.MissingKeyError("missing", field="idempotency_key")
    if kind == "invalid_argument":
        return errors.InvalidKeyError("bad", field=e["field"])
    if kind == "fingerprint_mismatch":
        return errors.FingerprintMismatchError("mismatch")
    if kind == "in_progress":
        return errors.InProgressError("running", retry_after=e["retry_after_ms"] / 1000)
    if kind == "lease_lost":
        return errors.LeaseLostError("lost")
    if kind == "capacity":
        return errors.CapacityError("full", max_entries=10)
    if kind == "unavailable":
        return errors.StoreUnavailableError("down")
    if kind == "leader_panicked":
        return errors.LeaderPanickedError("boom")
    if kind == "reentrant":
        return errors.ReentrantCallError("again", key="k")
    if kind == "result_not_stored":
        return errors.ResultNotStoredError("not stored", key="k", type_name="T")
    raise AssertionError(f"unknown error kind {kind}")


def _pairs(pairs: list[list[str]]) -> list[tuple[str, bytes]]:
    return [(n, v.encode()) for n, v in pairs]


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c['op']}-{c.get('comment', '')}"[:60])
def test_http_server_unit(case: dict[str, Any]) -> None:
    op = case["op"]
    if op == "covers":
        assert _config(case).covers(case["method"]) is case["covered"]
    elif op == "read_key":
        got = _config(case).read_key(case["method"], [v.encode() for v in case["values"]])
        want = case["expect"]
        if "pass_through" in want:
            assert got is None
        elif "dedup" in want:
            assert got == want["dedup"]
        else:
            assert isinstance(got, http.Problem)
            p = want["problem"]
            assert (got.status, got.type, got.code) == (p["status"], p["type"], p["code"])
    elif op == "scope":
        got = http.scope(case["tenant"], case["method"], case["route"], case["key"])
        assert got.value == case["scoped"]
    elif op == "fingerprint":
        body = bytes.fromhex(case["body_hex"]) if "body_hex" in case else case["body"].encode()
        got = http.request_fingerprint(case["method"], case["target"], case["content_type"], body)
        assert got == case["fingerprint"]
    elif op == "status":
        assert http.storable_status(case["status"]) is case["storable"]
    elif op == "content":
        assert http.has_content(case["method"], case["status"]) is case["has_content"]
    elif op == "declared_length":
        config = http.ServerConfig(request_cap=case["request_cap"])
        assert config.declares_too_large(case["value"].encode()) is case["too_large"]
        assert config.request_cap == case["request_cap"]
        length = http.declared_length(case["value"].encode())
        want = case["length"]
        assert length == (None if want == "none" else 2**64 - 1 if want == "max" else int(want))
    elif op == "header":
        assert _config(case).stores_header(case["name"]) is case["stored"]
        assert _config(case).shares_header(case["name"]) is case["shared"]
    elif op == "record":
        r = case["response"]
        headers, trailers = _pairs(r["headers"]), _pairs(r["trailers"])
        body = bytes.fromhex(r["body_hex"])
        record = http.encode_response(r["status"], headers, body, trailers)
        assert record.hex() == case["hex"]
        assert http.decode_response(bytes.fromhex(case["hex"])) == (
            r["status"],
            headers,
            body,
            trailers,
        )
    elif op == "record_decode":
        with pytest.raises(oncely.OncelyError) as info:
            http.decode_response(bytes.fromhex(case["hex"]))
        assert Code(info.value.code).name == case["error"]
    elif op == "problem":
        exc = _error(case["error"])
        p = http.Problem.from_error(exc)
        assert exc.http_status == case["status"]
        assert (p.status, p.type, p.code) == (case["status"], case["type"], case["code"])
        assert dict(p.headers()) == case["headers"]
        assert len(p.headers()) == len(case["headers"])
        body = json.loads(p.body())
        assert set(body) == {"type", "title", "status", "detail", "code"}
        assert (body["type"], body["status"], body["code"]) == (p.type, p.status, p.code)
        assert (body["title"], body["detail"]) == (p.title, p.detail)
    elif op == "covers_grpc":
        assert _config(case).covers_grpc(case["full_method"]) is case["covered"]
    elif op == "grpc_status":
        assert http.storable_grpc_status(case["value"].encode()) is case["storable"]
    elif op == "grpc_problem":
        meta = dict(http.Problem.from_error(_error(case["error"])).grpc_metadata())
        assert meta["grpc-status"] == case["grpc_status"]
        assert meta.get("grpc-retry-pushback-ms") == case["grpc_retry_pushback_ms"]
    elif op == "is_grpc":
        assert http.is_grpc(case["content_type"]) is case["grpc"]
    elif op == "is_event_stream":
        assert http.is_event_stream(case["content_type"]) is case["event_stream"]
    else:
        raise AssertionError(f"unknown op {op}")


def test_every_unit_op_is_run() -> None:
    ops = {c["op"] for c in CASES}
    assert ops == {
        "covers",
        "read_key",
        "scope",
        "fingerprint",
        "status",
        "content",
        "declared_length",
        "header",
        "record",
        "record_decode",
        "problem",
        "covers_grpc",
        "grpc_status",
        "grpc_problem",
        "is_grpc",
        "is_event_stream",
    }


def test_problem_from_error_keeps_the_message_and_refuses_foreign_errors() -> None:
    exc = errors.StoreUnavailableError("unavailable: redis down")
    assert http.Problem.from_error(exc).detail == "unavailable: redis down"
    missing = http.Problem.from_error(errors.MissingKeyError("x"))
    assert "Idempotency-Key" in missing.detail
    with pytest.raises(TypeError):
        http.Problem.from_error(ValueError("not oncely"))


def test_constants_and_config() -> None:
    assert http.KEY_HEADER == "idempotency-key"
    assert http.REPLAYED_HEADER == "idempotent-replayed" and http.REPLAYED_VALUE == "true"
    assert http.DEFAULT_METHODS == ["POST", "PATCH"]
    assert http.DEFAULT_BODY_CAP == 1 << 20
    c = http.ServerConfig(body_cap=10, wait=False, required=False)
    assert (c.body_cap, c.wait, c.required) == (10, False, False)
    assert c.body_fits(10) and not c.body_fits(11)
    with pytest.raises(oncely.InvalidArgumentError):
        http.ServerConfig(methods=["bad method"])
    unusable = http.Problem.tenant_unusable("empty")
    assert (unusable.status, unusable.type, unusable.code) == (
        500,
        "urn:oncely:problem:tenant-unusable",
        "INTERNAL",
    )
    too_large = http.Problem.request_too_large(5)
    assert (too_large.status, too_large.type) == (413, "urn:oncely:problem:request-too-large")


def test_optional_frameworks_are_not_imported() -> None:
    import subprocess
    import sys

    code = (
        "import sys, oncely, oncely.http, oncely.asgi, oncely.wsgi\n"
        "print([m for m in ('starlette', 'fastapi', 'flask', 'werkzeug', 'grpc', 'httpx',"
        " 'requests', 'uvicorn', 'hypercorn') if m in sys.modules])"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd="/", check=True
    )
    assert out.stdout.strip() == "[]"
