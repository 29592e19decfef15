"""The client adapters against a real server: oncely.httpx transports (async and sync)
and the oncely.requests adapter, calling a uvicorn server whose Starlette app is behind
oncely.asgi.IdempotencyMiddleware, behind a layer that loses the first answers after
the handler ran (the client sees 503). One key per logical call, kept across its
retries, so the effect happens once."""

from __future__ import annotations

from typing import Any, Iterator

import oncely
import pytest
from oncely.asgi import IdempotencyMiddleware

httpx = pytest.importorskip("httpx")
requests = pytest.importorskip("requests")
pytest.importorskip("uvicorn")
pytest.importorskip("starlette")

import oncely.httpx  # noqa: E402
import oncely.requests  # noqa: E402
from asgi_server import Server  # noqa: E402
from starlette.applications import Starlette  # noqa: E402
from starlette.requests import Request  # noqa: E402
from starlette.responses import JSONResponse  # noqa: E402
from starlette.routing import Route  # noqa: E402

POLICY = oncely.RetryPolicy(max_attempts=4, base_delay=0.01, max_delay=0.05)


class Lossy:
    """Runs the app, then loses its answer (503) for the first ``lose`` requests;
    records the Idempotency-Key of every request."""

    def __init__(self, app: Any) -> None:
        self.app = app
        self.lose = 0
        self.keys: list[str] = []

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        headers = dict(scope["headers"])
        self.keys.append(headers.get(b"idempotency-key", b"").decode())
        if self.lose <= 0:
            await self.app(scope, receive, send)
            return
        self.lose -= 1

        async def drop(message: Any) -> None:
            pass

        await self.app(scope, receive, drop)
        await send(
            {"type": "http.response.start", "status": 503, "headers": [(b"retry-after", b"0")]}
        )
        await send({"type": "http.response.body", "body": b"lost"})


class Orders:
    def __init__(self) -> None:
        self.created: list[Any] = []

    async def create(self, request: Request) -> JSONResponse:
        body = await request.json()
        if body.get("invalid"):
            return JSONResponse({"error": "invalid"}, status_code=422)
        self.created.append(body)
        return JSONResponse({"id": len(self.created)}, status_code=201)

    async def read(self, request: Request) -> JSONResponse:
        return JSONResponse({"count": len(self.created)})


@pytest.fixture
def shop() -> Iterator[tuple[str, Lossy, Orders]]:
    orders = Orders()
    app = Starlette(
        routes=[
            Route("/orders", orders.create, methods=["POST"]),
            Route("/orders", orders.read, methods=["GET"]),
        ]
    )
    app.add_middleware(IdempotencyMiddleware, store=oncely.IdempotencyStore())
    lossy = Lossy(app)
    with Server(lossy) as srv:
        yield srv.url, lossy, orders


async def test_httpx_async_lost_answer_retried_with_one_key(
    shop: tuple[str, Lossy, Orders],
) -> None:
    url, lossy, orders = shop
    lossy.lose = 2
    transport = oncely.httpx.AsyncRetryTransport(policy=POLICY)
    async with httpx.AsyncClient(transport=transport, base_url=url, timeout=10) as client:
        r = await client.post("/orders", json={"sku": "A1"})
        assert (r.status_code, r.json(), r.headers["idempotent-replayed"]) == (
            201,
            {"id": 1},
            "true",
        )
        assert len(lossy.keys) == 3 and len(set(lossy.keys)) == 1 and lossy.keys[0]
        other = await client.post("/orders", json={"sku": "A1"})  # another logical call
        assert other.json() == {"id": 2} and lossy.keys[-1] != lossy.keys[0]
        final = await client.post("/orders", json={"invalid": True})
        assert final.status_code == 422 and final.json() == {"error": "invalid"}
        mine = await client.post(
            "/orders", json={"sku": "B2"}, headers={"Idempotency-Key": "my-key-0001"}
        )
        assert mine.status_code == 201 and lossy.keys[-1] == "my-key-0001"
        read = await client.get("/orders")
        assert read.json() == {"count": 3} and lossy.keys[-1] == ""
    assert len(orders.created) == 3


def test_httpx_sync_exhausted_retries_return_the_last_answer(
    shop: tuple[str, Lossy, Orders],
) -> None:
    url, lossy, orders = shop
    lossy.lose = 10
    with httpx.Client(
        transport=oncely.httpx.RetryTransport(policy=POLICY), base_url=url, timeout=10
    ) as client:
        r = client.post("/orders", json={"sku": "A1"})
    assert (r.status_code, r.content) == (503, b"lost")
    assert len(lossy.keys) == 4 and len(set(lossy.keys)) == 1
    assert len(orders.created) == 1  # four attempts, one effect


def test_requests_adapter_lost_answer_retried_with_one_key(shop: tuple[str, Lossy, Orders]) -> None:
    url, lossy, orders = shop
    lossy.lose = 1
    session = requests.Session()
    session.mount("http://", oncely.requests.IdempotentAdapter(policy=POLICY))
    r = session.post(url + "/orders", json={"sku": "A1"}, timeout=10)
    assert (r.status_code, r.json(), r.headers["idempotent-replayed"]) == (201, {"id": 1}, "true")
    assert len(lossy.keys) == 2 and len(set(lossy.keys)) == 1
    final = session.post(url + "/orders", json={"invalid": True}, timeout=10)
    assert final.status_code == 422 and len(lossy.keys) == 3
    assert len(orders.created) == 1


class Early:
    """Answers the first request 503 at once while its app goes on running (an answer
    lost before the handler ended), so the retry finds it in progress."""

    def __init__(self, app: Any) -> None:
        self.app = app
        self.first = True
        self.keys: list[str] = []
        self.tasks: list[Any] = []

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        import asyncio

        if scope["type"] != "http":
            return
        self.keys.append(dict(scope["headers"]).get(b"idempotency-key", b"").decode())
        if not self.first:
            await self.app(scope, receive, send)
            return
        self.first = False
        request = await receive()  # read before the answer ends the request

        async def replay() -> Any:
            return request

        async def drop(message: Any) -> None:
            pass

        self.tasks.append(asyncio.ensure_future(self.app(scope, replay, drop)))
        await send(
            {"type": "http.response.start", "status": 503, "headers": [(b"retry-after", b"0")]}
        )
        await send({"type": "http.response.body", "body": b"lost"})


@pytest.fixture
def busy_shop() -> Iterator[tuple[str, Early, Orders]]:
    import asyncio

    orders = Orders()

    async def slow(request: Any) -> Any:
        await asyncio.sleep(0.5)
        return await orders.create(request)

    app = Starlette(routes=[Route("/orders", slow, methods=["POST"])])
    app.add_middleware(IdempotencyMiddleware, store=oncely.IdempotencyStore(), wait=False)
    early = Early(app)
    with Server(early) as srv:
        yield srv.url, early, orders


async def test_httpx_in_progress_answer_is_retried_after_its_delay(
    busy_shop: tuple[str, Early, Orders],
) -> None:
    url, early, orders = busy_shop
    transport = oncely.httpx.AsyncRetryTransport(policy=POLICY, deadline=30)
    async with httpx.AsyncClient(transport=transport, base_url=url, timeout=10) as client:
        r = await client.post("/orders", json={"sku": "A1"})
    # Not the 409 of its own earlier attempt, which still ran: that attempt's answer.
    assert (r.status_code, r.json(), r.headers.get("idempotent-replayed")) == (
        201,
        {"id": 1},
        "true",
    )
    assert len(set(early.keys)) == 1 and len(orders.created) == 1


def test_requests_in_progress_answer_is_retried_after_its_delay(
    busy_shop: tuple[str, Early, Orders],
) -> None:
    url, early, orders = busy_shop
    session = requests.Session()
    session.mount("http://", oncely.requests.IdempotentAdapter(policy=POLICY, deadline=30))
    r = session.post(url + "/orders", json={"sku": "A1"}, timeout=10)
    assert (r.status_code, r.json(), r.headers.get("idempotent-replayed")) == (
        201,
        {"id": 1},
        "true",
    )
    assert len(set(early.keys)) == 1 and len(orders.created) == 1


def test_requests_file_body_is_sent_whole_on_every_attempt(shop: tuple[str, Lossy, Orders]) -> None:
    import io

    url, lossy, orders = shop
    lossy.lose = 1
    session = requests.Session()
    session.mount("http://", oncely.requests.IdempotentAdapter(policy=POLICY))
    body = io.BytesIO(b'{"sku":"A1"}')
    r = session.post(
        url + "/orders", data=body, headers={"content-type": "application/json"}, timeout=10
    )
    assert (r.status_code, r.json(), r.headers.get("idempotent-replayed")) == (
        201,
        {"id": 1},
        "true",
    )
    assert len(lossy.keys) == 2 and len(set(lossy.keys)) == 1 and len(orders.created) == 1


def test_requests_generator_body_is_not_resent_under_the_key(
    shop: tuple[str, Lossy, Orders],
) -> None:
    url, lossy, orders = shop
    lossy.lose = 1
    session = requests.Session()
    session.mount("http://", oncely.requests.IdempotentAdapter(policy=POLICY))

    def chunks() -> Iterator[bytes]:
        yield b'{"sku":'
        yield b'"A1"}'

    r = session.post(
        url + "/orders", data=chunks(), headers={"content-type": "application/json"}, timeout=10
    )
    # The lost answer is the outcome: a retry would have sent an empty body under the key.
    assert (r.status_code, r.content) == (503, b"lost")
    assert len(lossy.keys) == 1 and len(orders.created) == 1
