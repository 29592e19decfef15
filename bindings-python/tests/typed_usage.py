"""Typed usage of the public API, checked by `mypy --strict` (test_docs.py and
scripts/test-python). Also run as a plain script by the tests."""

from __future__ import annotations

import asyncio
from datetime import timedelta
from typing import Any, Optional, Union, assert_type

import oncely
from oncely import Code, Executed, IdempotencyStore, RetryEvent, RetryPolicy


@oncely.retrying(policy=RetryPolicy(max_attempts=2, base_delay=0.0), safe=True)
def add(a: int, b: int = 1) -> int:
    return a + b


@oncely.retrying(safe=True, deadline=1.0)
async def fetch(name: str) -> bytes:
    return name.encode()


def on_retry(event: RetryEvent) -> None:
    assert_type(event.attempt, int)
    assert_type(event.delay, float)
    assert_type(event.rule, str)


async def main() -> None:
    assert_type(add(1), int)
    assert_type(await fetch("x"), bytes)

    async def call(n: int) -> str:
        return str(n)

    s = await oncely.retry(
        call,
        3,
        policy=RetryPolicy(seed=1),
        safe=True,
        on_retry=on_retry,
        deadline=timedelta(seconds=1),
        budget=oncely.RetryBudget(),
    )
    assert_type(s, str)
    assert_type(oncely.retry_sync(add, 1, b=2), int)

    store = IdempotencyStore(ttl=timedelta(hours=1), max_entries=1000)
    scoped = oncely.scope("acme", "CreateOrder", oncely.derive_key("order-42", "create"))
    fp = oncely.fingerprint({"sku": "A1", "qty": 1})

    async def create() -> dict[str, int]:
        return {"id": 1}

    done = await store.execute(scoped, fp, create)
    assert_type(done, Executed[dict[str, int]])
    assert_type(done.value, dict[str, int])
    assert_type(done.replayed, bool)
    again = store.execute_sync(scoped, fp, lambda: {"id": 2})
    assert_type(again.value, dict[str, int])
    plain = await store.execute(scoped, fp, lambda: {"id": 3})  # a plain function
    assert_type(plain.value, dict[str, int])

    # One protocol for both stores: a server typed `store: oncely.Store` takes either.
    async def serve(store: oncely.Store) -> dict[str, int]:
        assert_type(store.ttl, float)
        sync = store.execute_sync(scoped, fp, lambda: {"id": 4})
        assert_type(sync.value, dict[str, int])
        return (await store.execute(scoped, fp, create)).value

    assert_type(await serve(store), dict[str, int])
    either: list[oncely.Store] = [store, oncely.RedisStore("redis://127.0.0.1:6379")]
    assert len(either) == 2
    assert_type(oncely.http_status_of(ValueError()), Optional[int])

    def action(attempt: oncely.Attempt) -> int:
        assert_type(attempt.number, int)
        assert_type(attempt.remaining, Optional[float])
        return attempt.previous_attempts

    assert_type(oncely.retry_sync(action, pass_attempt=True), int)

    c = oncely.classify(Code.UNAVAILABLE, safe=True)
    assert_type(c.retryable, bool)
    assert_type(oncely.classify(oncely.Failure(Code.ABORTED, delay=1.0), safe=True).rule, str)
    assert_type(Code.from_http(503), Code)
    assert_type(oncely.new_key(), str)
    assert_type(oncely.headers.GRPC_IDEMPOTENCY_KEY, str)
    try:
        oncely.validate_key("bad key")
    except oncely.InvalidKeyError as e:
        assert_type(e.code, Code)
        assert_type(e.field, str | None)
    try:
        store.execute_sync(scoped, "other", lambda: {"id": 3})
    except oncely.FingerprintMismatchError:
        pass
    except oncely.InProgressError as e:
        assert_type(e.retry_after, float)


async def redis_usage() -> None:
    """Type-checked only (it needs a Redis): oncely.RedisStore has IdempotencyStore's API."""
    shared = oncely.RedisStore(
        "redis://127.0.0.1:6379", lease=30.0, ttl=timedelta(days=1), prefix="shop"
    )
    scoped = oncely.scope("acme", "CreateOrder", oncely.new_key())
    fp = oncely.fingerprint({"sku": "A1"})

    async def create() -> dict[str, int]:
        return {"id": 1}

    on_redis = await shared.execute(scoped, fp, create, wait=False)
    assert_type(on_redis, Executed[dict[str, int]])
    raw = shared.execute_sync(scoped, fp, lambda: b"bytes")
    assert_type(raw.value, bytes)
    assert_type(shared.lease, float)
    assert_type(shared.counters(), dict[str, int])
    own = oncely.RedisStore("redis://127.0.0.1:6379", dumps=lambda v: repr(v), loads=lambda s: s)
    assert own.dumps is not None and own.loads is not None


def extraction_and_errors() -> None:
    reasons = oncely.ReasonCodes()
    reasons.register("PAYMENT_PENDING", "UNAVAILABLE")
    reasons.register("CARD_DECLINED", oncely.Code.FAILED_PRECONDITION)
    assert_type(reasons.resolve("PAYMENT_PENDING"), Optional[int])
    assert_type(oncely.code_of(ConnectionResetError(), reasons), oncely.Code)
    failure = oncely.failure_of(TimeoutError(), reasons)
    assert_type(failure, Union[int, oncely.Failure])
    try:
        oncely.validate_key("short")
    except oncely.OncelyError as e:
        assert_type(e.kind, str)
        assert_type(e.http_status, int)
    oncely.retry_sync(lambda: 1, safe=True, reasons=reasons)


def server_adapters() -> None:
    from oncely import http
    from oncely.asgi import Counters, CounterSet, IdempotencyMiddleware, Scope

    async def app(scope: Scope, receive: Any, send: Any) -> None:
        return None

    def tenant(scope: Scope) -> str:
        return str(scope.get("user", "anonymous"))

    counters = CounterSet()
    mw = IdempotencyMiddleware(
        app,
        store=oncely.IdempotencyStore(),
        tenant=tenant,
        wait=False,
        on_replay=lambda scope, key: None,
        counters=counters,
    )
    IdempotencyMiddleware(app, store=oncely.RedisStore("redis://127.0.0.1:6379"), tenant="acme")
    assert_type(mw.counters(), Counters)
    from oncely import wsgi

    def wsgi_app(environ: wsgi.Environ, start_response: wsgi.StartResponse) -> list[bytes]:
        start_response("201 Created", [("content-type", "text/plain")])
        return [b"ok"]

    guarded = wsgi.IdempotencyMiddleware(
        wsgi_app, store=oncely.IdempotencyStore(), tenant=lambda environ: "acme", methods=["POST"]
    )
    assert_type(guarded.counters(), Counters)
    from oncely.grpc import IdempotencyInterceptor as SyncInterceptor
    from oncely.grpc.aio import IdempotencyInterceptor as AioInterceptor

    sync_interceptor = SyncInterceptor(
        store=oncely.IdempotencyStore(),
        tenant=lambda context: "acme",
        methods=["/shop.Orders/Create"],
    )
    aio_interceptor = AioInterceptor(store=oncely.IdempotencyStore(), wait=False)
    assert_type(sync_interceptor.counters(), Counters)
    assert_type(aio_interceptor.counters(), Counters)
    import httpx
    from oncely.httpx import AsyncRetryTransport, RetryTransport
    from oncely.requests import IdempotentAdapter

    policy = oncely.RetryPolicy(max_attempts=3)
    async_client = httpx.AsyncClient(transport=AsyncRetryTransport(policy=policy, deadline=5.0))
    sync_client = httpx.Client(
        transport=RetryTransport(methods=["POST"], budget=oncely.RetryBudget())
    )
    adapter = IdempotentAdapter(policy=policy)
    assert async_client is not None and sync_client is not None and adapter is not None
    config = http.ServerConfig(methods=["POST"], body_cap=1024)
    decision = config.read_key("POST", [b"order-0001"])
    assert_type(decision, Union[None, str, http.Problem])
    if isinstance(decision, http.Problem):
        assert_type(decision.body(), bytes)
    assert_type(http.request_fingerprint("POST", "/orders", None, b"{}"), str)
    record = http.encode_response(201, [("content-type", b"application/json")], b"{}")
    assert_type(http.decode_response(record)[0], int)


if __name__ == "__main__":
    asyncio.run(main())
