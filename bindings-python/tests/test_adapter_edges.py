"""Edges of oncely.asgi and oncely.wsgi on real servers where the server matters: the
answer is not held back by work the app does after it (a background task, close()),
an Early Hint is not the response, headers given as an iterator, a short read of the
request body, a Content-Length over the cap, a tenant that is not Unicode, a replayed
204."""

from __future__ import annotations

import asyncio
import io
import os
import socket
import threading
import time
import urllib.request
from typing import Any, Iterator

import oncely
import pytest
from oncely.asgi import IdempotencyMiddleware as AsgiMiddleware
from oncely.wsgi import IdempotencyMiddleware as WsgiMiddleware

httpx = pytest.importorskip("httpx")
pytest.importorskip("uvicorn")
pytest.importorskip("starlette")

from wsgiref.simple_server import WSGIRequestHandler, make_server  # noqa: E402

from asgi_server import Dispatch, Server  # noqa: E402
from starlette.applications import Starlette  # noqa: E402
from starlette.requests import Request  # noqa: E402
from starlette.responses import Response  # noqa: E402
from starlette.routing import Route  # noqa: E402

POST = {"idempotency-key": "order-0001", "content-type": "application/json"}


@pytest.fixture(scope="module")
def server() -> Iterator[tuple[Server, Dispatch]]:
    dispatch = Dispatch()
    with Server(dispatch) as srv:
        yield srv, dispatch


async def call_asgi(
    mw: Any, headers: list[tuple[bytes, bytes]], body: bytes = b"{}", **scope: Any
) -> list[dict[str, Any]]:
    """One POST /orders through `mw`, called directly: the messages it sent (headers as
    a list)."""
    sent: list[dict[str, Any]] = []
    msgs = [{"type": "http.request", "body": body, "more_body": False}]

    async def receive() -> dict[str, Any]:
        return msgs.pop(0) if msgs else {"type": "http.disconnect"}

    async def send(m: dict[str, Any]) -> None:
        if m["type"] == "http.response.start":
            m = {**m, "headers": list(m.get("headers") or ())}
        sent.append(m)

    base = {"type": "http", "method": "POST", "path": "/orders", "raw_path": b"/orders"}
    await mw({**base, "query_string": b"", "headers": headers, **scope}, receive, send)
    return sent


KEYED = [(b"idempotency-key", b"order-0001"), (b"content-type", b"application/json")]


def _wsgi_post(key: str) -> dict[str, Any]:
    """The environ of a keyed POST /orders with the body ``{}``."""
    return {
        "REQUEST_METHOD": "POST",
        "PATH_INFO": "/orders",
        "SCRIPT_NAME": "",
        "QUERY_STRING": "",
        "CONTENT_TYPE": "application/json",
        "CONTENT_LENGTH": "2",
        "HTTP_IDEMPOTENCY_KEY": key,
        "wsgi.input": io.BytesIO(b"{}"),
    }


def test_wsgi_leader_gets_its_response_before_close_ends() -> None:
    """A WSGI server sends the body, then calls close() (werkzeug's
    ``response.call_on_close``: after-response work): under the middleware too, the
    answer is started before close() has run."""
    release = threading.Event()

    class Body:
        def __iter__(self) -> Iterator[bytes]:
            return iter([b'{"id":1}'])

        def close(self) -> None:
            release.wait(20)

    def app(environ: Any, start_response: Any) -> Any:
        environ["wsgi.input"].read()
        start_response("201 Created", [("Content-Type", "application/json")])
        return Body()

    mw = WsgiMiddleware(app, store=oncely.IdempotencyStore())
    started = threading.Event()

    def start_response(status: str, headers: Any, exc_info: Any = None) -> Any:
        started.set()
        return lambda b: None

    environ = {
        "REQUEST_METHOD": "POST",
        "PATH_INFO": "/orders",
        "HTTP_IDEMPOTENCY_KEY": "order-0001",
        "CONTENT_TYPE": "application/json",
        "CONTENT_LENGTH": "2",
        "wsgi.input": io.BytesIO(b"{}"),
    }
    out: list[Any] = []
    t = threading.Thread(target=lambda: out.append(mw(environ, start_response)))
    t.start()
    try:
        assert started.wait(3), "no response before close() returned"
    finally:
        release.set()
        t.join(20)
    body = out[0]
    assert b"".join(body) == b'{"id":1}'
    getattr(body, "close", lambda: None)()


async def test_asgi_headers_given_as_an_iterator_are_sent_and_stored_whole() -> None:
    """ASGI's ``headers`` is an Iterable, which may be read only once: the client and the
    record both get every header."""

    async def app(scope: Any, receive: Any, send: Any) -> None:
        await receive()
        headers = iter([(b"x-a", b"1"), (b"content-type", b"application/json"), (b"etag", b'"v1"')])
        await send({"type": "http.response.start", "status": 201, "headers": headers})
        await send({"type": "http.response.body", "body": b"{}"})

    mw = AsgiMiddleware(app, store=oncely.IdempotencyStore())
    for answer in (await call_asgi(mw, KEYED), await call_asgi(mw, KEYED)):
        h = dict(answer[0]["headers"])
        assert h.get(b"content-type") == b"application/json" and h.get(b"etag") == b'"v1"', h


async def test_asgi_content_length_over_the_cap_is_413_before_the_body_is_read() -> None:
    """SPEC §8: a request "whose Content-Length already says so is refused before its
    body is read" (no 100 Continue, no upload of megabytes to be thrown away)."""
    calls = 0

    async def app(scope: Any, receive: Any, send: Any) -> None:
        raise AssertionError("the app must not run")

    mw = AsgiMiddleware(app, store=oncely.IdempotencyStore(), request_cap=10)
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        nonlocal calls
        calls += 1  # uvicorn sends "100 Continue" on the first receive()
        return {"type": "http.request", "body": b"x" * 11, "more_body": False}

    async def send(m: dict[str, Any]) -> None:
        sent.append(m)

    scope = {
        "type": "http",
        "method": "POST",
        "path": "/upload",
        "raw_path": b"/upload",
        "query_string": b"",
        "headers": [
            (b"idempotency-key", b"order-0001"),
            (b"content-length", b"11"),
            (b"expect", b"100-continue"),
        ],
    }
    await mw(scope, receive, send)
    assert sent[0]["status"] == 413
    assert calls == 0, "the body was read before the 413"


def test_wsgi_a_short_read_does_not_truncate_the_body() -> None:
    """With ``wsgi.input_terminated`` (a chunked request) and no Content-Length, a
    stream whose read(n) may return fewer than n bytes before its end (a raw stream)
    is read to its end: the app gets the whole body."""

    class RawChunks(io.RawIOBase):
        def __init__(self, data: bytes) -> None:
            self.data = data

        def readable(self) -> bool:
            return True

        def readinto(self, buf: Any) -> int:  # one 4-byte chunk per call
            n = min(4, len(buf), len(self.data))
            buf[:n] = self.data[:n]
            self.data = self.data[n:]
            return n

    seen: list[bytes] = []

    def app(environ: Any, start_response: Any) -> Any:
        seen.append(environ["wsgi.input"].read())
        start_response("201 Created", [("Content-Type", "application/json")])
        return [b"{}"]

    mw = WsgiMiddleware(app, store=oncely.IdempotencyStore())
    body = b'{"sku":"A1","qty":3}'
    environ = {
        "REQUEST_METHOD": "POST",
        "PATH_INFO": "/orders",
        "HTTP_IDEMPOTENCY_KEY": "order-0001",
        "CONTENT_TYPE": "application/json",
        "wsgi.input": RawChunks(body),
        "wsgi.input_terminated": True,
    }
    b"".join(mw(environ, lambda s, h, e=None: lambda b: None))
    assert seen == [body]


async def test_asgi_a_replayed_204_has_no_content_length() -> None:
    """RFC 9110 §8.6: a 204 never has a Content-Length, replayed or not."""

    async def app(scope: Any, receive: Any, send: Any) -> None:
        await receive()
        await send({"type": "http.response.start", "status": 204, "headers": []})
        await send({"type": "http.response.body", "body": b""})

    mw = AsgiMiddleware(app, store=oncely.IdempotencyStore())
    await call_asgi(mw, KEYED, b"")
    replay = dict((await call_asgi(mw, KEYED, b""))[0]["headers"])
    assert replay.get(b"idempotent-replayed") == b"true"
    assert b"content-length" not in replay, replay


async def test_asgi_a_tenant_with_a_lone_surrogate_is_500_tenant_unusable() -> None:
    """SPEC §5 and §8: a tenant no key can be scoped by (here a lone surrogate, as from
    a principal decoded with surrogateescape) is 500 ``tenant-unusable``, and the app
    does not run."""

    async def app(scope: Any, receive: Any, send: Any) -> None:
        raise AssertionError("the app must not run")

    def tenant(scope: Any) -> str:
        return b"alice\xff".decode("utf-8", "surrogateescape")

    mw = AsgiMiddleware(app, store=oncely.IdempotencyStore(), tenant=tenant)
    sent = await call_asgi(mw, KEYED)
    assert sent[0]["status"] == 500
    assert b"tenant-unusable" in sent[1]["body"]


async def test_asgi_an_early_hint_does_not_keep_the_response_from_being_stored() -> None:
    """An ``http.response.early_hint`` (an ASGI extension, e.g. Hypercorn's) before the
    response goes to the client and is not the response: the response is stored and a
    retry is its replay (the app runs once)."""
    calls = 0

    async def app(scope: Any, receive: Any, send: Any) -> None:
        nonlocal calls
        calls += 1
        await receive()
        await send({"type": "http.response.early_hint", "links": [b"</app.css>; rel=preload"]})
        await send({"type": "http.response.start", "status": 201, "headers": []})
        await send({"type": "http.response.body", "body": b'{"id":1}'})

    mw = AsgiMiddleware(app, store=oncely.IdempotencyStore())
    hints = {"extensions": {"http.response.early_hint": {}}}
    first = await call_asgi(mw, KEYED, **hints)
    retry = await call_asgi(mw, KEYED, **hints)
    assert [m["type"] for m in first[:2]] == ["http.response.early_hint", "http.response.start"]
    assert first[1]["status"] == 201
    assert calls == 1, "the app ran twice for one key"
    assert dict(retry[0]["headers"]).get(b"idempotent-replayed") == b"true"


async def test_hypercorn_h2_starlette_send_early_hints_runs_the_app_once_per_key() -> None:
    """The same under a real server: Starlette's ``request.send_early_hints`` under
    Hypercorn over HTTP/2 (h2c, prior knowledge). A retry with the same key must be a
    replay, not a second order."""
    pytest.importorskip("hypercorn")
    pytest.importorskip("h2")
    from test_asgi import HypercornServer

    calls = 0

    async def create(request: Request) -> Response:
        nonlocal calls
        calls += 1
        await request.body()
        await request.send_early_hints("</app.css>; rel=preload")
        return Response(b'{"id":%d}' % calls, status_code=201, media_type="application/json")

    app = Starlette(routes=[Route("/orders", create, methods=["POST"])])
    app.add_middleware(AsgiMiddleware, store=oncely.IdempotencyStore())
    with HypercornServer(app) as url:
        async with httpx.AsyncClient(base_url=url, timeout=30, http1=False, http2=True) as c:
            first = await c.post("/orders", headers=POST, content=b"{}")
            retry = await c.post("/orders", headers=POST, content=b"{}")
    assert first.http_version == "HTTP/2"
    assert (first.status_code, first.content) == (201, b'{"id":1}')
    assert (retry.content, retry.headers.get("idempotent-replayed"), calls) == (
        b'{"id":1}',
        "true",
        1,
    )


BIG = 16 * 1024 * 1024


def _stalled_leader(port: int) -> socket.socket:
    """A client that sends its POST and then never reads (a half-open connection, a
    stalled reader): the server's writes back up."""
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    s.connect(("127.0.0.1", port))
    s.sendall(
        b"POST /orders HTTP/1.1\r\nhost: x\r\nidempotency-key: order-0001\r\n"
        b"content-type: application/json\r\ncontent-length: 2\r\n\r\n{}"
    )
    return s


@pytest.mark.parametrize("wait", [True, False])
async def test_hypercorn_a_stalled_leader_client_does_not_hold_the_key(wait: bool) -> None:
    """The app has answered and returned; its client is not reading (the server's
    writes back up). The key is settled before the answer is sent, so a retry on
    another connection is replayed at once, whether it would wait or not."""
    pytest.importorskip("hypercorn")
    from test_asgi import HypercornServer

    calls = 0

    async def app(scope: Any, receive: Any, send: Any) -> None:
        nonlocal calls
        if scope["type"] != "http":
            return
        calls += 1
        while (await receive()).get("more_body"):
            pass
        await send(
            {
                "type": "http.response.start",
                "status": 201,
                "headers": [(b"content-type", b"text/plain")],
            }
        )
        await send({"type": "http.response.body", "body": b"x" * BIG})

    mw = AsgiMiddleware(app, store=oncely.IdempotencyStore(), body_cap=2 * BIG, wait=wait)
    with HypercornServer(mw) as url:
        port = int(url.rsplit(":", 1)[1])
        leader = _stalled_leader(port)
        try:
            await asyncio.sleep(1.0)  # the app has run and sent all it had to send
            assert calls == 1
            async with httpx.AsyncClient(base_url=url, timeout=30) as c:
                try:
                    retry = await asyncio.wait_for(
                        c.post(
                            "/orders",
                            content=b"{}",
                            headers={
                                "idempotency-key": "order-0001",
                                "content-type": "application/json",
                            },
                        ),
                        5,
                    )
                except asyncio.TimeoutError:
                    pytest.fail("the retry waited > 5 s on a key whose app had answered")
            assert retry.status_code == 201, (retry.status_code, retry.content[:200])
            assert retry.headers.get("idempotent-replayed") == "true"
            assert len(retry.content) == BIG and calls == 1
        finally:
            leader.close()


REDIS = os.environ.get("ONCELY_REDIS_URL")


def _store(kind: str) -> Any:
    if kind == "memory":
        return oncely.IdempotencyStore()
    if not REDIS:
        pytest.skip("ONCELY_REDIS_URL not set")
    return oncely.RedisStore(REDIS, prefix=f"edges-{os.getpid()}-{time.monotonic_ns()}")


@pytest.mark.parametrize("kind", ["memory", "redis"])
def test_a_shutdown_after_the_answer_does_not_free_the_key(kind: str) -> None:
    """The app's response is whole while its background task still runs; the server
    stops and its loop cancels what is left (asyncio.run, uvicorn past
    timeout_graceful_shutdown). The app has done its work: its response is stored and
    a retry (the next loop; with Redis, any process) replays it, without running the
    app again."""
    store = _store(kind)
    calls = 0
    answered = threading.Event()

    async def app(scope: Any, receive: Any, send: Any) -> None:
        nonlocal calls
        calls += 1
        await receive()
        await send({"type": "http.response.start", "status": 201, "headers": []})
        await send({"type": "http.response.body", "body": b'{"id":%d}' % calls})
        answered.set()
        await asyncio.sleep(30)  # a background task: an e-mail, a webhook

    mw = AsgiMiddleware(app, store=store)
    scope = {
        "type": "http",
        "method": "POST",
        "path": "/orders",
        "raw_path": b"/orders",
        "query_string": b"",
        "headers": [(b"idempotency-key", b"order-0001")],
    }

    def call(got: list[Any]) -> Any:
        async def receive() -> dict[str, Any]:
            return {"type": "http.request", "body": b"{}", "more_body": False}

        async def send(m: dict[str, Any]) -> None:
            got.append(m)

        return mw(scope, receive, send)

    first: list[Any] = []

    async def server_one() -> None:
        task = asyncio.ensure_future(call(first))
        while not answered.is_set():
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.1)
        assert not task.done()  # the background task still runs
        # the server stops here: asyncio.run cancels task and the app's own task

    asyncio.run(server_one())
    retry: list[Any] = []

    async def server_two() -> None:
        await asyncio.wait_for(call(retry), 5)

    answered.clear()
    try:
        asyncio.run(server_two())
    except asyncio.TimeoutError:
        pass
    assert calls == 1, "the app ran twice for one key whose response was whole"
    assert (
        retry[-1]["body"] == b'{"id":1}'
        and dict(retry[0]["headers"])[b"idempotent-replayed"] == b"true"
    )


class Quiet(WSGIRequestHandler):
    def log_message(self, *a: Any) -> None:
        pass


def test_wsgiref_refusing_the_headers_still_closes_the_app_body() -> None:
    closed = threading.Event()

    class Body:  # e.g. a file, a DB cursor, a lock released in close()
        def __iter__(self) -> Iterator[bytes]:
            return iter([b'{"id":1}'])

        def close(self) -> None:
            closed.set()

    def app(environ: Any, start_response: Any) -> Any:
        environ["wsgi.input"].read()
        # wsgiref refuses a hop-by-hop header (AssertionError in start_response)
        start_response(
            "201 Created", [("Content-Type", "application/json"), ("Connection", "close")]
        )
        return Body()

    mw = WsgiMiddleware(app, store=oncely.IdempotencyStore())
    srv = make_server("127.0.0.1", 0, mw, handler_class=Quiet)
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    try:
        req = urllib.request.Request(
            f"http://127.0.0.1:{srv.server_port}/orders",
            data=b"{}",
            method="POST",
            headers={"Idempotency-Key": "order-0001", "Content-Type": "application/json"},
        )
        try:
            urllib.request.urlopen(req, timeout=5).read()
        except Exception:
            pass  # wsgiref answers 500
        assert closed.wait(2), "the app body's close() was never called"
    finally:
        srv.shutdown()
        srv.server_close()


async def test_uvicorn_one_store_mounted_twice_is_led_by_the_outer_middleware(
    server: tuple[Server, Dispatch],
) -> None:
    """The middleware wrapped around an app that already has it, with one store (on the
    app and on a mounted sub-app): the outer one leads, the inner one passes the request
    on. Before, the inner asked the store again from inside the lead and every keyed
    request was refused 500 (re-entrant)."""
    srv, dispatch = server
    calls = 0

    async def orders(request: Request) -> Response:
        nonlocal calls
        calls += 1
        await request.body()
        return Response(f'{{"n":{calls}}}', status_code=201, media_type="application/json")

    store = oncely.IdempotencyStore()
    inner = AsgiMiddleware(
        Starlette(routes=[Route("/orders", orders, methods=["POST"])]), store=store
    )
    dispatch.app = AsgiMiddleware(inner, store=store)
    headers = {**POST, "idempotency-key": "order-twice-0001"}
    async with httpx.AsyncClient(base_url=srv.url) as client:
        first = await client.post("/orders", content=b"{}", headers=headers)
        again = await client.post("/orders", content=b"{}", headers=headers)
    assert (first.status_code, first.text) == (201, '{"n":1}')
    assert (again.status_code, again.text) == (201, '{"n":1}')
    assert again.headers.get("idempotent-replayed") == "true"
    assert calls == 1


def test_wsgiref_one_store_mounted_twice_is_led_by_the_outer_middleware() -> None:
    """As above, with WSGI."""
    calls = 0

    def app(environ: Any, start_response: Any) -> Any:
        nonlocal calls
        calls += 1
        environ["wsgi.input"].read()
        start_response("201 Created", [("Content-Type", "application/json")])
        return [f'{{"n":{calls}}}'.encode()]

    store = oncely.IdempotencyStore()
    mw = WsgiMiddleware(WsgiMiddleware(app, store=store), store=store)
    srv = make_server("127.0.0.1", 0, mw, handler_class=Quiet)
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    try:
        answers = []
        for _ in range(2):
            req = urllib.request.Request(
                f"http://127.0.0.1:{srv.server_port}/orders",
                data=b"{}",
                method="POST",
                headers={"Idempotency-Key": "order-twice-0002", "Content-Type": "application/json"},
            )
            with urllib.request.urlopen(req, timeout=5) as r:
                answers.append((r.status, r.read(), r.headers.get("idempotent-replayed")))
        assert answers == [(201, b'{"n":1}', None), (201, b'{"n":1}', "true")]
        assert calls == 1
    finally:
        srv.shutdown()
        srv.server_close()


async def test_asgi_a_request_made_by_a_task_of_the_lead_goes_through_the_store() -> None:
    """A task started by the handler inherits its context; a request that task makes
    later with the same key is another request: it is replayed, not passed on to the
    app as if it were the request being led (which ran the handler twice)."""
    calls = 0
    later: list[asyncio.Task[Any]] = []
    mw: Any = None

    async def again() -> httpx.Response:
        await asyncio.sleep(0.05)  # the lead has answered by then
        transport = httpx.ASGITransport(app=mw)
        async with httpx.AsyncClient(transport=transport, base_url="http://app") as c:
            return await c.post("/orders", content=b"{}", headers=POST)

    async def orders(request: Request) -> Response:
        nonlocal calls
        calls += 1
        await request.body()
        if calls == 1:
            later.append(asyncio.create_task(again()))
        return Response(f'{{"n":{calls}}}', status_code=201, media_type="application/json")

    store = oncely.IdempotencyStore()
    inner = AsgiMiddleware(
        Starlette(routes=[Route("/orders", orders, methods=["POST"])]), store=store
    )
    mw = AsgiMiddleware(inner, store=store)  # one store twice: the outer leads
    transport = httpx.ASGITransport(app=mw)
    async with httpx.AsyncClient(transport=transport, base_url="http://app") as client:
        first = await client.post("/orders", content=b"{}", headers=POST)
    second = await later[0]
    assert (first.status_code, first.text) == (201, '{"n":1}')
    assert (second.status_code, second.text) == (201, '{"n":1}')
    assert second.headers.get("idempotent-replayed") == "true"
    assert calls == 1


def test_wsgi_a_nested_call_with_the_key_being_led_is_refused_not_run_again() -> None:
    """The app calling the middleware again in-process with a new request and the key
    it is leading: that request would wait for itself; it is refused (500, INTERNAL),
    and the handler has run once. Before, it was passed on as the request being led."""
    calls = 0
    nested: list[str] = []
    mw: Any = None

    def app(environ: Any, start_response: Any) -> Any:
        nonlocal calls
        calls += 1
        environ["wsgi.input"].read()
        if calls == 1:
            inner_env = _wsgi_post("order-nested-0001")
            b"".join(mw(inner_env, lambda status, headers, exc=None: nested.append(status)))
        start_response("201 Created", [("Content-Type", "application/json")])
        return [f'{{"n":{calls}}}'.encode()]

    store = oncely.IdempotencyStore()
    mw = WsgiMiddleware(WsgiMiddleware(app, store=store), store=store)
    statuses: list[str] = []
    env = _wsgi_post("order-nested-0001")
    body = b"".join(mw(env, lambda status, headers, exc=None: statuses.append(status)))
    assert (statuses, body) == (["201 Created"], b'{"n":1}')
    assert nested and nested[0].startswith("500")
    assert calls == 1


def _bare_scope(key: bytes) -> dict[str, Any]:
    return {
        "type": "http",
        "method": "POST",
        "path": "/orders",
        "raw_path": b"/orders",
        "query_string": b"",
        "root_path": "",
        "headers": [(b"idempotency-key", key), (b"content-type", b"application/json")],
    }


async def _asgi_request(app: Any, scope: dict[str, Any]) -> tuple[int, bytes]:
    sent: list[dict[str, Any]] = []
    msgs = [{"type": "http.request", "body": b"{}", "more_body": False}]

    async def receive() -> dict[str, Any]:
        if msgs:
            return msgs.pop()
        await asyncio.Event().wait()
        return {}

    async def send(m: dict[str, Any]) -> None:
        sent.append(m)

    await app(scope, receive, send)
    status = next(m["status"] for m in sent if m["type"] == "http.response.start")
    return status, b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")


async def test_asgi_mounted_twice_a_lead_whose_caller_timed_out_still_passes_the_inner() -> None:
    """The caller of the outer middleware stops waiting (a timeout further out); the
    action runs on and reaches the inner middleware of the same store: it is still the
    request being led (the mark lasts as long as the app's run, not the caller's wait),
    so the handler runs and a duplicate waiting gets its answer. Before, the mark went
    with the caller and the inner refused it 500 re-entrant, which the duplicate got."""
    runs = 0

    async def handler(scope: Any, receive: Any, send: Any) -> None:
        nonlocal runs
        runs += 1
        await receive()
        headers = [(b"content-type", b"application/json")]
        await send({"type": "http.response.start", "status": 201, "headers": headers})
        await send({"type": "http.response.body", "body": b'{"order":1}'})

    store = oncely.IdempotencyStore()
    inner = AsgiMiddleware(handler, store=store)

    async def slow_gate(scope: Any, receive: Any, send: Any) -> None:
        await asyncio.sleep(0.3)  # e.g. an authentication doing I/O before the sub-app
        await inner(scope, receive, send)

    outer = AsgiMiddleware(slow_gate, store=store)

    async def timeout(scope: Any, receive: Any, send: Any) -> None:
        try:
            await asyncio.wait_for(outer(scope, receive, send), 0.1)
        except asyncio.TimeoutError:
            await send({"type": "http.response.start", "status": 504, "headers": []})
            await send({"type": "http.response.body", "body": b"timeout"})

    key = b"order-cancelled-0001"
    assert await _asgi_request(timeout, _bare_scope(key)) == (504, b"timeout")
    assert await _asgi_request(outer, _bare_scope(key)) == (201, b'{"order":1}')
    assert runs == 1


async def test_asgi_a_task_request_with_a_copy_of_the_scope_is_not_taken_for_the_lead() -> None:
    """A task started by the handler sends a request with the key being led, built from
    a copy of the request's scope (which shares its mark), while the lead still runs: it
    reaches the middleware leading the key, so it is another request and goes through
    the store (refused re-entrant), not passed on to run the handler a second time."""
    runs = 0
    got: list[tuple[int, bytes]] = []
    mw: Any = None

    async def handler(scope: Any, receive: Any, send: Any) -> None:
        nonlocal runs
        runs += 1
        await receive()
        if runs == 1:
            task = asyncio.create_task(_asgi_request(mw, {**scope}))
            task.add_done_callback(lambda t: got.append(t.result()))
            await asyncio.sleep(0.05)  # the lead is still on
        await send({"type": "http.response.start", "status": 201, "headers": []})
        await send({"type": "http.response.body", "body": f'{{"n":{runs}}}'.encode()})

    mw = AsgiMiddleware(handler, store=oncely.IdempotencyStore())
    assert await _asgi_request(mw, _bare_scope(b"order-task-0002")) == (201, b'{"n":1}')
    await asyncio.sleep(0.1)
    assert runs == 1
    assert got and got[0][0] == 500


async def test_asgi_mounted_twice_a_copy_of_the_scope_sent_to_the_sub_app_is_refused() -> None:
    """Mounted on the app and on a sub-app with one store, the handler sends a request
    built from a copy of its scope to the sub-app it holds (the inner middleware, which
    has passed the request on already): another request, refused, not run again."""
    runs = 0
    got: list[tuple[int, bytes]] = []
    inner: Any = None

    async def handler(scope: Any, receive: Any, send: Any) -> None:
        nonlocal runs
        runs += 1
        await receive()
        if runs == 1:
            got.append(await _asgi_request(inner, {**scope}))
        await send({"type": "http.response.start", "status": 201, "headers": []})
        await send({"type": "http.response.body", "body": f'{{"n":{runs}}}'.encode()})

    store = oncely.IdempotencyStore()
    inner = AsgiMiddleware(handler, store=store)
    outer = AsgiMiddleware(inner, store=store)
    assert await _asgi_request(outer, _bare_scope(b"order-copy-0003")) == (201, b'{"n":1}')
    assert runs == 1
    assert got and got[0][0] == 500


@pytest.mark.parametrize("mounts", ["once", "twice-to-outer", "twice-to-inner"])
def test_wsgi_a_nested_call_with_a_copy_of_the_environ_is_refused_not_run_again(
    mounts: str,
) -> None:
    """As the nested call above, with the nested request built from a copy of the
    environ (``dict(environ, ...)``, as webob's ``Request.copy()``): the copy shares the
    mark, but it reaches the middleware that leads the key, or the inner one that has
    passed the request on already, so it is another request."""
    calls = 0
    nested: list[str] = []
    target: Any = None

    def app(environ: Any, start_response: Any) -> Any:
        nonlocal calls
        calls += 1
        environ["wsgi.input"].read()
        if calls == 1:
            copy = dict(environ, **{"wsgi.input": io.BytesIO(b"{}")})
            b"".join(target(copy, lambda status, headers, exc=None: nested.append(status)))
        start_response("201 Created", [("Content-Type", "application/json")])
        return [f'{{"n":{calls}}}'.encode()]

    store = oncely.IdempotencyStore()
    inner = WsgiMiddleware(app, store=store)
    mw = inner if mounts == "once" else WsgiMiddleware(inner, store=store)
    target = inner if mounts == "twice-to-inner" else mw
    env = _wsgi_post("order-nested-0002")
    statuses: list[str] = []
    body = b"".join(mw(env, lambda status, headers, exc=None: statuses.append(status)))
    assert (statuses, body) == (["201 Created"], b'{"n":1}')
    assert nested and nested[0].startswith("500")
    assert calls == 1


class _Transient(Exception):
    pass


async def test_asgi_mounted_twice_a_retrying_middleware_between_passes_the_request_on_again() -> (
    None
):
    """outer -> a middleware that retries a transient failure -> inner -> handler, one
    store: the inner middleware is reached twice by the request being led, one pass after
    the other, and passes it on both times (as mounted once: the retry runs inside the
    one lead). Only a pass while its own is still running is another request."""
    runs = 0

    async def handler(scope: Any, receive: Any, send: Any) -> None:
        nonlocal runs
        runs += 1
        await receive()
        if runs == 1:
            raise _Transient("deadlock, rolled back")
        await send({"type": "http.response.start", "status": 201, "headers": []})
        await send({"type": "http.response.body", "body": b'{"ok":%d}' % runs})

    def retrying(app: Any) -> Any:
        async def mw(scope: Any, receive: Any, send: Any) -> None:
            first = await receive()
            for attempt in range(2):
                given = [first]

                async def again() -> dict[str, Any]:
                    if given:
                        return given.pop()
                    await asyncio.Event().wait()
                    return {}

                try:
                    await app(scope, again, send)
                    return
                except _Transient:
                    if attempt == 1:
                        raise

        return mw

    store = oncely.IdempotencyStore()
    app = AsgiMiddleware(retrying(AsgiMiddleware(handler, store=store)), store=store)
    assert await _asgi_request(app, _bare_scope(b"order-retry-0001")) == (201, b'{"ok":2}')
    assert await _asgi_request(app, _bare_scope(b"order-retry-0001")) == (201, b'{"ok":2}')
    assert runs == 2


def test_wsgi_mounted_twice_a_retrying_middleware_between_passes_the_request_on_again() -> None:
    runs = 0

    def handler(environ: Any, start_response: Any) -> Any:
        nonlocal runs
        runs += 1
        environ["wsgi.input"].read()
        if runs == 1:
            raise _Transient("deadlock, rolled back")
        start_response("201 Created", [("Content-Type", "application/json")])
        return [b'{"ok":%d}' % runs]

    def retrying(app: Any) -> Any:
        def mw(environ: Any, start_response: Any) -> Any:
            body = environ["wsgi.input"].read()
            for attempt in range(2):
                environ["wsgi.input"] = io.BytesIO(body)
                try:
                    return list(app(environ, start_response))
                except _Transient:
                    if attempt == 1:
                        raise
            raise AssertionError("unreachable")

        return mw

    store = oncely.IdempotencyStore()
    app = WsgiMiddleware(retrying(WsgiMiddleware(handler, store=store)), store=store)
    for _ in range(2):
        env = _wsgi_post("order-retry-0002")
        statuses: list[str] = []
        body = b"".join(app(env, lambda status, headers, exc=None: statuses.append(status)))
        assert (statuses, body) == (["201 Created"], b'{"ok":2}')
    assert runs == 2


async def test_asgi_mounted_twice_a_task_copy_sent_after_the_inner_pass_returned_is_refused() -> (
    None
):
    """outer -> a layer doing more work after the sub-app returns -> inner -> handler,
    one store. A task of the handler sends a copy of the scope to the inner middleware
    after the inner's pass has returned, while the outer still leads: a copy is another
    request (the mark holds for the very scope being led only), so it goes through the
    store and is refused re-entrant, not run again."""
    runs = 0
    got: list[tuple[int, bytes]] = []
    inner: Any = None

    async def later(copy: dict[str, Any]) -> None:
        await asyncio.sleep(0.01)
        got.append(await _asgi_request(inner, copy))

    async def handler(scope: Any, receive: Any, send: Any) -> None:
        nonlocal runs
        runs += 1
        await receive()
        if runs == 1:
            asyncio.get_running_loop().create_task(later(dict(scope)))
        await send({"type": "http.response.start", "status": 201, "headers": []})
        await send({"type": "http.response.body", "body": b'{"run":%d}' % runs})

    def then_more(app: Any) -> Any:
        async def mw(scope: Any, receive: Any, send: Any) -> None:
            await app(scope, receive, send)
            await asyncio.sleep(0.05)  # e.g. an audit flush after the sub-app returned

        return mw

    store = oncely.IdempotencyStore()
    inner = AsgiMiddleware(handler, store=store)
    app = AsgiMiddleware(then_more(inner), store=store)
    assert await _asgi_request(app, _bare_scope(b"order-late-0001")) == (201, b'{"run":1}')
    await asyncio.sleep(0.1)
    assert runs == 1
    assert got and got[0][0] == 500


def test_wsgi_mounted_twice_a_thread_copy_after_the_inner_pass_is_replayed() -> None:
    """As above with WSGI and a thread: the copy, another request, waits for the lead
    and gets its answer replayed; the handler ran once."""
    runs = 0
    got: list[tuple[list[str], bytes]] = []
    threads: list[threading.Thread] = []
    inner: Any = None

    def copy_later(copy: dict[str, Any]) -> None:
        time.sleep(0.01)
        statuses: list[str] = []
        copy["wsgi.input"] = io.BytesIO(b"{}")
        body = b"".join(inner(copy, lambda status, headers, exc=None: statuses.append(status)))
        got.append((statuses, body))

    def handler(environ: Any, start_response: Any) -> Any:
        nonlocal runs
        runs += 1
        environ["wsgi.input"].read()
        if runs == 1:
            t = threading.Thread(target=copy_later, args=(environ.copy(),))
            threads.append(t)
            t.start()
        start_response("201 Created", [("Content-Type", "application/json")])
        return [b'{"run":%d}' % runs]

    def then_more(app: Any) -> Any:
        def mw(environ: Any, start_response: Any) -> Any:
            result = app(environ, start_response)
            try:
                body = b"".join(result)
            finally:
                close = getattr(result, "close", None)
                if close is not None:
                    close()
            time.sleep(0.05)  # work after the sub-app's body was closed
            return [body]

        return mw

    store = oncely.IdempotencyStore()
    inner = WsgiMiddleware(handler, store=store)
    app = WsgiMiddleware(then_more(inner), store=store)
    env = _wsgi_post("order-late-0002")
    statuses: list[str] = []
    body = b"".join(app(env, lambda status, headers, exc=None: statuses.append(status)))
    assert (statuses, body) == (["201 Created"], b'{"run":1}')
    for t in threads:
        t.join(10)
    assert got == [(["201 Created"], b'{"run":1}')]
    assert runs == 1


def test_wsgi_mounted_twice_a_retry_after_a_body_that_raised_passes_the_request_on() -> None:
    """The retrying middleware between two mounts, with a body that fails while it is
    iterated (a generator) and is not closed by the middleware: the same environ passed
    again is still the request being led."""
    runs = 0

    def handler(environ: Any, start_response: Any) -> Any:
        nonlocal runs
        runs += 1
        environ["wsgi.input"].read()
        start_response("201 Created", [("Content-Type", "application/json")])
        n = runs

        def body() -> Iterator[bytes]:
            if n == 1:
                raise _Transient("deadlock, rolled back")
            yield b'{"ok":%d}' % n

        return body()

    def retrying(app: Any) -> Any:
        def mw(environ: Any, start_response: Any) -> Any:
            data = environ["wsgi.input"].read()
            for attempt in range(2):
                environ["wsgi.input"] = io.BytesIO(data)
                try:
                    return list(app(environ, start_response))
                except _Transient:
                    if attempt == 1:
                        raise
            raise AssertionError("unreachable")

        return mw

    store = oncely.IdempotencyStore()
    app = WsgiMiddleware(retrying(WsgiMiddleware(handler, store=store)), store=store)
    env = _wsgi_post("order-retry-0003")
    statuses: list[str] = []
    body = b"".join(app(env, lambda status, headers, exc=None: statuses.append(status)))
    assert body == b'{"ok":2}'
    assert runs == 2


async def test_asgi_one_store_on_an_app_and_a_starlette_mount_leads_once() -> None:
    """Starlette's Mount changes the scope in place: the sub-app's middleware sees the
    very scope being led and passes it on."""
    from starlette.routing import Mount

    calls = 0

    async def orders(request: Request) -> Response:
        nonlocal calls
        calls += 1
        await request.body()
        return Response(f'{{"n":{calls}}}', status_code=201, media_type="application/json")

    store = oncely.IdempotencyStore()
    sub = AsgiMiddleware(
        Starlette(routes=[Route("/orders", orders, methods=["POST"])]), store=store
    )
    app = AsgiMiddleware(Starlette(routes=[Mount("/api", app=sub)]), store=store)
    transport = httpx.ASGITransport(app=app)
    headers = {**POST, "idempotency-key": "order-mount-0001"}
    async with httpx.AsyncClient(transport=transport, base_url="http://app") as client:
        first = await client.post("/api/orders", content=b"{}", headers=headers)
        again = await client.post("/api/orders", content=b"{}", headers=headers)
    assert (first.status_code, first.text) == (201, '{"n":1}')
    assert (again.status_code, again.text) == (201, '{"n":1}')
    assert again.headers.get("idempotent-replayed") == "true"
    assert calls == 1


async def _plain_handler_app() -> tuple[Any, list[int]]:
    runs = [0]

    async def handler(scope: Any, receive: Any, send: Any) -> None:
        runs[0] += 1
        await receive()
        headers = [(b"content-type", b"application/json")]
        await send({"type": "http.response.start", "status": 201, "headers": headers})
        await send({"type": "http.response.body", "body": b'{"n":%d}' % runs[0]})

    return handler, runs


async def test_asgi_mounted_twice_through_hypercorns_dispatcher_which_copies_the_scope() -> None:
    """hypercorn's DispatcherMiddleware hands the sub-app a copy of the scope: the
    request being led, on its way down, still passes the inner middleware (once)."""
    dispatcher = pytest.importorskip("hypercorn.middleware").DispatcherMiddleware
    handler, runs = await _plain_handler_app()
    store = oncely.IdempotencyStore()
    app = AsgiMiddleware(dispatcher({"/sub": AsgiMiddleware(handler, store=store)}), store=store)
    headers = {**POST, "idempotency-key": "order-dispatch-0001"}
    async with httpx.AsyncClient(
        transport=httpx.ASGITransport(app=app), base_url="http://app"
    ) as c:
        first = await c.post("/sub/orders", content=b"{}", headers=headers)
        again = await c.post("/sub/orders", content=b"{}", headers=headers)
    assert (first.status_code, first.text) == (201, '{"n":1}')
    assert (again.status_code, again.text) == (201, '{"n":1}')
    assert again.headers.get("idempotent-replayed") == "true"
    assert runs == [1]


async def test_asgi_a_middleware_that_deep_copies_the_scope_under_the_lead() -> None:
    """hypercorn's ProxyFixMiddleware deep-copies the scope: the lead's mark, which holds
    the store, is kept as it is instead of failing every keyed request."""
    proxy_fix = pytest.importorskip("hypercorn.middleware").ProxyFixMiddleware
    handler, runs = await _plain_handler_app()
    app = AsgiMiddleware(
        proxy_fix(handler, mode="legacy", trusted_hops=1), store=oncely.IdempotencyStore()
    )
    headers = {**POST, "idempotency-key": "order-proxyfix-0001"}
    async with httpx.AsyncClient(
        transport=httpx.ASGITransport(app=app), base_url="http://app"
    ) as c:
        first = await c.post("/orders", content=b"{}", headers=headers)
        again = await c.post("/orders", content=b"{}", headers=headers)
    assert (first.status_code, first.text) == (201, '{"n":1}')
    assert (again.status_code, again.text) == (201, '{"n":1}')
    assert runs == [1]


async def test_asgi_the_led_scope_sent_back_to_the_leading_middleware_is_refused() -> None:
    """The handler sends the very scope it is leading back through the middleware (an
    in-process forward): another run of the request from inside its lead, refused
    re-entrant, not run a second time."""
    runs = 0
    got: list[tuple[int, bytes]] = []
    mw: Any = None

    async def handler(scope: Any, receive: Any, send: Any) -> None:
        nonlocal runs
        runs += 1
        await receive()
        if runs == 1:
            got.append(await _asgi_request(mw, scope))
        await send({"type": "http.response.start", "status": 201, "headers": []})
        await send({"type": "http.response.body", "body": b'{"n":%d}' % runs})

    mw = AsgiMiddleware(handler, store=oncely.IdempotencyStore())
    assert await _asgi_request(mw, _bare_scope(b"order-forward-0001")) == (201, b'{"n":1}')
    assert runs == 1
    assert got and got[0][0] == 500


def test_wsgi_the_led_environ_sent_back_to_the_leading_middleware_is_refused() -> None:
    runs = 0
    nested: list[str] = []
    mw: Any = None

    def app(environ: Any, start_response: Any) -> Any:
        nonlocal runs
        runs += 1
        environ["wsgi.input"].read()
        if runs == 1:
            environ["wsgi.input"] = io.BytesIO(b"{}")
            b"".join(mw(environ, lambda status, headers, exc=None: nested.append(status)))
        start_response("201 Created", [("Content-Type", "application/json")])
        return [b'{"n":%d}' % runs]

    mw = WsgiMiddleware(app, store=oncely.IdempotencyStore())
    env = _wsgi_post("order-forward-0002")
    statuses: list[str] = []
    body = b"".join(mw(env, lambda status, headers, exc=None: statuses.append(status)))
    assert (statuses, body) == (["201 Created"], b'{"n":1}')
    assert nested and nested[0].startswith("500")
    assert runs == 1


async def test_asgi_mounted_twice_a_retry_through_a_layer_that_copies_the_scope() -> None:
    """outer -> retrying middleware -> a layer copying the scope (a dispatcher) -> inner:
    each attempt reaches the inner middleware as a new copy, after the previous pass has
    returned: it is still the request being led, and passes."""
    runs = 0

    async def handler(scope: Any, receive: Any, send: Any) -> None:
        nonlocal runs
        runs += 1
        await receive()
        if runs == 1:
            raise _Transient("deadlock, rolled back")
        await send({"type": "http.response.start", "status": 201, "headers": []})
        await send({"type": "http.response.body", "body": b'{"ok":%d}' % runs})

    def retrying(app: Any) -> Any:
        async def mw(scope: Any, receive: Any, send: Any) -> None:
            first = await receive()
            for attempt in range(2):
                given = [first]

                async def again() -> dict[str, Any]:
                    if given:
                        return given.pop()
                    await asyncio.Event().wait()
                    return {}

                try:
                    await app(scope, again, send)
                    return
                except _Transient:
                    if attempt == 1:
                        raise

        return mw

    def copying(app: Any) -> Any:
        async def mw(scope: Any, receive: Any, send: Any) -> None:
            await app(dict(scope), receive, send)

        return mw

    store = oncely.IdempotencyStore()
    inner = AsgiMiddleware(handler, store=store)
    app = AsgiMiddleware(retrying(copying(inner)), store=store)
    assert await _asgi_request(app, _bare_scope(b"order-retry-0004")) == (201, b'{"ok":2}')
    assert runs == 2


async def test_asgi_mounted_twice_the_handler_sending_its_scope_back_through_the_sub_app() -> None:
    """The handler sends its very scope back through the sub-app it runs in (the inner
    middleware, passing it on right now): another run from inside the lead, refused."""
    runs = 0
    got: list[tuple[int, bytes]] = []
    inner: Any = None

    async def handler(scope: Any, receive: Any, send: Any) -> None:
        nonlocal runs
        runs += 1
        await receive()
        if runs == 1:
            got.append(await _asgi_request(inner, scope))
        await send({"type": "http.response.start", "status": 201, "headers": []})
        await send({"type": "http.response.body", "body": b'{"n":%d}' % runs})

    store = oncely.IdempotencyStore()
    inner = AsgiMiddleware(handler, store=store)
    outer = AsgiMiddleware(inner, store=store)
    assert await _asgi_request(outer, _bare_scope(b"order-back-0001")) == (201, b'{"n":1}')
    assert runs == 1
    assert got and got[0][0] == 500


def test_wsgi_mounted_twice_a_retry_through_a_layer_that_copies_the_environ() -> None:
    runs = 0

    def handler(environ: Any, start_response: Any) -> Any:
        nonlocal runs
        runs += 1
        environ["wsgi.input"].read()
        if runs == 1:
            raise _Transient("deadlock, rolled back")
        start_response("201 Created", [("Content-Type", "application/json")])
        return [b'{"ok":%d}' % runs]

    def retrying(app: Any) -> Any:
        def mw(environ: Any, start_response: Any) -> Any:
            data = environ["wsgi.input"].read()
            for attempt in range(2):
                copy = dict(environ, **{"wsgi.input": io.BytesIO(data)})
                try:
                    return list(app(copy, start_response))
                except _Transient:
                    if attempt == 1:
                        raise
            raise AssertionError("unreachable")

        return mw

    store = oncely.IdempotencyStore()
    app = WsgiMiddleware(retrying(WsgiMiddleware(handler, store=store)), store=store)
    env = _wsgi_post("order-retry-0005")
    statuses: list[str] = []
    body = b"".join(app(env, lambda status, headers, exc=None: statuses.append(status)))
    assert (statuses, body) == (["201 Created"], b'{"ok":2}')
    assert runs == 2


async def test_asgi_a_deep_copy_of_the_scope_does_not_keep_the_lead_past_its_end() -> None:
    """outer -> ProxyFix (deep-copies the scope) -> inner, one store. A task sends a copy
    of the handler's scope through the inner middleware once the lead is over: the copy's
    mark (kept by the deep copy) has ended, so it goes through the store and is replayed,
    not passed on to run the handler again."""
    proxy_fix = pytest.importorskip("hypercorn.middleware").ProxyFixMiddleware
    runs = 0
    later: list[tuple[int, bytes]] = []
    inner: Any = None

    async def after(scope: dict[str, Any]) -> None:
        await asyncio.sleep(0.1)  # the request is over by then
        later.append(await _asgi_request(inner, dict(scope)))

    async def handler(scope: Any, receive: Any, send: Any) -> None:
        nonlocal runs
        runs += 1
        await receive()
        if runs == 1:
            asyncio.get_running_loop().create_task(after(scope))
        await send({"type": "http.response.start", "status": 201, "headers": []})
        await send({"type": "http.response.body", "body": b'{"run":%d}' % runs})

    store = oncely.IdempotencyStore()
    inner = AsgiMiddleware(handler, store=store)
    app = AsgiMiddleware(proxy_fix(inner, mode="legacy", trusted_hops=1), store=store)
    assert await _asgi_request(app, _bare_scope(b"order-deep-0001")) == (201, b'{"run":1}')
    await asyncio.sleep(0.3)
    assert later == [(201, b'{"run":1}')]
    assert runs == 1


async def test_asgi_mounted_twice_a_hedged_copy_sent_while_the_inner_passes_is_not_run_again() -> (
    None
):
    """A layer between the mounts sends a copy of the request through the sub-app when
    the first attempt is slow (a hedged request), while the inner middleware is still
    passing the first: the copy goes through the store (it waits, then is replayed)."""
    runs = 0

    async def handler(scope: Any, receive: Any, send: Any) -> None:
        nonlocal runs
        runs += 1
        await receive()
        await asyncio.sleep(0.1)
        await send({"type": "http.response.start", "status": 201, "headers": []})
        await send({"type": "http.response.body", "body": b'{"run":%d}' % runs})

    def hedging(app: Any) -> Any:
        async def mw(scope: Any, receive: Any, send: Any) -> None:
            first = await receive()

            async def attempt(copy: dict[str, Any], out: Any) -> None:
                given = [first]

                async def again() -> dict[str, Any]:
                    if given:
                        return given.pop()
                    await asyncio.Event().wait()
                    return {}

                await app(copy, again, out)

            hedged: list[dict[str, Any]] = []

            async def keep(m: dict[str, Any]) -> None:
                hedged.append(m)

            main = asyncio.ensure_future(attempt(dict(scope), send))
            await asyncio.sleep(0.02)
            await asyncio.gather(main, attempt(dict(scope), keep))

        return mw

    store = oncely.IdempotencyStore()
    app = AsgiMiddleware(hedging(AsgiMiddleware(handler, store=store)), store=store)
    assert await _asgi_request(app, _bare_scope(b"order-hedge-0001")) == (201, b'{"run":1}')
    assert runs == 1


@pytest.mark.parametrize("what", ["its scope", "a copy made late"])
async def test_asgi_mounted_twice_a_task_sending_the_request_after_the_inner_pass_ended(
    what: str,
) -> None:
    """outer -> a layer working on after the sub-app returns -> inner -> handler. A task
    of the handler sends the request (its very scope, or a copy made then) through the
    inner middleware once the inner's pass has ended, while the outer still leads: it
    runs in that pass's context, so it is refused, not run again."""
    runs = 0
    got: list[tuple[int, bytes]] = []
    inner: Any = None

    async def later(scope: dict[str, Any]) -> None:
        await asyncio.sleep(0.02)
        got.append(await _asgi_request(inner, scope if what == "its scope" else dict(scope)))

    async def handler(scope: Any, receive: Any, send: Any) -> None:
        nonlocal runs
        runs += 1
        await receive()
        if runs == 1:
            asyncio.get_running_loop().create_task(later(scope))
        await send({"type": "http.response.start", "status": 201, "headers": []})
        await send({"type": "http.response.body", "body": b'{"run":%d}' % runs})

    def then_more(app: Any) -> Any:
        async def mw(scope: Any, receive: Any, send: Any) -> None:
            await app(scope, receive, send)
            await asyncio.sleep(0.1)

        return mw

    store = oncely.IdempotencyStore()
    inner = AsgiMiddleware(handler, store=store)
    app = AsgiMiddleware(then_more(inner), store=store)
    assert await _asgi_request(app, _bare_scope(b"order-late-0003")) == (201, b'{"run":1}')
    await asyncio.sleep(0.1)
    assert runs == 1
    assert got and got[0][0] == 500


async def test_asgi_mounted_twice_a_copy_forwarded_with_another_key_through_the_root_leads() -> (
    None
):
    """The handler forwards a copy of its scope, with another key, to another route
    through the root app: another request, with a lead of its own in both mounts (the
    copy's stamp names the first lead only). Before, it was refused 500."""
    from starlette.routing import Mount

    runs = {"v1": 0, "v2": 0}
    forwarded: list[tuple[int, bytes]] = []
    root: Any = None

    async def v1(request: Request) -> Response:
        runs["v1"] += 1
        await request.body()
        s = request.scope
        headers = [(n, v) for n, v in s["headers"] if n != b"idempotency-key"]
        copy = {
            **s,
            "path": "/sub/v2",
            "raw_path": b"/sub/v2",
            "root_path": "",
            "headers": [*headers, (b"idempotency-key", b"order-forwarded-0001")],
        }
        for k in ("path_params", "endpoint", "route"):
            copy.pop(k, None)
        forwarded.append(await asyncio.wait_for(_asgi_request(root, copy), 5))
        return Response('{"v1":1}', status_code=201, media_type="application/json")

    async def v2(request: Request) -> Response:
        runs["v2"] += 1
        await request.body()
        return Response('{"v2":1}', status_code=201, media_type="application/json")

    store = oncely.IdempotencyStore()
    sub = Starlette(routes=[Route("/v1", v1, methods=["POST"]), Route("/v2", v2, methods=["POST"])])
    sub.add_middleware(AsgiMiddleware, store=store, route=lambda s: None)
    root = Starlette(routes=[Mount("/sub", sub)])
    root.add_middleware(AsgiMiddleware, store=store, route=lambda s: None)
    headers = {**POST, "idempotency-key": "order-forward-0003"}
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=root), base_url="http://a") as c:
        r = await c.post("/sub/v1", content=b"{}", headers=headers)
    assert (r.status_code, r.text) == (201, '{"v1":1}')
    assert forwarded == [(201, b'{"v2":1}')]
    assert runs == {"v1": 1, "v2": 1}


async def test_asgi_mounted_twice_what_the_sub_app_sets_on_the_scope_is_seen_above() -> None:
    """A layer above the mounts reads what the routing below set on the scope once the
    call returns (a metrics label from scope["route"]): the inner middleware hands its app
    the scope itself, so the label is there."""
    from starlette.routing import Mount

    labels: list[Any] = []
    calls = 0

    async def order(request: Request) -> Response:
        nonlocal calls
        calls += 1
        await request.body()
        return Response('{"ok":1}', status_code=201, media_type="application/json")

    def metrics(app: Any) -> Any:
        async def mw(scope: Any, receive: Any, send: Any) -> None:
            await app(scope, receive, send)
            route = scope.get("route")
            labels.append(getattr(route, "path", None))

        return mw

    store = oncely.IdempotencyStore()
    sub = AsgiMiddleware(
        Starlette(routes=[Route("/orders/{oid}", order, methods=["POST"])]),
        store=store,
        route=lambda s: None,
    )
    app = AsgiMiddleware(
        metrics(Starlette(routes=[Mount("/v1", app=sub)])), store=store, route=lambda s: None
    )
    headers = {**POST, "idempotency-key": "order-label-0001"}
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://a") as c:
        first = await c.post("/v1/orders/7", content=b"{}", headers=headers)
        again = await c.post("/v1/orders/7", content=b"{}", headers=headers)
    assert (first.status_code, again.status_code) == (201, 201)
    assert again.headers.get("idempotent-replayed") == "true"
    assert labels[0] == "/orders/{oid}"
    assert calls == 1


def test_wsgi_mounted_twice_a_copy_made_while_a_streamed_body_runs_waits_for_the_lead() -> None:
    """The handler's work runs as its body is read (a generator); meanwhile a thread it
    starts copies the environ and sends the copy through the inner middleware once the
    body has closed, while the outer still leads: the copy carries the pass's stamp (kept
    until the body is done), so it waits for the lead and is replayed."""
    runs = 0
    got: list[tuple[list[str], bytes]] = []
    threads: list[threading.Thread] = []
    inner: Any = None

    def fan(environ: Any) -> None:
        copy = environ.copy()  # made during the pass

        def later() -> None:
            time.sleep(0.02)
            copy["wsgi.input"] = io.BytesIO(b"{}")
            statuses: list[str] = []
            body = b"".join(inner(copy, lambda status, headers, exc=None: statuses.append(status)))
            got.append((statuses, body))

        t = threading.Thread(target=later)
        threads.append(t)
        t.start()

    def handler(environ: Any, start_response: Any) -> Any:
        environ["wsgi.input"].read()

        def body() -> Iterator[bytes]:
            nonlocal runs
            runs += 1
            if runs == 1:
                fan(environ)
            yield b'{"run":%d}' % runs

        start_response("201 Created", [("Content-Type", "application/json")])
        return body()

    def then_more(app: Any) -> Any:
        def mw(environ: Any, start_response: Any) -> Any:
            result = app(environ, start_response)
            try:
                body = list(result)
            finally:
                close = getattr(result, "close", None)
                if close is not None:
                    close()
            time.sleep(0.05)
            return body

        return mw

    store = oncely.IdempotencyStore()
    inner = WsgiMiddleware(handler, store=store)
    app = WsgiMiddleware(then_more(inner), store=store)
    env = _wsgi_post("order-stream-copy-0001")
    statuses: list[str] = []
    body = b"".join(app(env, lambda status, headers, exc=None: statuses.append(status)))
    for t in threads:
        t.join(10)
    assert body == b'{"run":1}'
    assert got == [(["201 Created"], b'{"run":1}')]
    assert runs == 1


def test_wsgi_passes_to_two_sibling_sub_apps_ending_out_of_order_keep_each_stamp() -> None:
    """A layer under the outer middleware sends the request to two sub-apps, each with
    the same store's middleware, and streams both bodies: the first pass ends before the
    second. A copy made while the second body runs keeps that pass's stamp, and a thread
    sending it through the second sub-app later waits for the lead and gets its answer.
    Before, the first pass's end removed the second's stamp, and the copy ran it again."""
    runs = {"A": 0, "B": 0}
    got: list[tuple[list[str], bytes]] = []
    threads: list[threading.Thread] = []
    b_mw: Any = None

    def sub(name: str) -> Any:
        def handler(environ: Any, start_response: Any) -> Any:
            environ["wsgi.input"].read()

            def body() -> Iterator[bytes]:
                runs[name] += 1
                if name == "B" and runs["B"] == 1:
                    copy = environ.copy()

                    def later() -> None:
                        time.sleep(0.05)
                        copy["wsgi.input"] = io.BytesIO(b"{}")
                        statuses: list[str] = []
                        answer = b"".join(
                            b_mw(copy, lambda status, headers, exc=None: statuses.append(status))
                        )
                        got.append((statuses, answer))

                    t = threading.Thread(target=later)
                    threads.append(t)
                    t.start()
                yield b'{"%s":%d}' % (name.encode(), runs[name])

            start_response("201 Created", [("Content-Type", "application/json")])
            return body()

        return handler

    store = oncely.IdempotencyStore()
    a_mw = WsgiMiddleware(sub("A"), store=store)
    b_mw = WsgiMiddleware(sub("B"), store=store)

    def fan(environ: Any, start_response: Any) -> Any:
        first = a_mw(environ, start_response)
        environ["wsgi.input"] = io.BytesIO(b"{}")
        environ["CONTENT_LENGTH"] = "2"
        second = b_mw(environ, lambda *a: None)

        def out() -> Iterator[bytes]:
            yield from first
            yield from second
            time.sleep(0.2)  # the outer still leads when the thread's copy comes

        return out()

    app = WsgiMiddleware(fan, store=store)
    env = _wsgi_post("order-fan-0001")
    b"".join(app(env, lambda status, headers, exc=None: None))
    for t in threads:
        t.join(10)
    # The copy is a duplicate of the request being led: it gets the lead's answer.
    assert got == [(["201 Created"], b'{"A":1}{"B":1}')]
    assert runs == {"A": 1, "B": 1}


@pytest.mark.parametrize(("method", "status"), [("HEAD", 200), ("HEAD", 404), ("POST", 204)])
async def test_asgi_an_answer_without_content_is_stored_and_replayed_without_a_body(
    method: str, status: int
) -> None:
    """An app that writes a body to a HEAD, or with a 204 (the server sends none):
    the record keeps what was sent, no body, and its replay has neither a body nor a
    Content-Length (a HEAD's would have to be its GET's, and a 1xx or 204 has none).
    Before, the body was stored and replayed with its length."""
    runs = 0

    async def app(scope: Any, receive: Any, send: Any) -> None:
        nonlocal runs
        runs += 1
        await send(
            {"type": "http.response.start", "status": status, "headers": [(b"etag", b'"1"')]}
        )
        await send({"type": "http.response.body", "body": b"hello"})

    mw = AsgiMiddleware(app, store=oncely.IdempotencyStore(), methods=[method])
    replays: list[dict[str, Any]] = []
    for _ in range(2):
        sent: list[dict[str, Any]] = []

        async def receive() -> dict[str, Any]:
            return {"type": "http.request", "body": b"", "more_body": False}

        async def send(m: dict[str, Any], into: list[dict[str, Any]] = sent) -> None:
            into.append(m)

        await mw({**_bare_scope(b"order-head-0001"), "method": method}, receive, send)
        replays = sent
    assert runs == 1
    start = next(m for m in replays if m["type"] == "http.response.start")
    headers = dict(start["headers"])
    assert headers[b"idempotent-replayed"] == b"true"
    assert b"content-length" not in headers
    assert b"".join(m.get("body", b"") for m in replays if m["type"] == "http.response.body") == b""


def test_wsgi_an_answer_without_content_is_stored_without_its_body() -> None:
    """The WSGI adapter keeps the same record: a HEAD's answer has no body and its
    replay no Content-Length."""
    runs = 0

    def app(environ: Any, start_response: Any) -> list[bytes]:
        nonlocal runs
        runs += 1
        start_response("200 OK", [("ETag", '"1"')])
        return [b"hello"]

    mw = WsgiMiddleware(app, store=oncely.IdempotencyStore(), methods=["HEAD"])
    answers = []
    for _ in range(2):
        heads: list[Any] = []
        env = {**_wsgi_post("order-head-0001"), "REQUEST_METHOD": "HEAD"}
        body = b"".join(mw(env, lambda status, headers, exc=None: heads.append(headers)))
        answers.append((dict((n.lower(), v) for n, v in heads[0]), body))
    assert runs == 1
    headers, body = answers[1]
    assert headers["idempotent-replayed"] == "true"
    assert "content-length" not in headers
    assert body == b""


def test_a_declared_length_is_judged_by_the_core() -> None:
    """The request cap and its Content-Length rule are the core's (one rule in every
    language): digits only, optional whitespace around them, and a number past any size
    is over the cap."""
    config = oncely.http.ServerConfig(request_cap=10)
    assert config.request_cap == 10
    assert config.declares_too_large(b" 11\t") is True
    assert config.declares_too_large(b"10") is False
    assert config.declares_too_large(b"99999999999999999999999999") is True
    assert config.declares_too_large(b"0x20") is False
    assert config.too_large().status == 413
    assert "10 bytes" in config.too_large().detail
    with pytest.raises(oncely.errors.InvalidArgumentError) as info:
        oncely.http.ServerConfig(request_cap=-1)
    assert info.value.field == "request_cap"


class _CountingInput(io.BytesIO):
    """A wsgi.input that counts the bytes read from it."""

    def __init__(self, data: bytes) -> None:
        super().__init__(data)
        self.taken = 0

    def read(self, size: Any = -1) -> bytes:
        chunk = super().read(size)
        self.taken += len(chunk)
        return chunk


class _Created:
    """A WSGI app answering 201 ``{}`` that counts its runs."""

    def __init__(self) -> None:
        self.runs = 0

    def __call__(self, environ: Any, start_response: Any) -> list[bytes]:
        self.runs += 1
        start_response("201 Created", [])
        return [b"{}"]


def _wsgi_answer(app: Any, environ: dict[str, Any]) -> tuple[list[str], bytes]:
    """The statuses ``app`` started with for ``environ``, and its whole body."""
    statuses: list[str] = []
    body = b"".join(app(environ, lambda status, headers, exc=None: statuses.append(status)))
    return statuses, body


@pytest.mark.parametrize("declared", ["+5000000", "5_000_000", "\xa05000000", "5e6", "-5"])
def test_wsgi_a_content_length_that_is_no_length_is_refused_unread(declared: str) -> None:
    """wsgiref passes any Content-Length on. One that declares no length (a sign, an
    underscore, a no-break space: Python's int() takes them all) is refused 400 with
    nothing read. Before, it slipped past the request cap and the middleware read the
    whole declared length (or waited for it)."""
    app = _Created()
    mw = WsgiMiddleware(app, store=oncely.IdempotencyStore(), request_cap=10)
    stream = _CountingInput(b"x" * 6_000_000)
    env = {**_wsgi_post("order-len-0001"), "CONTENT_LENGTH": declared, "wsgi.input": stream}
    statuses, body = _wsgi_answer(mw, env)
    assert statuses and statuses[0].startswith("400"), (statuses, body)
    assert b"body-unreadable" in body
    assert (stream.taken, app.runs) == (0, 0)


def test_header_values_of_other_types_are_read_as_their_text() -> None:
    """Outside the specs, a server or a test may give a Content-Length as ``str`` (ASGI)
    or ``int`` (WSGI): it is read as its text, not a TypeError out of the middleware."""
    app = _Created()
    mw = WsgiMiddleware(app, store=oncely.IdempotencyStore(), request_cap=10)
    for key, declared, want in [("order-int-0001", 2, "201"), ("order-int-0002", 50, "413")]:
        statuses, _ = _wsgi_answer(mw, {**_wsgi_post(key), "CONTENT_LENGTH": declared})
        assert statuses[0].startswith(want)

    async def asgi_app(scope: Any, receive: Any, send: Any) -> None:
        await send({"type": "http.response.start", "status": 201, "headers": []})
        await send({"type": "http.response.body", "body": b"{}"})

    amw = AsgiMiddleware(asgi_app, store=oncely.IdempotencyStore(), request_cap=10)
    for key, declared, want in [(b"order-str-0001", "2", 201), (b"order-str-0002", "50", 413)]:
        scope = _bare_scope(key)
        scope["headers"] = [*scope["headers"], (b"content-length", declared)]
        status, _ = asyncio.run(_asgi_request(amw, scope))
        assert status == want
    assert app.runs == 1


@pytest.mark.parametrize("declared", ["3", "40", "xyz", "0"])
def test_wsgi_a_terminated_input_is_read_to_its_end_whatever_its_length_says(declared: str) -> None:
    """A server that de-chunks a request ends its input where the body ends
    (``wsgi.input_terminated``, werkzeug's dev server) and may pass a Content-Length on
    beside the transfer coding: the transfer coding wins (RFC 9112 §6.3), so the body is
    read to its end. Before, the length was followed unless it was 0: the app got a body
    cut short (fingerprinted and stored as such), or a 400."""
    seen: list[bytes] = []

    def app(environ: Any, start_response: Any) -> list[bytes]:
        seen.append(environ["wsgi.input"].read(int(environ["CONTENT_LENGTH"])))
        start_response("201 Created", [])
        return [b"{}"]

    mw = WsgiMiddleware(app, store=oncely.IdempotencyStore(), request_cap=100)
    env = {
        **_wsgi_post("order-term-0001"),
        "CONTENT_LENGTH": declared,
        "wsgi.input": io.BytesIO(b'{"sku":"A1"}'),
        "wsgi.input_terminated": True,
    }
    statuses, _ = _wsgi_answer(mw, env)
    assert (statuses, seen) == (["201 Created"], [b'{"sku":"A1"}'])


def test_wsgi_a_terminated_input_over_the_cap_is_refused() -> None:
    """Read to its end, a terminated input is still held to the request cap: declared
    over it, it is refused before it is read; not declared, once past it."""
    mw = WsgiMiddleware(lambda e, s: [], store=oncely.IdempotencyStore(), request_cap=10)
    for key, declared in [("order-term-0002", "50"), ("order-term-0003", "")]:
        stream = _CountingInput(b"x" * 50)
        env = {
            **_wsgi_post(key),
            "CONTENT_LENGTH": declared,
            "wsgi.input": stream,
            "wsgi.input_terminated": True,
        }
        statuses, _ = _wsgi_answer(mw, env)
        assert statuses[0].startswith("413")
        assert stream.taken <= 11


def test_asgi_str_headers_a_server_sends_are_recorded_and_the_app_runs_once() -> None:
    """uvicorn sends response headers given as ``str`` (the spec says bytes): the
    middleware records them as their Latin-1 bytes. Before, building the record raised
    inside the lead, the key was released and every retry ran the app again."""
    runs = 0

    async def app(scope: Any, receive: Any, send: Any) -> None:
        nonlocal runs
        runs += 1
        headers = [("content-type", "application/json"), ("etag", '"1"')]
        await send({"type": "http.response.start", "status": 201, "headers": headers})
        await send({"type": "http.response.body", "body": b'{"n":1}'})

    mw = AsgiMiddleware(app, store=oncely.IdempotencyStore())
    answers = [asyncio.run(_asgi_request(mw, _bare_scope(b"order-strh-0001"))) for _ in range(2)]
    assert answers == [(201, b'{"n":1}'), (201, b'{"n":1}')]
    assert runs == 1
