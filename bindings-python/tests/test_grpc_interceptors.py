"""oncely.grpc.IdempotencyInterceptor (grpcio thread-pool server) and
oncely.grpc.aio.IdempotencyInterceptor (grpc.aio server), on 127.0.0.1 with grpcio
clients: concurrent duplicates, key problems, reused keys, no-wait pushback, final and
retryable statuses, a raising handler, a call dropped by its client and retried."""

from __future__ import annotations

import asyncio
import json
import os
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Iterator

import oncely
import pytest

grpc = pytest.importorskip("grpc")
aio = pytest.importorskip("grpc.aio")

from oncely.grpc import IdempotencyInterceptor  # noqa: E402
from oncely.grpc.aio import IdempotencyInterceptor as AioInterceptor  # noqa: E402

pytestmark = pytest.mark.timeout(120)
METHOD = "/shop.Orders/Create"
KEY = "x-idempotency-key"


def _dumps(v: Any) -> bytes:
    return json.dumps(v, separators=(",", ":")).encode()


class Orders:
    """Counts calls; the request's ``do`` says what call n does: ``ok`` (default),
    ``sleep`` seconds first, ``abort`` with a code name, ``raise``."""

    def __init__(self) -> None:
        self.calls = 0
        self.lock = threading.Lock()

    def begin(self) -> int:
        with self.lock:
            self.calls += 1
            return self.calls


def sync_server(orders: Orders, **kw: Any) -> Any:
    def create(request: dict[str, Any], context: Any) -> dict[str, Any]:
        n = orders.begin()
        time.sleep(request.get("sleep", 0))
        if "abort" in request:
            context.abort(getattr(grpc.StatusCode, request["abort"]), f"call {n} aborted")
        if request.get("raise"):
            raise RuntimeError("the handler failed")
        return {"call": n, "sku": request.get("sku")}

    handler = grpc.method_handlers_generic_handler(
        "shop.Orders",
        {"Create": grpc.unary_unary_rpc_method_handler(create, json.loads, _dumps)},
    )
    interceptor = IdempotencyInterceptor(store=kw.pop("store", oncely.IdempotencyStore()), **kw)
    server = grpc.server(ThreadPoolExecutor(max_workers=64), interceptors=[interceptor])
    server.add_generic_rpc_handlers((handler,))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    return server, port, interceptor


async def aio_server(orders: Orders, **kw: Any) -> Any:
    async def create(request: dict[str, Any], context: Any) -> dict[str, Any]:
        n = orders.begin()
        await asyncio.sleep(request.get("sleep", 0))
        if "abort" in request:
            await context.abort(getattr(grpc.StatusCode, request["abort"]), f"call {n} aborted")
        if request.get("raise"):
            raise RuntimeError("the handler failed")
        return {"call": n, "sku": request.get("sku")}

    handler = grpc.method_handlers_generic_handler(
        "shop.Orders",
        {"Create": grpc.unary_unary_rpc_method_handler(create, json.loads, _dumps)},
    )
    interceptor = AioInterceptor(store=kw.pop("store", oncely.IdempotencyStore()), **kw)
    server = aio.server(interceptors=[interceptor])
    server.add_generic_rpc_handlers((handler,))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    return server, port, interceptor


def _replayed(trailing: Any) -> bool:
    return any(k == "idempotent-replayed" and v == "true" for k, v in trailing or ())


@pytest.fixture
def sync_orders() -> Iterator[Callable[..., Any]]:
    servers: list[Any] = []

    def start(**kw: Any) -> Any:
        orders = Orders()
        server, port, interceptor = sync_server(orders, **kw)
        servers.append(server)
        channel = grpc.insecure_channel(f"127.0.0.1:{port}")
        call = channel.unary_unary(
            METHOD, request_serializer=_dumps, response_deserializer=json.loads
        )
        return orders, call, interceptor

    yield start
    for s in servers:
        s.stop(None)


def _store(kind: str) -> Any:
    if kind == "redis":
        url = os.environ.get("ONCELY_REDIS_URL")
        if not url:
            pytest.skip("needs ONCELY_REDIS_URL (scripts/with-redis)")
        return oncely.RedisStore(url, prefix=f"grpc-{uuid.uuid4().hex}")
    return oncely.IdempotencyStore()


@pytest.mark.parametrize("store_kind", ["memory", "redis"])
def test_sync_concurrent_duplicates_run_once(
    sync_orders: Callable[..., Any], store_kind: str
) -> None:
    orders, call, interceptor = sync_orders(store=_store(store_kind))
    md = ((KEY, "order-0001"),)

    def one(_: int) -> Any:
        return call.with_call({"sku": "A1", "sleep": 0.2}, metadata=md, timeout=30)

    with ThreadPoolExecutor(max_workers=50) as pool:
        results = list(pool.map(one, range(50)))
    assert orders.calls == 1
    assert {json.dumps(r) for r, _ in results} == {json.dumps({"call": 1, "sku": "A1"})}
    assert sum(_replayed(c.trailing_metadata()) for _, c in results) == 49
    snap = interceptor.counters()
    assert (snap.led, snap.stored, snap.replayed) == (1, 1, 49)


def test_sync_key_problems_and_reuse(sync_orders: Callable[..., Any]) -> None:
    orders, call, _ = sync_orders()
    for md in ((), ((KEY, "bad key!"),)):
        with pytest.raises(grpc.RpcError) as info:
            call({"sku": "A1"}, metadata=md, timeout=10)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    md = ((KEY, "order-0001"),)
    assert call({"sku": "A1"}, metadata=md, timeout=10) == {"call": 1, "sku": "A1"}
    with pytest.raises(grpc.RpcError) as reused:
        call({"sku": "B2"}, metadata=md, timeout=10)
    assert reused.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert orders.calls == 1


def test_sync_final_status_stored_retryable_not(sync_orders: Callable[..., Any]) -> None:
    orders, call, _ = sync_orders()
    final = ((KEY, "order-0001"),)
    for _ in range(2):
        with pytest.raises(grpc.RpcError) as info:
            call({"abort": "NOT_FOUND"}, metadata=final, timeout=10)
        assert (info.value.code(), info.value.details()) == (
            grpc.StatusCode.NOT_FOUND,
            "call 1 aborted",
        )
    assert _replayed(info.value.trailing_metadata())
    retryable = ((KEY, "order-0002"),)
    for n in (2, 3):
        with pytest.raises(grpc.RpcError) as info:
            call({"abort": "UNAVAILABLE"}, metadata=retryable, timeout=10)
        assert info.value.details() == f"call {n} aborted"
    with pytest.raises(grpc.RpcError) as raised:
        call({"raise": True}, metadata=((KEY, "order-0003"),), timeout=10)
    assert raised.value.code() == grpc.StatusCode.UNKNOWN
    assert call({}, metadata=((KEY, "order-0003"),), timeout=10) == {"call": 5, "sku": None}
    assert orders.calls == 5


def test_sync_no_wait_is_aborted_with_pushback(sync_orders: Callable[..., Any]) -> None:
    orders, call, _ = sync_orders(wait=False)
    md = ((KEY, "order-0001"),)
    with ThreadPoolExecutor(max_workers=2) as pool:
        first = pool.submit(call, {"sleep": 1.5}, metadata=md, timeout=10)
        while orders.calls == 0:
            time.sleep(0.005)
        with pytest.raises(grpc.RpcError) as info:
            call({"sleep": 1.5}, metadata=md, timeout=10)
        assert info.value.code() == grpc.StatusCode.ABORTED
        assert any(k == "grpc-retry-pushback-ms" for k, _ in info.value.trailing_metadata())
        assert first.result(10) == {"call": 1, "sku": None}


def test_sync_dropped_call_retried_gives_one_effect(sync_orders: Callable[..., Any]) -> None:
    orders, call, _ = sync_orders()
    md = ((KEY, "order-0001"),)
    with pytest.raises(grpc.RpcError) as info:
        call({"sku": "A1", "sleep": 0.5}, metadata=md, timeout=0.1)  # the client gives up
    assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    got, c = call.with_call({"sku": "A1", "sleep": 0.5}, metadata=md, timeout=10)
    assert got == {"call": 1, "sku": "A1"} and orders.calls == 1


@pytest.mark.parametrize("store_kind", ["memory", "redis"])
async def test_aio_concurrent_duplicates_and_problems(store_kind: str) -> None:
    orders = Orders()
    server, port, interceptor = await aio_server(orders, store=_store(store_kind))
    try:
        async with aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            call = channel.unary_unary(
                METHOD, request_serializer=_dumps, response_deserializer=json.loads
            )
            md = ((KEY, "order-0001"),)
            calls = [call({"sku": "A1", "sleep": 0.2}, metadata=md, timeout=30) for _ in range(100)]
            replies = await asyncio.gather(*calls)
            trailers = await asyncio.gather(*(c.trailing_metadata() for c in calls))
            assert orders.calls == 1 and all(r == {"call": 1, "sku": "A1"} for r in replies)
            assert sum(_replayed(t) for t in trailers) == 99
            with pytest.raises(aio.AioRpcError) as missing:
                await call({"sku": "A1"}, timeout=10)
            assert missing.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            # A gRPC server names its key: the metadata, not the HTTP header.
            details = missing.value.details() or ""
            assert details.startswith("write operations require x-idempotency-key metadata"), (
                details
            )
            with pytest.raises(aio.AioRpcError) as reused:
                await call({"sku": "B2"}, metadata=md, timeout=10)
            assert reused.value.code() == grpc.StatusCode.FAILED_PRECONDITION
            for _ in range(2):
                with pytest.raises(aio.AioRpcError) as final:
                    await call(
                        {"abort": "ALREADY_EXISTS"}, metadata=((KEY, "order-0002"),), timeout=10
                    )
                assert (final.value.code(), final.value.details()) == (
                    grpc.StatusCode.ALREADY_EXISTS,
                    "call 2 aborted",
                )
            with pytest.raises(aio.AioRpcError) as raised:
                await call({"raise": True}, metadata=((KEY, "order-0003"),), timeout=10)
            assert raised.value.code() == grpc.StatusCode.UNKNOWN
            assert await call({}, metadata=((KEY, "order-0003"),), timeout=10) == {
                "call": 4,
                "sku": None,
            }
    finally:
        await server.stop(None)
    assert interceptor.counters().replayed == 100


async def test_aio_cancelled_call_keeps_running_and_the_retry_gets_its_answer() -> None:
    orders = Orders()
    server, port, _ = await aio_server(orders)
    try:
        async with aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            call = channel.unary_unary(
                METHOD, request_serializer=_dumps, response_deserializer=json.loads
            )
            md = ((KEY, "order-0001"),)
            with pytest.raises(aio.AioRpcError) as info:
                await call({"sku": "A1", "sleep": 0.5}, metadata=md, timeout=0.1)
            assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
            retry = call({"sku": "A1", "sleep": 0.5}, metadata=md, timeout=10)
            assert await retry == {"call": 1, "sku": "A1"}
            assert _replayed(await retry.trailing_metadata())
    finally:
        await server.stop(None)
    assert orders.calls == 1


async def test_aio_no_wait_is_aborted_with_pushback() -> None:
    orders = Orders()
    server, port, _ = await aio_server(orders, wait=False)
    try:
        async with aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            call = channel.unary_unary(
                METHOD, request_serializer=_dumps, response_deserializer=json.loads
            )
            md = ((KEY, "order-0001"),)
            first = asyncio.ensure_future(call({"sleep": 1.5}, metadata=md, timeout=10))
            while orders.calls == 0:
                await asyncio.sleep(0.005)
            with pytest.raises(aio.AioRpcError) as info:
                await call({"sleep": 1.5}, metadata=md, timeout=10)
            assert info.value.code() == grpc.StatusCode.ABORTED
            assert any(k == "grpc-retry-pushback-ms" for k, _ in info.value.trailing_metadata())
            assert await first == {"call": 1, "sku": None}
    finally:
        await server.stop(None)


def test_streaming_and_uncovered_methods_pass_through(sync_orders: Callable[..., Any]) -> None:
    orders, call, interceptor = sync_orders(methods=["/shop.Orders/Other"])
    assert call({"sku": "A1"}, timeout=10) == {"call": 1, "sku": "A1"}
    assert call({"sku": "A1"}, timeout=10) == {"call": 2, "sku": "A1"}
    assert interceptor.counters().led == 0


class _CompleteFails:
    """A store that runs the action, then cannot keep its outcome (as a store that
    became unreachable, or whose lease was lost, while the handler ran)."""

    def execute_sync(self, scoped: Any, fp: str, fn: Any, /, *, wait: bool = True) -> Any:
        fn()
        raise oncely.StoreUnavailableError("unavailable: the store went away")

    async def execute(self, scoped: Any, fp: str, fn: Any, /, *, wait: bool = True) -> Any:
        await fn()
        raise oncely.StoreUnavailableError("unavailable: the store went away")


def test_sync_an_answer_the_store_cannot_keep_is_still_the_answer(
    sync_orders: Callable[..., Any],
) -> None:
    orders, call, _ = sync_orders(store=_CompleteFails())
    # Not UNAVAILABLE, which a client retries, running the handler again.
    assert call({"sku": "A1"}, metadata=((KEY, "order-0001"),), timeout=30) == {
        "call": 1,
        "sku": "A1",
    }
    with pytest.raises(grpc.RpcError) as info:
        call({"abort": "NOT_FOUND"}, metadata=((KEY, "order-0002"),), timeout=30)
    assert info.value.code() == grpc.StatusCode.NOT_FOUND
    assert orders.calls == 2


async def test_aio_an_answer_the_store_cannot_keep_is_still_the_answer() -> None:
    orders = Orders()
    server, port, _ = await aio_server(orders, store=_CompleteFails())
    try:
        async with aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            call = channel.unary_unary(
                METHOD, request_serializer=_dumps, response_deserializer=json.loads
            )
            assert await call({"sku": "A1"}, metadata=((KEY, "order-0001"),), timeout=30) == {
                "call": 1,
                "sku": "A1",
            }
    finally:
        await server.stop(None)
    assert orders.calls == 1


def test_sync_an_unusable_tenant_is_internal_not_invalid_argument(
    sync_orders: Callable[..., Any],
) -> None:
    orders, call, _ = sync_orders(tenant=lambda context: "")
    with pytest.raises(grpc.RpcError) as info:
        call({"sku": "A1"}, metadata=((KEY, "order-0001"),), timeout=30)
    # The tenant is the server's fault, not the client's key.
    assert info.value.code() == grpc.StatusCode.INTERNAL and orders.calls == 0


@pytest.mark.parametrize("outcome", ["ok", "abort"])
def test_sync_replay_keeps_the_handlers_trailing_metadata(outcome: str) -> None:
    calls = 0

    def create(request: dict[str, Any], context: Any) -> dict[str, Any]:
        nonlocal calls
        calls += 1
        context.set_trailing_metadata((("x-order-id", "7"), ("status-detail-bin", b"\x00\x01\xff")))
        if outcome == "abort":
            context.abort(grpc.StatusCode.NOT_FOUND, "no such sku")
        return {"call": calls}

    handler = grpc.method_handlers_generic_handler(
        "shop.Orders", {"Create": grpc.unary_unary_rpc_method_handler(create, json.loads, _dumps)}
    )
    server = grpc.server(
        ThreadPoolExecutor(max_workers=4),
        interceptors=[IdempotencyInterceptor(store=oncely.IdempotencyStore())],
    )
    server.add_generic_rpc_handlers((handler,))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            call = channel.unary_unary(
                METHOD, request_serializer=_dumps, response_deserializer=json.loads
            )
            trailers = []
            for _ in range(2):
                try:
                    _, c = call.with_call(
                        {"sku": "A1"}, metadata=((KEY, "order-0001"),), timeout=30
                    )
                    trailers.append(dict(c.trailing_metadata()))
                except grpc.RpcError as e:
                    assert e.code() == grpc.StatusCode.NOT_FOUND and e.details() == "no such sku"
                    trailers.append(dict(e.trailing_metadata()))
    finally:
        server.stop(None)
    assert calls == 1
    first, replay = trailers
    assert first["x-order-id"] == replay["x-order-id"] == "7"
    assert first["status-detail-bin"] == replay["status-detail-bin"] == b"\x00\x01\xff"
    assert replay.get("idempotent-replayed") == "true" and "idempotent-replayed" not in first


@pytest.mark.parametrize("outcome", ["ok", "abort"])
def test_sync_installed_twice_with_one_store_the_outer_leads(outcome: str) -> None:
    """Two interceptors on one store (a server's list and a shared helper's, say): the
    outer one leads, the inner passes the call on. Before, the inner asked the store
    again from inside the lead and every keyed call was refused INTERNAL."""

    def answer(call_number: int, context: Any) -> dict[str, Any]:
        if outcome == "abort":
            context.abort(grpc.StatusCode.NOT_FOUND, "no such sku")
        return {"call": call_number}

    store = oncely.IdempotencyStore()
    chain = [IdempotencyInterceptor(store=store), IdempotencyInterceptor(store=store)]
    answers, calls = _twice_through(chain, "order-twice-1", answer)
    first = {"call": 1} if outcome == "ok" else grpc.StatusCode.NOT_FOUND
    assert answers == [(first, False), (first, True)]
    assert calls == 1


async def test_aio_installed_twice_with_one_store_the_outer_leads() -> None:
    orders = Orders()

    async def create(request: dict[str, Any], context: Any) -> dict[str, Any]:
        return {"call": orders.begin()}

    handler = grpc.method_handlers_generic_handler(
        "shop.Orders", {"Create": grpc.unary_unary_rpc_method_handler(create, json.loads, _dumps)}
    )
    store = oncely.IdempotencyStore()
    server = aio.server(interceptors=[AioInterceptor(store=store), AioInterceptor(store=store)])
    server.add_generic_rpc_handlers((handler,))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        async with aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            call = channel.unary_unary(
                METHOD, request_serializer=_dumps, response_deserializer=json.loads
            )
            answers = []
            for _ in range(2):
                c = call({"sku": "A1"}, metadata=((KEY, "order-twice-2"),), timeout=30)
                answers.append((await c, _replayed(await c.trailing_metadata())))
    finally:
        await server.stop(None)
    assert answers == [({"call": 1}, False), ({"call": 1}, True)]
    assert orders.calls == 1


def _twice_through(
    chain: list[Any],
    key: str,
    answer: Callable[[int, Any], dict[str, Any]] = lambda n, context: {"call": n},
) -> tuple[list[Any], int]:
    """Two calls with ``key`` to a sync server with the interceptors ``chain``: each
    answer (the value, or the status code of a failed call) with whether it was marked
    replayed, and how many times the handler ran. The handler answers
    ``answer(call number, context)``."""
    orders = Orders()

    def create(request: dict[str, Any], context: Any) -> dict[str, Any]:
        return answer(orders.begin(), context)

    handler = grpc.method_handlers_generic_handler(
        "shop.Orders", {"Create": grpc.unary_unary_rpc_method_handler(create, json.loads, _dumps)}
    )
    server = grpc.server(ThreadPoolExecutor(max_workers=4), interceptors=chain)
    server.add_generic_rpc_handlers((handler,))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    answers: list[Any] = []
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            call = channel.unary_unary(
                METHOD, request_serializer=_dumps, response_deserializer=json.loads
            )
            for _ in range(2):
                try:
                    value, c = call.with_call({"sku": "A1"}, metadata=((KEY, key),), timeout=30)
                    answers.append((value, _replayed(c.trailing_metadata())))
                except grpc.RpcError as e:
                    answers.append((e.code(), _replayed(e.trailing_metadata())))
    finally:
        server.stop(None)
    return answers, orders.calls


class _Ctx:
    """A context handed on wrapped (as OpenTelemetry's instrumentation does)."""

    def __init__(self, context: Any) -> None:
        self._context = context

    def __getattr__(self, name: str) -> Any:
        return getattr(self._context, name)


class _WrapContext(grpc.ServerInterceptor):  # type: ignore[misc]
    def intercept_service(self, continuation: Any, details: Any) -> Any:
        h = continuation(details)
        if h is None or h.unary_unary is None:
            return h
        behavior = h.unary_unary
        return grpc.unary_unary_rpc_method_handler(
            lambda request, context: behavior(request, _Ctx(context)),
            h.request_deserializer,
            h.response_serializer,
        )


def test_sync_installed_twice_with_a_context_wrapping_interceptor_between() -> None:
    """[oncely, an interceptor that wraps the context, oncely] on one store: the call is
    led once (the lead is known by the call's context of execution, not by its
    ServicerContext object, which the middle one replaces). Before, every keyed call was
    refused INTERNAL."""
    store = oncely.IdempotencyStore()
    answers, calls = _twice_through(
        [
            IdempotencyInterceptor(store=store),
            _WrapContext(),
            IdempotencyInterceptor(store=store),
        ],
        "order-wrapped-1",
    )
    assert answers == [({"call": 1}, False), ({"call": 1}, True)]
    assert calls == 1


class _Offload(grpc.ServerInterceptor):  # type: ignore[misc]
    """Runs the rest of the call on a thread of its own (as a deadline interceptor
    does): no context of execution goes with it, the ServicerContext does."""

    def __init__(self) -> None:
        self.pool = ThreadPoolExecutor(max_workers=4)

    def intercept_service(self, continuation: Any, details: Any) -> Any:
        h = continuation(details)
        if h is None or h.unary_unary is None:
            return h
        behavior = h.unary_unary
        return grpc.unary_unary_rpc_method_handler(
            lambda request, context: self.pool.submit(behavior, request, context).result(20),
            h.request_deserializer,
            h.response_serializer,
        )


def test_sync_installed_twice_with_an_interceptor_between_that_moves_to_another_thread() -> None:
    """[oncely, an interceptor running the call on another thread, oncely] on one store:
    the call is led once (the lead is also known by its ServicerContext). Found by its
    context of execution alone, the inner waited for the outer for good."""
    store = oncely.IdempotencyStore()
    offload = _Offload()
    try:
        answers, calls = _twice_through(
            [IdempotencyInterceptor(store=store), offload, IdempotencyInterceptor(store=store)],
            "order-offload-1",
        )
    finally:
        offload.pool.shutdown(wait=False)
    assert answers == [({"call": 1}, False), ({"call": 1}, True)]
    assert calls == 1


def test_sync_installed_twice_with_a_wrapping_and_a_thread_moving_interceptor_between() -> None:
    """Both at once between two of ours: the context of execution and the ServicerContext
    object are lost, the invocation metadata (which a wrapper delegates) is not."""
    store = oncely.IdempotencyStore()
    offload = _Offload()
    try:
        answers, calls = _twice_through(
            [
                IdempotencyInterceptor(store=store),
                _WrapContext(),
                offload,
                IdempotencyInterceptor(store=store),
            ],
            "order-wrap-offload-1",
        )
    finally:
        offload.pool.shutdown(wait=False)
    assert answers == [({"call": 1}, False), ({"call": 1}, True)]
    assert calls == 1
