"""A real client and server: a grpcio (asyncio) server whose CreateOrder is guarded by
an IdempotencyStore keyed by the `x-idempotency-key` metadata, and which drops the first
response after executing. The client retries through oncely with one key: exactly one
order is created and the client gets it. Loopback only."""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import oncely
import pytest
from oncely import headers

grpc = pytest.importorskip("grpc")
aio = pytest.importorskip("grpc.aio")

METHOD = "/shop.Orders/CreateOrder"
STATUS = {s.value[0]: s for s in grpc.StatusCode}


class OrderService:
    def __init__(self, drop_first: int = 1, pushback_first: int = 0) -> None:
        self.store = oncely.IdempotencyStore(ttl=3600.0)
        self.orders: list[dict[str, Any]] = []
        self.drop_first = drop_first
        self.pushback_first = pushback_first
        self.received = 0

    async def create_order(self, request: bytes, context: Any) -> bytes:
        self.received += 1
        if self.pushback_first > 0:
            self.pushback_first -= 1
            await context.abort(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                "slow down",
                trailing_metadata=((headers.GRPC_RETRY_PUSHBACK_MS, "50"),),
            )
        md = {k: v for k, v in context.invocation_metadata()}
        key = md.get(headers.GRPC_IDEMPOTENCY_KEY)
        try:
            scoped = oncely.scope("acme", METHOD, key or "")
        except oncely.OncelyError as e:
            await context.abort(STATUS[int(e.code)], str(e))
        req = json.loads(request)

        async def execute_order() -> dict[str, Any]:
            await asyncio.sleep(0.01)  # the business effect
            order = {"id": f"order-{len(self.orders) + 1}", **req}
            self.orders.append(order)
            return order

        try:
            result = await self.store.execute(scoped, oncely.fingerprint(req), execute_order)
        except oncely.OncelyError as e:
            await context.abort(STATUS[int(e.code)], str(e))
        if self.drop_first > 0:
            self.drop_first -= 1
            # Executed, but the response is lost: the client sees UNAVAILABLE.
            await context.abort(grpc.StatusCode.UNAVAILABLE, "connection reset after executing")
        if result.replayed:
            await context.send_initial_metadata(
                ((headers.HTTP_IDEMPOTENT_REPLAYED.lower(), "true"),)
            )
        return json.dumps(result.value).encode()


async def serve(service: OrderService) -> tuple[Any, int]:
    server = aio.server()
    handler = grpc.method_handlers_generic_handler(
        "shop.Orders",
        {"CreateOrder": grpc.unary_unary_rpc_method_handler(service.create_order)},
    )
    server.add_generic_rpc_handlers((handler,))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    return server, port


async def create_order(channel: Any, key: str, req: dict[str, Any]) -> dict[str, Any]:
    call = channel.unary_unary(METHOD)
    reply = await call(
        json.dumps(req).encode(),
        metadata=((headers.GRPC_IDEMPOTENCY_KEY, key),),
        timeout=5,
    )
    return json.loads(reply)  # type: ignore[no-any-return]


pytestmark = pytest.mark.timeout(60)
POLICY = oncely.RetryPolicy(max_attempts=5, base_delay=0.01, max_delay=0.1)


async def test_dropped_response_retried_with_one_key_gives_one_order() -> None:
    service = OrderService(drop_first=1)
    server, port = await serve(service)
    try:
        async with aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            key = oncely.new_key()  # once per intent
            events: list[oncely.RetryEvent] = []
            order = await oncely.retry(
                create_order,
                channel,
                key,
                {"sku": "A1", "qty": 1},
                policy=POLICY,
                safe=True,
                on_retry=events.append,
            )
    finally:
        await server.stop(None)
    assert service.received == 2
    assert len(service.orders) == 1 and order == service.orders[0]
    assert [e.rule for e in events] == ["transient_safe"]
    assert isinstance(events[0].error, aio.AioRpcError)


async def test_concurrent_clients_with_one_key_give_one_order() -> None:
    service = OrderService(drop_first=3)
    server, port = await serve(service)
    try:
        async with aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            key = oncely.new_key()
            orders = await asyncio.gather(
                *(
                    oncely.retry(
                        create_order,
                        channel,
                        key,
                        {"sku": "B2", "qty": 3},
                        policy=POLICY,
                        safe=True,
                    )
                    for _ in range(10)
                )
            )
    finally:
        await server.stop(None)
    assert len(service.orders) == 1
    assert all(o == service.orders[0] for o in orders)


async def test_not_safe_is_not_retried_and_keys_are_checked() -> None:
    service = OrderService(drop_first=1)
    server, port = await serve(service)
    try:
        async with aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            with pytest.raises(aio.AioRpcError) as info:
                await oncely.retry(
                    create_order, channel, oncely.new_key(), {"sku": "C3"}, policy=POLICY
                )
            assert info.value.code() == grpc.StatusCode.UNAVAILABLE
            assert info.value.stop_reason == "not_retryable"  # type: ignore[attr-defined]
            with pytest.raises(aio.AioRpcError) as bad:
                await oncely.retry(
                    create_order, channel, "bad key!", {"sku": "C3"}, policy=POLICY, safe=True
                )
            assert bad.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            key = oncely.new_key()
            await oncely.retry(create_order, channel, key, {"sku": "D4"}, policy=POLICY, safe=True)
            with pytest.raises(aio.AioRpcError) as mismatch:
                await create_order(channel, key, {"sku": "D5"})
            assert mismatch.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    finally:
        await server.stop(None)
    assert [o["sku"] for o in service.orders] == ["C3", "D4"]


async def test_pushback_trailer_sets_the_delay() -> None:
    service = OrderService(drop_first=0, pushback_first=1)
    server, port = await serve(service)
    try:
        async with aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            events: list[oncely.RetryEvent] = []
            started = time.monotonic()
            await oncely.retry(
                create_order,
                channel,
                oncely.new_key(),
                {"sku": "E5"},
                policy=POLICY,
                safe=True,
                on_retry=events.append,
            )
    finally:
        await server.stop(None)
    assert [(e.delay, e.from_server, e.rule) for e in events] == [(0.05, True, "rate_limited")]
    assert time.monotonic() - started >= 0.05
