"""The shared cross-language vectors (tests/vectors/*.json, see their README) through
the Python API: the same results as the Rust core's own test (core/tests/vectors.rs)."""

from __future__ import annotations

import base64
import builtins
import json
from types import SimpleNamespace
from typing import Any

import oncely
import pytest
from conftest import case_id, load_vectors
from oncely import Code, Failure, ManualClock, RetryPolicy


def _policy(p: dict[str, Any]) -> RetryPolicy:
    kwargs: dict[str, Any] = dict(
        max_attempts=p["max_attempts"],
        base_delay=p["base_delay_ms"] / 1000,
        max_delay=p["max_delay_ms"] / 1000,
        multiplier=p["multiplier"],
        jitter=p["jitter"],
        seed=p["seed"],
    )
    if "min_attempt_ms" in p:
        kwargs["min_attempt"] = p["min_attempt_ms"] / 1000
    return RetryPolicy(**kwargs)


def _ms(seconds: float) -> int:
    return round(seconds * 1000)


def _check_error(exc: BaseException, expected: dict[str, Any]) -> None:
    assert isinstance(exc, oncely.OncelyError)
    assert exc.code == Code.INVALID_ARGUMENT
    assert isinstance(exc, ValueError)
    if expected["kind"] == "missing_key":
        assert isinstance(exc, oncely.MissingKeyError)
    else:
        assert expected["kind"] == "invalid_argument"
        assert isinstance(exc, oncely.InvalidArgumentError)
        assert exc.field == expected["field"], str(exc)


BACKOFF = load_vectors("backoff.json")


@pytest.mark.parametrize("case", BACKOFF, ids=case_id)
def test_backoff(case: dict[str, Any]) -> None:
    if "error" in case:
        with pytest.raises(oncely.InvalidArgumentError) as info:
            _policy(case["policy"])
        _check_error(info.value, case["error"])
        return
    policy = _policy(case["policy"])
    seed = case["policy"]["seed"]
    for d in case["delays"]:
        n, want = d["failed_attempt"], d["delay_ms"]
        assert _ms(policy.delay_after(n)) == want, (n, case["comment"])
        if seed is not None:
            assert _ms(policy.delay_with_seed(n, seed)) == want
    if "sequence_ms" in case:
        assert [_ms(s) for s in policy.backoff()] == case["sequence_ms"]


@pytest.mark.parametrize(
    "case",
    load_vectors("classification.json"),
    ids=lambda c: (
        f"{c['code']}-{c['safe']}-{c['rereads']}-{c['transient_internal']}-{c.get('server_delay')}"
    ),
)
def test_classification(case: dict[str, Any]) -> None:
    code = Code[case["code"]]
    sd = case.get("server_delay")
    failure: Any = code
    if sd == "do_not_retry":
        failure = oncely.Failure(code, do_not_retry=True)
    elif sd is not None:
        failure = oncely.Failure(code, delay=sd["after_ms"] / 1000)
    got = oncely.classify(
        failure,
        safe=case["safe"],
        rereads=case["rereads"],
        transient_internal=case["transient_internal"],
    )
    assert (got.retryable, got.rule) == (case["retryable"], case["rule"])


def test_http_table() -> None:
    cases = load_vectors("http.json")
    bad = [
        (c["status"], Code.from_http(c["status"]).name, c["code"])
        for c in cases
        if Code.from_http(c["status"]).name != c["code"]
    ]
    assert not bad
    assert len(cases) > 50


@pytest.mark.parametrize("case", load_vectors("retry_after.json"), ids=case_id)
def test_retry_after(case: dict[str, Any]) -> None:
    value = case["value"]
    if "delay_ms_at_least" in case:  # saturated: longer than any deadline
        if case["header"] == "Retry-After":
            got = oncely.parse_retry_after(value, now=case["now"])
        else:
            got = oncely.parse_pushback_ms(value)
        assert got is not None and got * 1000 >= case["delay_ms_at_least"]
        return
    if case["header"] == "Retry-After":
        if "error" in case:
            with pytest.raises(oncely.InvalidArgumentError) as info:
                oncely.parse_retry_after(value, now=case["now"])
            _check_error(info.value, case["error"])
        else:
            assert _ms(oncely.parse_retry_after(value, now=case["now"])) == case["delay_ms"]
    else:
        assert case["header"] == "grpc-retry-pushback-ms"
        # Read as a failure's header, a malformed pushback means "do not retry" (gRFC
        # A6) and wins over a Retry-After.
        failure = Failure.from_headers(Code.UNAVAILABLE, retry_after="3", pushback_ms=value)
        if "error" in case or case.get("do_not_retry"):
            assert failure.do_not_retry and failure.delay is None
        else:
            assert failure.delay is not None and _ms(failure.delay) == case["delay_ms"]
        if "error" in case:
            with pytest.raises(oncely.InvalidArgumentError) as info:
                oncely.parse_pushback_ms(value)
            _check_error(info.value, case["error"])
        elif case.get("do_not_retry"):
            assert oncely.parse_pushback_ms(value) is None
        else:
            got = oncely.parse_pushback_ms(value)
            assert got is not None and _ms(got) == case["delay_ms"]


def _text(case: dict[str, Any], name: str) -> str:
    """A string field, given as text or as UTF-16 code units (`<name>_utf16`, which may
    hold a lone surrogate: a Python str can)."""
    if name in case:
        return str(case[name])
    units = case[name + "_utf16"]
    raw = b"".join(u.to_bytes(2, "big") for u in units)
    return raw.decode("utf-16-be", "surrogatepass")


# `parse_scoped` reads a scoped key back with Rust's ScopedKey::parse, which the Python
# package does not offer: only the Rust suite runs those cases.
@pytest.mark.parametrize(
    "case", [c for c in load_vectors("keys.json") if c["op"] != "parse_scoped"], ids=case_id
)
def test_keys(case: dict[str, Any]) -> None:
    op = case["op"]
    if op == "parse":
        key = _text(case, "key")
        call = lambda: oncely.validate_key(key)  # noqa: E731
        expect = key if case.get("valid") else None
    elif op == "derive":
        b, o = _text(case, "business_id"), _text(case, "operation")
        call = lambda: oncely.derive_key(b, o)  # noqa: E731
        expect = case.get("key")
    else:
        assert op == "scope"
        t, m, k = _text(case, "tenant"), _text(case, "method"), _text(case, "key")
        call = lambda: str(oncely.scope(t, m, k))  # noqa: E731
        expect = case.get("scoped")
    if "error" in case:
        with pytest.raises(oncely.InvalidArgumentError) as info:
            call()
        _check_error(info.value, case["error"])
        if case["error"].get("field") == "idempotency_key":
            assert isinstance(info.value, oncely.InvalidKeyError)
    else:
        assert call() == expect


def test_scoped_keys_are_distinct() -> None:
    cases = [c for c in load_vectors("keys.json") if c["op"] == "scope" and "scoped" in c]
    triples = {(_text(c, "tenant"), _text(c, "method"), _text(c, "key")) for c in cases}
    scoped = {str(oncely.scope(*t)) for t in triples}
    assert len(scoped) == len(triples)


def _fingerprint_input(case: dict[str, Any]) -> Any:
    """The value of a case: `value`, `value_json` (read by Python's json), a NaN or
    infinite float, a string of UTF-16 code units, or `nested` arrays/objects."""
    if "value" in case:
        return case["value"]
    if "value_json" in case:
        return json.loads(case["value_json"])
    if "value_special" in case:
        x = float(case["value_special"]["float"].lower().replace("infinity", "inf"))
        return {"top": x, "array": [x], "object": {"x": x}}[case["value_special"]["in"]]
    if "value_utf16" in case:
        text = _text(case["value_utf16"], "string")
        return text if case["value_utf16"]["in"] == "top" else {text: 0}
    depth, kind = case["nested"]["depth"], case["nested"]["kind"]
    value: Any = [] if kind == "array" else {}
    for _ in range(depth - 1):
        value = [value] if kind == "array" else {"a": value}
    return value


@pytest.mark.parametrize("case", load_vectors("fingerprints.json"), ids=case_id)
def test_fingerprints(case: dict[str, Any]) -> None:
    value = _fingerprint_input(case)
    if "error" in case:
        for refuse in (oncely.canonical_json, oncely.fingerprint):
            with pytest.raises(oncely.InvalidArgumentError) as info:
                refuse(value)
            _check_error(info.value, case["error"])
        return
    assert oncely.canonical_json(value) == case["canonical"].encode("utf-8")
    assert oncely.fingerprint(value) == case["sha256"]
    assert oncely.fingerprint_bytes(case["canonical"].encode("utf-8")) == case["sha256"]


class Scripted(Exception):
    def __init__(self, code: Code, server_delay: Any) -> None:
        super().__init__(code.name)
        self.code = code
        self.server_delay = server_delay


def _classify(exc: BaseException) -> Failure | None:
    assert isinstance(exc, Scripted)
    if exc.server_delay is None:
        return Failure(exc.code)
    if exc.server_delay == "do_not_retry":
        return Failure(exc.code, do_not_retry=True)
    return Failure(exc.code, delay=exc.server_delay["after_ms"] / 1000)


@pytest.mark.parametrize("case", load_vectors("retry_decisions.json"), ids=case_id)
def test_retry_decisions_through_the_sync_loop(case: dict[str, Any]) -> None:
    """The real retry_sync loop on a manual clock: attempts advance it by `takes_ms`,
    sleeps by the delay; the timeline must equal the vector (and Rust's simulate)."""
    clock = ManualClock()
    script = case["script"]
    delays: list[int] = []
    attempts = 0

    def attempt() -> str:
        nonlocal attempts
        step = script[min(attempts, len(script) - 1)]
        attempts += 1
        clock.advance(step["takes_ms"] / 1000)
        if step["outcome"] == "ok":
            return "ok"
        raise Scripted(Code[step["outcome"]], step["server_delay"])

    def sleep(seconds: float) -> None:
        delays.append(_ms(seconds))
        clock.advance(seconds)

    def zero_sleep_recorder(event: oncely.RetryEvent) -> None:
        if event.delay == 0:
            delays.append(0)  # the loop skips the sleep for a zero delay

    deadline = case["deadline_ms"]
    try:
        result = oncely.retry_sync(
            attempt,
            policy=_policy(case["policy"]),
            safe=case["safe"],
            rereads=case["rereads"],
            transient_internal=case["transient_internal"],
            deadline=None if deadline is None else deadline / 1000,
            classify=_classify,
            on_retry=zero_sleep_recorder,
            _clock=clock,
            _sleep=sleep,
        )
    except Scripted as exc:
        result = exc.stop_reason  # type: ignore[attr-defined]
        assert exc.attempts == attempts  # type: ignore[attr-defined]
    expect = case["expect"]
    assert (attempts, delays, result, _ms(clock.now())) == (
        expect["attempts"],
        expect["delays_ms"],
        expect["result"],
        expect["elapsed_ms"],
    )


RESULT_CODEC = load_vectors("result_codec.json")


@pytest.mark.parametrize("case", RESULT_CODEC, ids=case_id)
def test_result_codec(case: dict[str, Any]) -> None:
    from oncely._oncely import _encode_record
    from oncely.redis_store import decode_result

    record = bytes.fromhex(case["record_hex"])
    if "error" in case:
        assert case["error"] == {"kind": "unavailable"}
        with pytest.raises(oncely.StoreUnavailableError):
            decode_result(record)
        return
    kind = case["kind"]
    payload: Any = None
    if kind in ("json", "user_text"):
        payload = case["text"]
    elif kind in ("bytes", "user_bytes"):
        payload = bytes.fromhex(case["hex"])
    elif kind == "not_storable":
        payload = case["type_name"]
    assert _encode_record(kind, payload) == record
    if kind == "json":
        assert decode_result(record) == case["value"]
    elif kind == "bytes":
        assert decode_result(record) == payload
    elif kind == "no_value":
        assert decode_result(record) is None
    elif kind == "not_storable":
        with pytest.raises(oncely.ResultNotStoredError) as info:
            decode_result(record)
        assert info.value.type_name == payload
    else:
        assert decode_result(record, lambda body: ("decoded", body)) == ("decoded", payload)


def _foreign(shape: dict[str, Any]) -> BaseException:
    """A Python exception of the shape an extraction vector describes."""
    names: list[str] = shape.get("names") or []
    cls: type[BaseException] = Exception
    for i, name in enumerate(reversed(names)):
        module, _, short = name.rpartition(".")
        builtin = getattr(builtins, name, None) if not module else None
        if i == 0 and isinstance(builtin, type) and issubclass(builtin, BaseException):
            cls = builtin
        else:
            cls = type(short, (cls,), {"__module__": module or "builtins"})
    exc = cls("a foreign error")
    attrs: dict[str, Any] = {}
    if "metadata" in shape:
        pairs = tuple(
            (
                k,
                base64.b64decode(v + "=" * (-len(v) % 4))
                if k.endswith("-bin") and _is_b64(v)
                else v,
            )
            for k, v in shape["metadata"].items()
        )
        code = shape.get("code")
        attrs["code"] = lambda: code
        attrs["trailing_metadata"] = lambda: pairs
    elif "code" in shape:
        attrs["code"] = shape["code"]
    for key in ("status", "status_code", "headers"):
        if key in shape:
            attrs[key] = shape[key]
    if "response" in shape:
        attrs["response"] = SimpleNamespace(**shape["response"])
    for key, value in attrs.items():
        setattr(exc, key, value)
    if "cause" in shape:
        exc.__cause__ = _foreign(shape["cause"])
    return exc


def _is_b64(v: str) -> bool:
    try:
        base64.b64decode(v + "=" * (-len(v) % 4), validate=True)
    except ValueError:
        return False
    return True


@pytest.mark.parametrize("case", load_vectors("extraction.json"), ids=case_id)
def test_extraction(case: dict[str, Any]) -> None:
    reasons = oncely.ReasonCodes()
    for name, code in (case.get("reasons") or {}).items():
        reasons.register(name, code)
    exc = _foreign(case["error"])
    f = oncely.failure_of(exc, reasons)
    code = f if isinstance(f, int) else f.code
    delay = None if isinstance(f, int) or f.delay is None else _ms(f.delay)
    do_not_retry = False if isinstance(f, int) else f.do_not_retry
    assert (Code(code).name, delay, do_not_retry) == (
        case["code"],
        case["delay_ms"],
        case["do_not_retry"],
    )
    got = oncely.classify(code, safe=True)
    assert (got.retryable, got.rule) == (case["retryable"], case["rule"])

    # Retried with safe=True and 2 attempts: the second attempt happens exactly when
    # the code is retryable and the server did not say no.
    calls = []

    def fail() -> None:
        calls.append(1)
        raise _foreign(case["error"])

    try:
        oncely.retry_sync(
            fail,
            policy=RetryPolicy(max_attempts=2, base_delay=0.001, jitter=0),
            safe=True,
            reasons=reasons,
            _sleep=lambda _s: None,
        )
    except Exception as e:
        assert str(e) == "a foreign error"
    else:
        pytest.fail("the last error was not raised")
    assert len(calls) == (2 if case["retryable"] and not case["do_not_retry"] else 1)


@pytest.mark.parametrize("case", load_vectors("budget.json"), ids=case_id)
def test_budget(case: dict[str, Any]) -> None:
    """The retry budget's window and formula (SPEC §4) on a manual clock."""
    b = case["budget"]
    clock = ManualClock()

    def make() -> oncely.RetryBudget:
        return oncely.RetryBudget(b["ratio"], b["window_ms"] / 1000, b["min_per_sec"], _clock=clock)

    if "error" in case:
        with pytest.raises(oncely.InvalidArgumentError) as info:
            make()
        _check_error(info.value, case["error"])
        return
    budget = make()
    for step in case["steps"]:
        clock.set(step["at_ms"] / 1000)
        if "requests" in step:
            for _ in range(step["requests"]):
                budget.record_request()
            budget.snapshot()  # places the requests in the window now
        elif "withdraw" in step:
            results = [budget.try_withdraw() for _ in range(step["withdraw"])]
            granted = step["granted"]
            assert results == [True] * granted + [False] * (len(results) - granted)
        else:
            s = budget.snapshot()
            assert {"requests": s.requests, "retries": s.retries, "allowed": s.allowed} == step[
                "snapshot"
            ], step["at_ms"]
