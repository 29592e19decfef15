"""oncely.asgi.IdempotencyMiddleware under a real uvicorn server, with httpx: the
request sequences of tests/vectors/http_server.json on Starlette (memory and Redis
stores), FastAPI, and the cases around them: many concurrent duplicates, a 5xx, a body
over the cap, an app that raises, a streaming response, a client that goes away."""

from __future__ import annotations

import asyncio
import json
import os
import socket
import threading
import uuid
from typing import Any, Iterator, Optional

import oncely
import pytest
from conftest import load_vectors
from oncely import http
from oncely.asgi import IdempotencyMiddleware

pytest.importorskip("uvicorn")
httpx = pytest.importorskip("httpx")
starlette = pytest.importorskip("starlette")

from asgi_server import Dispatch, Handler, Server, tenant_of  # noqa: E402
from starlette.applications import Starlette  # noqa: E402
from starlette.requests import Request  # noqa: E402
from starlette.responses import Response, StreamingResponse  # noqa: E402
from starlette.routing import Route  # noqa: E402

SEQUENCES = [c for c in load_vectors("http_server.json") if c["op"] == "sequence"]
METHODS = ["POST", "PATCH", "PUT", "GET"]
REDIS_URL = os.environ.get("ONCELY_REDIS_URL")


def starlette_app(handler: Handler) -> Starlette:
    async def endpoint(request: Request) -> Response:
        await request.body()
        status, body, headers = await handler.answer(request.headers.get("x-respond"))
        return Response(body, status_code=status, headers=dict(headers))

    return Starlette(
        routes=[
            Route("/orders", endpoint, methods=METHODS),
            Route("/orders/{id}", endpoint, methods=METHODS),
            Route("/payments", endpoint, methods=METHODS),
        ]
    )


def fastapi_app(handler: Handler) -> Any:
    fastapi = pytest.importorskip("fastapi")
    app = fastapi.FastAPI()

    async def endpoint(request: Any) -> Response:
        await request.body()
        status, body, headers = await handler.answer(request.headers.get("x-respond"))
        return Response(body, status_code=status, headers=dict(headers))

    # FastAPI reads the annotation to pass the request (a string under `from __future__`).
    endpoint.__annotations__ = {"request": fastapi.Request, "return": Response}

    for path in ("/orders", "/orders/{id}", "/payments"):
        app.add_api_route(path, endpoint, methods=METHODS)
    return app


@pytest.fixture(scope="module")
def server() -> Iterator[tuple[Server, Dispatch]]:
    dispatch = Dispatch()
    with Server(dispatch) as srv:
        yield srv, dispatch


def _store(kind: str) -> Any:
    if kind == "redis":
        if not REDIS_URL:
            pytest.skip("needs ONCELY_REDIS_URL (scripts/with-redis)")
        return oncely.RedisStore(REDIS_URL, prefix=f"asgi-{uuid.uuid4().hex}")
    return oncely.IdempotencyStore()


def _request_kwargs(r: dict[str, Any]) -> dict[str, Any]:
    headers = dict(r.get("headers", {}))
    if "respond" in r:
        headers["x-respond"] = json.dumps(r["respond"])
    return {
        "method": r["method"],
        "url": r["path"],
        "headers": headers,
        "content": r.get("body", "").encode(),
    }


def _check(resp: Any, expect: dict[str, Any], where: str) -> None:
    assert resp.status_code == expect["status"], (where, resp.status_code, resp.text[:200])
    if "replayed" in expect:
        got = resp.headers.get("idempotent-replayed") == "true"
        assert got is expect["replayed"], (where, dict(resp.headers))
    if "call" in expect:
        n = expect["call"]
        if "body_len" in expect:
            assert len(resp.content) == expect["body_len"], where
            assert resp.headers.get("etag") == f'"call-{n}"', where
        else:
            assert resp.json() == {"call": n}, (where, resp.text)
    if "problem" in expect:
        assert resp.headers["content-type"] == http.PROBLEM_CONTENT_TYPE, where
        body = resp.json()
        assert (body["type"], body["status"]) == (expect["problem"], expect["status"]), where
    for name, value in expect.get("headers", {}).items():
        assert resp.headers.get(name) == value, (where, name, dict(resp.headers))


async def run_sequence(case: dict[str, Any], url: str, handler: Handler) -> None:
    limits = httpx.Limits(max_connections=300, max_keepalive_connections=300)
    async with httpx.AsyncClient(base_url=url, timeout=30, limits=limits) as client:
        background: Optional[asyncio.Task[Any]] = None
        for i, step in enumerate(case["steps"]):
            where = f"{case['comment']} / step {i}"
            if "concurrent" in step:
                kw = _request_kwargs(step["request"])
                resps = await asyncio.gather(
                    *(client.request(**kw) for _ in range(step["concurrent"]))
                )
                expect = step["expect"]
                for r in resps:
                    _check(r, {k: v for k, v in expect.items() if k != "replayed_count"}, where)
                replayed = sum(r.headers.get("idempotent-replayed") == "true" for r in resps)
                assert replayed == expect["replayed_count"], where
            elif "background" in step:
                background = asyncio.ensure_future(
                    client.request(**_request_kwargs(step["background"]))
                )
            elif "await_background" in step:
                assert background is not None
                _check(await asyncio.wait_for(background, 30), step["expect"], where)
            elif "wait_handler_calls" in step:
                for _ in range(4000):
                    if handler.calls >= step["wait_handler_calls"]:
                        break
                    await asyncio.sleep(0.005)
                assert handler.calls >= step["wait_handler_calls"], where
            else:
                _check(
                    await client.request(**_request_kwargs(step["request"])), step["expect"], where
                )
    assert handler.calls == case["handler_calls"], case["comment"]


def _middleware_app(app: Any, store: Any, config: dict[str, Any]) -> Any:
    app.add_middleware(IdempotencyMiddleware, store=store, tenant=tenant_of, **config)
    return app


@pytest.mark.parametrize("store_kind", ["memory", "redis"])
@pytest.mark.parametrize("case", SEQUENCES, ids=lambda c: c["comment"][:60])
async def test_http_server_sequences_starlette(
    case: dict[str, Any], store_kind: str, server: tuple[Server, Dispatch]
) -> None:
    srv, dispatch = server
    handler = Handler()
    dispatch.app = _middleware_app(starlette_app(handler), _store(store_kind), case["config"])
    await run_sequence(case, srv.url, handler)


@pytest.mark.parametrize("case", SEQUENCES, ids=lambda c: c["comment"][:60])
async def test_http_server_sequences_fastapi(
    case: dict[str, Any], server: tuple[Server, Dispatch]
) -> None:
    srv, dispatch = server
    handler = Handler()
    dispatch.app = _middleware_app(fastapi_app(handler), _store("memory"), case["config"])
    await run_sequence(case, srv.url, handler)


POST = {"idempotency-key": "order-0001", "content-type": "application/json"}


@pytest.mark.parametrize("framework", ["starlette", "fastapi"])
async def test_200_concurrent_requests_one_key(
    framework: str, server: tuple[Server, Dispatch]
) -> None:
    srv, dispatch = server
    handler = Handler()
    app = starlette_app(handler) if framework == "starlette" else fastapi_app(handler)
    dispatch.app = _middleware_app(app, oncely.IdempotencyStore(), {})
    limits = httpx.Limits(max_connections=300, max_keepalive_connections=300)
    respond = json.dumps({"delay_ms": 100})
    async with httpx.AsyncClient(base_url=srv.url, timeout=60, limits=limits) as client:
        resps = await asyncio.gather(
            *(
                client.post(
                    "/orders", headers={**POST, "x-respond": respond}, content=b'{"sku":"A1"}'
                )
                for _ in range(200)
            )
        )
    assert handler.calls == 1
    assert {(r.status_code, r.content, r.headers["etag"]) for r in resps} == {
        (201, b'{"call":1}', '"call-1"')
    }
    assert sum(r.headers.get("idempotent-replayed") == "true" for r in resps) == 199


async def test_a_body_over_one_mib_is_sent_not_stored(server: tuple[Server, Dispatch]) -> None:
    srv, dispatch = server
    handler = Handler()
    app = starlette_app(handler)
    counters = oncely.asgi.CounterSet()
    dispatch.app = _middleware_app(app, oncely.IdempotencyStore(), {"counters": counters})
    respond = json.dumps({"bytes": (1 << 20) + 1})
    async with httpx.AsyncClient(base_url=srv.url, timeout=30) as client:
        for n in (1, 2):
            r = await client.post("/orders", headers={**POST, "x-respond": respond}, content=b"{}")
            assert (r.status_code, len(r.content), r.headers["etag"]) == (
                201,
                (1 << 20) + 1,
                f'"call-{n}"',
            )
            assert "idempotent-replayed" not in r.headers
        exact = json.dumps({"bytes": 1 << 20})
        r = await client.post(
            "/orders",
            headers={**POST, "idempotency-key": "order-0002", "x-respond": exact},
            content=b"{}",
        )
        again = await client.post(
            "/orders",
            headers={**POST, "idempotency-key": "order-0002", "x-respond": exact},
            content=b"{}",
        )
    assert again.headers["idempotent-replayed"] == "true" and again.content == r.content
    assert handler.calls == 3
    # A streamed action ends just after its last byte is sent: wait (bounded) for it.
    for _ in range(4000):
        if counters.snapshot().not_stored >= 2:
            break
        await asyncio.sleep(0.005)
    snap = counters.snapshot()
    assert (snap.led, snap.stored, snap.not_stored, snap.replayed) == (3, 1, 2, 1)


async def test_a_request_body_over_the_request_cap_is_413(server: tuple[Server, Dispatch]) -> None:
    srv, dispatch = server
    handler = Handler()
    dispatch.app = _middleware_app(
        starlette_app(handler), oncely.IdempotencyStore(), {"request_cap": 10}
    )
    async with httpx.AsyncClient(base_url=srv.url, timeout=30) as client:
        r = await client.post("/orders", headers=POST, content=b"x" * 11)
    assert r.status_code == 413 and r.json()["type"] == "urn:oncely:problem:request-too-large"
    assert handler.calls == 0


async def test_an_app_that_raises_answers_waiters_500_and_releases_the_key(
    server: tuple[Server, Dispatch],
) -> None:
    srv, dispatch = server
    calls = 0

    async def boom(request: Request) -> Response:
        nonlocal calls
        calls += 1
        if calls == 1:
            await asyncio.sleep(1.0)  # the duplicates arrive meanwhile
            raise RuntimeError("the app failed")
        return Response(b"ok", status_code=201)

    app = Starlette(routes=[Route("/orders", boom, methods=["POST"])])
    dispatch.app = _middleware_app(app, oncely.IdempotencyStore(), {})
    async with httpx.AsyncClient(base_url=srv.url, timeout=30) as client:
        first = asyncio.ensure_future(client.post("/orders", headers=POST, content=b"{}"))
        while calls == 0:
            await asyncio.sleep(0.005)
        waiters = await asyncio.gather(
            *(client.post("/orders", headers=POST, content=b"{}") for _ in range(5))
        )
        leader = await first
        assert leader.status_code == 500
        for w in waiters:
            assert w.status_code == 500 and w.json()["type"] == "urn:oncely:problem:internal"
        assert calls == 1  # the waiters did not run it again
    # A connection of its own: the server may close the pooled ones after the app raised,
    # and a request sent on one it is closing fails with ReadError (seen once in CI).
    async with httpx.AsyncClient(base_url=srv.url, timeout=30) as client:
        retry = await client.post("/orders", headers=POST, content=b"{}")
    assert (retry.status_code, retry.content, calls) == (201, b"ok", 2)


async def test_a_streaming_response_passes_through_and_is_not_stored(
    server: tuple[Server, Dispatch],
) -> None:
    srv, dispatch = server
    calls = 0
    go_on = asyncio.Event()
    loop_of_server: list[asyncio.AbstractEventLoop] = []

    async def stream(request: Request) -> StreamingResponse:
        nonlocal calls
        calls += 1
        loop_of_server.append(asyncio.get_running_loop())

        async def events() -> Any:
            yield b"data: first\n\n"
            await asyncio.wait_for(go_on.wait(), 20)
            yield b"data: second\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    app = Starlette(routes=[Route("/orders", stream, methods=["POST"])])
    dispatch.app = _middleware_app(app, oncely.IdempotencyStore(), {"body_cap": 4})
    async with httpx.AsyncClient(base_url=srv.url, timeout=30) as client:
        async with client.stream("POST", "/orders", headers=POST, content=b"{}") as r:
            chunks = r.aiter_raw()
            first = await asyncio.wait_for(chunks.__anext__(), 20)  # arrives before the app ends
            assert first.startswith(b"data: first")
            loop_of_server[0].call_soon_threadsafe(go_on.set)
            rest = b"".join([c async for c in chunks])
        assert (first + rest) == b"data: first\n\ndata: second\n\n"
        again = await client.post("/orders", headers=POST, content=b"{}")
    assert again.headers.get("idempotent-replayed") is None and calls == 2


async def test_a_client_that_goes_away_does_not_stop_the_app(
    server: tuple[Server, Dispatch],
) -> None:
    srv, dispatch = server
    handler = Handler()
    dispatch.app = _middleware_app(starlette_app(handler), oncely.IdempotencyStore(), {})
    body = b'{"sku":"A1"}'
    raw = (
        b"POST /orders HTTP/1.1\r\nhost: x\r\nidempotency-key: order-0001\r\n"
        b'content-type: application/json\r\nx-respond: {"delay_ms": 300}\r\n'
        b"content-length: " + str(len(body)).encode() + b"\r\n\r\n" + body
    )
    with socket.create_connection(("127.0.0.1", srv.port)) as s:
        s.sendall(raw)
        for _ in range(4000):
            if handler.calls:
                break
            await asyncio.sleep(0.005)
    # The connection is closed while the handler runs; the retry gets its response.
    async with httpx.AsyncClient(base_url=srv.url, timeout=30) as client:
        retry = await client.post("/orders", headers=POST, content=body)
    assert (retry.status_code, retry.json(), handler.calls) == (201, {"call": 1}, 1)
    assert retry.headers["idempotent-replayed"] == "true"


async def test_on_replay_and_counters(server: tuple[Server, Dispatch]) -> None:
    srv, dispatch = server
    handler = Handler()
    seen: list[str] = []
    counters = oncely.asgi.CounterSet()
    config = {"on_replay": lambda scope, key: seen.append(key.value), "counters": counters}
    dispatch.app = _middleware_app(starlette_app(handler), oncely.IdempotencyStore(), config)
    async with httpx.AsyncClient(base_url=srv.url, timeout=30) as client:
        await client.post("/orders", headers=POST, content=b"{}")
        await client.post("/orders", headers=POST, content=b"{}")
        await client.get("/orders")
        await client.post("/orders", content=b"{}")
    assert seen == ["v1:default:POST%20/orders:order-0001"]
    assert counters.snapshot() == oncely.asgi.Counters(
        passed_through=1, refused=1, led=1, stored=1, not_stored=0, replayed=1
    )


def test_a_foreign_record_is_503_not_a_rerun() -> None:
    async def main() -> tuple[int, int]:
        calls = 0

        async def app(scope: Any, receive: Any, send: Any) -> None:
            nonlocal calls
            calls += 1

        class Store:
            async def execute(self, scoped: Any, fp: str, fn: Any, /, *, wait: bool = True) -> Any:
                class Done:
                    value = b"not a record"

                return Done()

        sent: list[Any] = []
        mw = IdempotencyMiddleware(app, store=Store())

        async def receive() -> Any:
            return {"type": "http.request", "body": b"", "more_body": False}

        async def send(message: Any) -> None:
            sent.append(message)

        scope = {
            "type": "http",
            "method": "POST",
            "path": "/x",
            "headers": [(b"idempotency-key", b"order-0001")],
        }
        await mw(scope, receive, send)
        return sent[0]["status"], calls

    assert asyncio.run(main()) == (503, 0)


@pytest.mark.skipif(not REDIS_URL, reason="needs ONCELY_REDIS_URL (scripts/with-redis)")
async def test_redis_store_across_two_server_processes(tmp_path: Any) -> None:
    import subprocess
    import sys

    effects = tmp_path / "effects"
    effects.write_text("")
    env = {**os.environ, "EFFECTS": str(effects), "PREFIX": f"asgi-procs-{uuid.uuid4().hex}"}
    script = os.path.join(os.path.dirname(__file__), "asgi_process_app.py")
    procs = [
        subprocess.Popen(
            [sys.executable, script], stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env
        )
        for _ in range(2)
    ]
    try:
        ports = []
        for p in procs:
            assert p.stdout is not None
            ports.append(int(p.stdout.readline()))
        limits = httpx.Limits(max_connections=100)
        async with httpx.AsyncClient(timeout=30, limits=limits) as client:
            resps = await asyncio.gather(
                *(
                    client.post(
                        f"http://127.0.0.1:{ports[i % 2]}/orders", headers=POST, content=b"{}"
                    )
                    for i in range(40)
                )
            )
    finally:
        for p in procs:
            assert p.stdin is not None
            p.stdin.close()
        for p in procs:
            p.wait(20)
    assert len(effects.read_text().splitlines()) == 1  # one effect across both processes
    assert len({(r.status_code, r.content) for r in resps}) == 1 and resps[0].status_code == 201
    assert sum(r.headers.get("idempotent-replayed") == "true" for r in resps) == 39


class HypercornServer:
    """A hypercorn server on 127.0.0.1 in a thread with its own event loop."""

    def __init__(self, app: Any) -> None:
        from hypercorn.config import Config

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.config = Config()
        self.config.bind = [f"127.0.0.1:{self.port}"]
        self.config.loglevel = "ERROR"
        self.config.accesslog = None
        self.app = app
        self.loop = asyncio.new_event_loop()
        self.stop: Optional[asyncio.Event] = None
        self.thread = threading.Thread(target=self._run)

    def _run(self) -> None:
        from hypercorn.asyncio import serve

        async def main() -> None:
            self.stop = asyncio.Event()
            await serve(self.app, self.config, shutdown_trigger=self.stop.wait)

        self.loop.run_until_complete(main())

    def __enter__(self) -> str:
        self.thread.start()
        for _ in range(2000):
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=1).close()
                break
            except OSError:
                threading.Event().wait(0.01)
        return f"http://127.0.0.1:{self.port}"

    def __exit__(self, *exc: object) -> None:
        assert self.stop is not None
        self.loop.call_soon_threadsafe(self.stop.set)
        self.thread.join(20)
        self.loop.close()


async def test_hypercorn_concurrent_duplicates_and_a_client_that_goes_away() -> None:
    pytest.importorskip("hypercorn")
    handler = Handler()
    app = _middleware_app(starlette_app(handler), oncely.IdempotencyStore(), {})
    with HypercornServer(app) as url:
        limits = httpx.Limits(max_connections=300, max_keepalive_connections=300)
        respond = json.dumps({"delay_ms": 100})
        async with httpx.AsyncClient(base_url=url, timeout=60, limits=limits) as client:
            resps = await asyncio.gather(
                *(
                    client.post("/orders", headers={**POST, "x-respond": respond}, content=b"{}")
                    for _ in range(100)
                )
            )
            assert handler.calls == 1
            assert {(r.status_code, r.content) for r in resps} == {(201, b'{"call":1}')}
            assert sum(r.headers.get("idempotent-replayed") == "true" for r in resps) == 99
        # Hypercorn cancels the request's task when its client goes away: the app runs
        # on in its own task, and the retry gets its answer.
        body = b"{}"
        raw = (
            b"POST /orders HTTP/1.1\r\nhost: x\r\nidempotency-key: order-0002\r\n"
            b'content-type: application/json\r\nx-respond: {"delay_ms": 300}\r\n'
            b"content-length: " + str(len(body)).encode() + b"\r\n\r\n" + body
        )
        with socket.create_connection(("127.0.0.1", int(url.rsplit(":", 1)[1]))) as s:
            s.sendall(raw)
            for _ in range(4000):
                if handler.calls == 2:
                    break
                await asyncio.sleep(0.005)
        async with httpx.AsyncClient(base_url=url, timeout=30) as client:
            retry = await client.post(
                "/orders", headers={**POST, "idempotency-key": "order-0002"}, content=body
            )
        assert (retry.status_code, retry.json(), handler.calls) == (201, {"call": 2}, 2)


class _CompleteFails:
    """A store that runs the action, then cannot keep its outcome (as a store that
    became unreachable, or whose lease was lost, while the app ran)."""

    async def execute(self, scoped: Any, fp: str, fn: Any, /, *, wait: bool = True) -> Any:
        await fn()
        raise oncely.StoreUnavailableError("unavailable: the store went away")


async def test_a_response_the_store_cannot_keep_is_still_the_answer(
    server: tuple[Server, Dispatch],
) -> None:
    srv, dispatch = server
    handler = Handler()
    dispatch.app = _middleware_app(starlette_app(handler), _CompleteFails(), {})
    async with httpx.AsyncClient(base_url=srv.url, timeout=30) as client:
        r = await client.post("/orders", headers=POST, content=b"{}")
    # Not a 503 inviting a retry that would run the app again.
    assert (r.status_code, r.json(), r.headers["etag"], handler.calls) == (
        201,
        {"call": 1},
        '"call-1"',
        1,
    )


async def test_an_app_that_raises_after_its_whole_response_is_answered_and_stored(
    server: tuple[Server, Dispatch],
) -> None:
    from starlette.background import BackgroundTask

    srv, dispatch = server
    calls = 0

    def after() -> None:
        raise RuntimeError("the background task failed")

    async def create(request: Request) -> Response:
        nonlocal calls
        calls += 1
        return Response(b'{"id":1}', status_code=201, background=BackgroundTask(after))

    app = Starlette(routes=[Route("/orders", create, methods=["POST"])])
    dispatch.app = _middleware_app(app, oncely.IdempotencyStore(), {})
    # The server closes a connection whose app raised: one client per request.
    async with httpx.AsyncClient(base_url=srv.url, timeout=30) as client:
        first = await client.post("/orders", headers=POST, content=b"{}")
    async with httpx.AsyncClient(base_url=srv.url, timeout=30) as client:
        retry = await client.post("/orders", headers=POST, content=b"{}")
    assert (first.status_code, first.content) == (201, b'{"id":1}')
    assert (retry.status_code, retry.content, retry.headers["idempotent-replayed"]) == (
        201,
        b'{"id":1}',
        "true",
    )
    assert calls == 1


async def test_messages_a_server_refuses_are_not_stored(server: tuple[Server, Dispatch]) -> None:
    srv, dispatch = server
    calls = 0

    async def app(scope: Any, receive: Any, send: Any) -> None:
        nonlocal calls
        calls += 1
        await receive()
        if scope["path"] == "/twice":
            # A second start: a server refuses it, so it must not replace the first.
            await send({"type": "http.response.start", "status": 201, "headers": []})
            await send({"type": "http.response.start", "status": 200, "headers": []})
            await send({"type": "http.response.body", "body": b"second"})
        else:
            # A body after the last one: the response is the first body alone.
            await send({"type": "http.response.start", "status": 201, "headers": []})
            await send({"type": "http.response.body", "body": b"whole"})
            await send({"type": "http.response.body", "body": b"-extra"})

    dispatch.app = IdempotencyMiddleware(app, store=oncely.IdempotencyStore())

    async def post(path: str) -> Any:
        # The server closes a connection whose app raised: one client per request.
        async with httpx.AsyncClient(base_url=srv.url, timeout=30) as client:
            return await client.post(path, headers=POST, content=b"{}")

    twice = await post("/twice")
    again = await post("/twice")
    assert twice.status_code == 500 and again.headers.get("idempotent-replayed") is None
    assert calls == 2
    extra = await post("/extra")
    replay = await post("/extra")
    assert (extra.status_code, extra.content) == (201, b"whole")
    assert (replay.content, replay.headers["idempotent-replayed"], calls) == (b"whole", "true", 3)


async def test_an_event_stream_reaches_its_client_as_it_is_produced(
    server: tuple[Server, Dispatch],
) -> None:
    srv, dispatch = server
    calls = 0
    go_on = asyncio.Event()
    loop_of_server: list[asyncio.AbstractEventLoop] = []

    async def stream(request: Request) -> StreamingResponse:
        nonlocal calls
        calls += 1
        loop_of_server.append(asyncio.get_running_loop())

        async def events() -> Any:
            yield b"data: first\n\n"  # far below the cap: never read ahead to it
            await asyncio.wait_for(go_on.wait(), 20)
            yield b"data: second\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    app = Starlette(routes=[Route("/orders", stream, methods=["POST"])])
    dispatch.app = _middleware_app(app, oncely.IdempotencyStore(), {})
    async with httpx.AsyncClient(base_url=srv.url, timeout=30) as client:
        async with client.stream("POST", "/orders", headers=POST, content=b"{}") as r:
            chunks = r.aiter_raw()
            first = await asyncio.wait_for(chunks.__anext__(), 10)  # before the stream ends
            assert first.startswith(b"data: first")
            loop_of_server[0].call_soon_threadsafe(go_on.set)
            rest = b"".join([c async for c in chunks])
        assert (first + rest) == b"data: first\n\ndata: second\n\n"
        again = await client.post("/orders", headers=POST, content=b"{}")
    assert again.headers.get("idempotent-replayed") is None and calls == 2


async def test_waiters_of_a_response_not_stored_get_all_its_shared_headers(
    server: tuple[Server, Dispatch],
) -> None:
    srv, dispatch = server
    handler = Handler()
    dispatch.app = _middleware_app(starlette_app(handler), oncely.IdempotencyStore(), {})
    respond = json.dumps({"status": 503, "delay_ms": 300})
    headers = {**POST, "x-respond": respond}
    async with httpx.AsyncClient(base_url=srv.url, timeout=30) as client:
        first = asyncio.ensure_future(client.post("/orders", headers=headers, content=b"{}"))
        while handler.calls == 0:
            await asyncio.sleep(0.005)
        waiters = await asyncio.gather(
            *(client.post("/orders", headers=POST, content=b"{}") for _ in range(5))
        )
        await first
    assert handler.calls == 1
    for w in waiters:
        assert (w.status_code, w.headers["idempotent-replayed"]) == (503, "true")
        # The whole answer but the never-stored headers (set-cookie is not listed).
        assert (w.headers.get("x-call"), w.headers.get("set-cookie")) == ("1", None)
