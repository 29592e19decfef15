"""Edges of oncely.grpc and oncely.grpc.aio on 127.0.0.1 with grpcio clients: a plain
`def` handler on an aio server (its abort stops it, the loop is not blocked), a status
set without raising, an on_replay hook that raises, an answer over the body cap."""

from __future__ import annotations

import asyncio
import json
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import oncely
import pytest

grpc = pytest.importorskip("grpc")
aio = pytest.importorskip("grpc.aio")

from oncely.grpc import IdempotencyInterceptor  # noqa: E402
from oncely.grpc.aio import IdempotencyInterceptor as AioInterceptor  # noqa: E402

pytestmark = pytest.mark.timeout(60)
METHOD = "/shop.Orders/Create"
KEY = "x-idempotency-key"


def _dumps(v: Any) -> bytes:
    return json.dumps(v, separators=(",", ":")).encode()


def _strict(v: Any) -> bytes:
    """A serializer like protobuf's: None has no SerializeToString."""
    if v is None:
        raise AttributeError("'NoneType' object has no attribute 'SerializeToString'")
    return _dumps(v)


def _handler(fn: Any, ser: Any = _dumps) -> Any:
    return grpc.method_handlers_generic_handler(
        "shop.Orders", {"Create": grpc.unary_unary_rpc_method_handler(fn, json.loads, ser)}
    )


async def _aio_answers(handler: Any, n: int, request: Any, **kw: Any) -> list[Any]:
    server = aio.server(interceptors=[AioInterceptor(store=oncely.IdempotencyStore(), **kw)])
    server.add_generic_rpc_handlers((handler,))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    out: list[Any] = []
    try:
        async with aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            call = channel.unary_unary(
                METHOD, request_serializer=_dumps, response_deserializer=json.loads
            )
            for _ in range(n):
                c = call(request, metadata=((KEY, "order-0001"),), timeout=10)
                try:
                    out.append(("OK", await c, None))
                except aio.AioRpcError as e:
                    out.append((e.code(), e.details(), None))
    finally:
        await server.stop(None)
    return out


def _sync_answers(handler: Any, n: int, request: Any, **kw: Any) -> list[Any]:
    server = grpc.server(
        ThreadPoolExecutor(max_workers=4),
        interceptors=[IdempotencyInterceptor(store=oncely.IdempotencyStore(), **kw)],
    )
    server.add_generic_rpc_handlers((handler,))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    out: list[Any] = []
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            call = channel.unary_unary(
                METHOD, request_serializer=_dumps, response_deserializer=json.loads
            )
            for _ in range(n):
                try:
                    out.append(("OK", call(request, metadata=((KEY, "order-0001"),), timeout=10)))
                except grpc.RpcError as e:
                    out.append((e.code(), e.details()))
    finally:
        server.stop(None)
    return out


# A plain `def` handler on a grpc.aio server runs as grpc.aio runs it: in a thread, with
# the sync context, whose `abort` raises (the handler stops there).
async def test_aio_sync_handler_abort_stops_the_handler() -> None:
    effects: list[str] = []

    def create(request: Any, context: Any) -> Any:
        if request.get("sku") == "missing":
            context.abort(grpc.StatusCode.NOT_FOUND, "no such sku")
        effects.append("charged")  # must not run after an abort
        return {"ok": True}

    got = await _aio_answers(_handler(create), 2, {"sku": "missing"})
    assert effects == []
    assert [g[:2] for g in got] == [(grpc.StatusCode.NOT_FOUND, "no such sku")] * 2


async def test_aio_sync_handler_does_not_block_the_event_loop() -> None:
    ticks: list[float] = []

    def create(request: Any, context: Any) -> Any:
        time.sleep(0.5)
        return {"ok": True}

    async def ticker() -> None:
        for _ in range(10):
            ticks.append(time.monotonic())
            await asyncio.sleep(0.05)

    t = asyncio.ensure_future(ticker())
    await _aio_answers(_handler(create), 1, {})
    await t
    gaps = [b - a for a, b in zip(ticks, ticks[1:])]
    assert max(gaps) < 0.3, gaps


# A handler that sets a final status without raising and returns no message
# (`set_code`, `set_details`, `return None`): that status and its details are the answer,
# the same to the first caller and to the replay (no message is serialized).
@pytest.mark.parametrize("details", [True, False])
async def test_aio_set_code_and_return_none_replays_the_first_answer(details: bool) -> None:
    calls = 0

    async def create(request: Any, context: Any) -> Any:
        nonlocal calls
        calls += 1
        context.set_code(grpc.StatusCode.NOT_FOUND)
        if details:
            context.set_details("no such order")
        return None

    got = await _aio_answers(_handler(create, _strict), 2, {})
    assert calls == 1
    first, replay = got
    assert first[:2] == replay[:2]
    assert first[0] == grpc.StatusCode.NOT_FOUND
    if details:
        assert first[1] == "no such order"


@pytest.mark.parametrize("details", [True, False])
def test_sync_set_code_and_return_none_replays_the_first_answer(details: bool) -> None:
    calls = 0

    def create(request: Any, context: Any) -> Any:
        nonlocal calls
        calls += 1
        context.set_code(grpc.StatusCode.NOT_FOUND)
        if details:
            context.set_details("no such order")
        return None

    first, replay = _sync_answers(_handler(create, _strict), 2, {})
    assert calls == 1
    assert first == replay
    assert first[0] == grpc.StatusCode.NOT_FOUND


# An on_replay hook that raises is logged; the replay is sent as stored.
def test_sync_on_replay_that_raises_does_not_change_the_replay() -> None:
    def create(request: Any, context: Any) -> Any:
        return {"ok": True}

    def hook(context: Any, scoped: Any) -> None:
        raise RuntimeError("metrics backend down")

    got = _sync_answers(_handler(create), 2, {}, on_replay=hook)
    assert got == [("OK", {"ok": True})] * 2


async def test_aio_on_replay_that_raises_does_not_change_the_replay() -> None:
    async def create(request: Any, context: Any) -> Any:
        return {"ok": True}

    def hook(context: Any, scoped: Any) -> None:
        raise RuntimeError("metrics backend down")

    got = await _aio_answers(_handler(create), 2, {}, on_replay=hook)
    assert [g[:2] for g in got] == [("OK", {"ok": True})] * 2


# SPEC §8: an answer over the body cap (default 1 MiB) is not stored: a retry runs again.
def test_sync_response_over_the_cap_is_not_stored() -> None:
    calls = 0

    def create(request: Any, context: Any) -> Any:
        nonlocal calls
        calls += 1
        return {"blob": "x" * (2 << 20), "call": calls}

    got = _sync_answers(_handler(create), 2, {})
    assert [g[1]["call"] for g in got] == [1, 2]


def test_sync_body_cap_option_is_the_largest_answer_stored() -> None:
    calls = 0

    def create(request: Any, context: Any) -> Any:
        nonlocal calls
        calls += 1
        return {"blob": "x" * request["size"], "call": calls}

    # 5 bytes of framing + the JSON: a 40-byte blob is over a 32-byte cap, a 1-byte one fits.
    big = _sync_answers(_handler(create), 2, {"size": 40}, body_cap=32)
    assert [g[1]["call"] for g in big] == [1, 2]
    calls = 0
    small = _sync_answers(_handler(create), 2, {"size": 1}, body_cap=32)
    assert [g[1]["call"] for g in small] == [1, 1]


async def test_aio_body_cap_option_is_the_largest_answer_stored() -> None:
    calls = 0

    async def create(request: Any, context: Any) -> Any:
        nonlocal calls
        calls += 1
        return {"blob": "x" * 40, "call": calls}

    got = await _aio_answers(_handler(create), 2, {}, body_cap=32)
    assert [g[1]["call"] for g in got] == [1, 2]


def test_a_bad_body_cap_is_an_argument_error() -> None:
    for bad in (-1, "big"):
        with pytest.raises(oncely.InvalidArgumentError) as e:
            IdempotencyInterceptor(store=oncely.IdempotencyStore(), body_cap=bad)
        assert e.value.field == "body_cap"


def test_a_stored_answer_with_an_unknown_status_is_unavailable_not_a_crash() -> None:
    from oncely.grpc._common import read_record

    record = oncely.http.encode_response(
        200, [("content-type", b"application/grpc")], b"", [("grpc-status", b"99")]
    )
    with pytest.raises(oncely.StoreUnavailableError, match="unknown status 99"):
        read_record(record)
    # A known one reads as before.
    code, details, message, _ = read_record(
        oncely.http.encode_response(
            200, [("content-type", b"application/grpc")], b"", [("grpc-status", b"5")]
        )
    )
    assert (code, details, message) == (5, "", b"")
