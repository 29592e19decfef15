"""oncely.wsgi.IdempotencyMiddleware in front of Flask under a real WSGI server
(wsgiref, one thread per request) on 127.0.0.1, with requests: the request sequences of
tests/vectors/http_server.json (memory and Redis stores), many concurrent duplicates, a
body over the cap, an app that raises, a streaming response."""

from __future__ import annotations

import json
import os
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from socketserver import ThreadingMixIn
from typing import Any, Iterator, Optional
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

import oncely
import pytest
from conftest import load_vectors
from oncely import http
from oncely.wsgi import CounterSet, IdempotencyMiddleware, flask_route

flask = pytest.importorskip("flask")
requests = pytest.importorskip("requests")

SEQUENCES = [c for c in load_vectors("http_server.json") if c["op"] == "sequence"]
METHODS = ["POST", "PATCH", "PUT", "GET"]
REDIS_URL = os.environ.get("ONCELY_REDIS_URL")


class _Server(ThreadingMixIn, WSGIServer):
    daemon_threads = True
    request_queue_size = 512


class _Quiet(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:
        pass


class Dispatch:
    def __init__(self) -> None:
        self.app: Any = None

    def __call__(self, environ: Any, start_response: Any) -> Any:
        return self.app(environ, start_response)


@pytest.fixture(scope="module")
def server() -> Iterator[tuple[str, Dispatch]]:
    dispatch = Dispatch()
    srv = make_server("127.0.0.1", 0, dispatch, server_class=_Server, handler_class=_Quiet)
    thread = threading.Thread(target=srv.serve_forever, kwargs={"poll_interval": 0.05})
    thread.start()
    try:
        yield f"http://127.0.0.1:{srv.server_port}", dispatch
    finally:
        srv.shutdown()
        thread.join(20)
        srv.server_close()


class Handler:
    def __init__(self) -> None:
        self.calls = 0
        self.lock = threading.Lock()

    def answer(self, respond_header: Optional[str]) -> Any:
        with self.lock:
            self.calls += 1
            n = self.calls
        respond = json.loads(respond_header) if respond_header else {}
        if respond.get("delay_ms"):
            time.sleep(respond["delay_ms"] / 1000)
        if "bytes" in respond:
            body, ctype = b"x" * respond["bytes"], "text/plain"
        else:
            body, ctype = (
                json.dumps({"call": n}, separators=(",", ":")).encode(),
                "application/json",
            )
        headers = [
            ("content-type", ctype),
            ("etag", f'"call-{n}"'),
            ("x-call", str(n)),
            ("set-cookie", f"call={n}"),
        ]
        return flask.Response(body, status=respond.get("status", 201), headers=headers)


def flask_app(handler: Handler, store: Any, config: dict[str, Any]) -> Any:
    app = flask.Flask("oncely-test")

    def endpoint(**_kw: Any) -> Any:
        flask.request.get_data()
        return handler.answer(flask.request.headers.get("x-respond"))

    for rule in ("/orders", "/orders/<id>", "/payments"):
        app.add_url_rule(rule, rule, endpoint, methods=METHODS)

    def tenant(environ: Any) -> str:
        return str(environ.get("HTTP_X_TENANT", http.DEFAULT_TENANT))

    app.wsgi_app = IdempotencyMiddleware(  # type: ignore[method-assign]
        app.wsgi_app, store=store, tenant=tenant, route=flask_route(app), **config
    )
    return app


def _store(kind: str) -> Any:
    if kind == "redis":
        if not REDIS_URL:
            pytest.skip("needs ONCELY_REDIS_URL (scripts/with-redis)")
        return oncely.RedisStore(REDIS_URL, prefix=f"wsgi-{uuid.uuid4().hex}")
    return oncely.IdempotencyStore()


def _send(url: str, r: dict[str, Any]) -> Any:
    headers = dict(r.get("headers", {}))
    if "respond" in r:
        headers["x-respond"] = json.dumps(r["respond"])
    return requests.request(
        r["method"], url + r["path"], headers=headers, data=r.get("body", "").encode(), timeout=30
    )


def _check(resp: Any, expect: dict[str, Any], where: str) -> None:
    assert resp.status_code == expect["status"], (where, resp.status_code, resp.text[:200])
    if "replayed" in expect:
        assert (resp.headers.get("idempotent-replayed") == "true") is expect["replayed"], where
    if "call" in expect:
        n = expect["call"]
        if "body_len" in expect:
            assert len(resp.content) == expect["body_len"], where
            assert resp.headers.get("etag") == f'"call-{n}"', where
        else:
            assert resp.json() == {"call": n}, (where, resp.text)
    if "problem" in expect:
        assert resp.headers["content-type"] == http.PROBLEM_CONTENT_TYPE, where
        assert (resp.json()["type"], resp.json()["status"]) == (
            expect["problem"],
            expect["status"],
        ), where
    for name, value in expect.get("headers", {}).items():
        assert resp.headers.get(name) == value, (where, name, dict(resp.headers))


@pytest.mark.parametrize("store_kind", ["memory", "redis"])
@pytest.mark.parametrize("case", SEQUENCES, ids=lambda c: c["comment"][:60])
def test_http_server_sequences_flask(
    case: dict[str, Any], store_kind: str, server: tuple[str, Dispatch]
) -> None:
    url, dispatch = server
    handler = Handler()
    dispatch.app = flask_app(handler, _store(store_kind), case["config"])
    background = None
    with ThreadPoolExecutor(max_workers=200) as pool:
        for i, step in enumerate(case["steps"]):
            where = f"{case['comment']} / step {i}"
            if "concurrent" in step:
                resps = list(
                    pool.map(lambda _: _send(url, step["request"]), range(step["concurrent"]))
                )
                expect = {k: v for k, v in step["expect"].items() if k != "replayed_count"}
                for r in resps:
                    _check(r, expect, where)
                replayed = sum(r.headers.get("idempotent-replayed") == "true" for r in resps)
                assert replayed == step["expect"]["replayed_count"], where
            elif "background" in step:
                background = pool.submit(_send, url, step["background"])
            elif "await_background" in step:
                assert background is not None
                _check(background.result(30), step["expect"], where)
            elif "wait_handler_calls" in step:
                deadline = time.monotonic() + 20
                while handler.calls < step["wait_handler_calls"]:
                    assert time.monotonic() < deadline, where
                    time.sleep(0.005)
            else:
                _check(_send(url, step["request"]), step["expect"], where)
    assert handler.calls == case["handler_calls"], case["comment"]


POST = {"idempotency-key": "order-0001", "content-type": "application/json"}


def test_200_concurrent_requests_one_key(server: tuple[str, Dispatch]) -> None:
    url, dispatch = server
    handler = Handler()
    dispatch.app = flask_app(handler, oncely.IdempotencyStore(), {})
    headers = {**POST, "x-respond": json.dumps({"delay_ms": 100})}
    with ThreadPoolExecutor(max_workers=200) as pool:
        resps = list(
            pool.map(
                lambda _: requests.post(url + "/orders", headers=headers, data=b"{}", timeout=60),
                range(200),
            )
        )
    assert handler.calls == 1
    assert {(r.status_code, r.content, r.headers["etag"]) for r in resps} == {
        (201, b'{"call":1}', '"call-1"')
    }
    assert sum(r.headers.get("idempotent-replayed") == "true" for r in resps) == 199


def test_a_body_over_one_mib_is_sent_not_stored(server: tuple[str, Dispatch]) -> None:
    url, dispatch = server
    handler = Handler()
    counters = CounterSet()
    dispatch.app = flask_app(handler, oncely.IdempotencyStore(), {"counters": counters})
    big = {**POST, "x-respond": json.dumps({"bytes": (1 << 20) + 1})}
    for n in (1, 2):
        r = requests.post(url + "/orders", headers=big, data=b"{}", timeout=30)
        assert (r.status_code, len(r.content), r.headers["etag"]) == (
            201,
            (1 << 20) + 1,
            f'"call-{n}"',
        )
        assert "idempotent-replayed" not in r.headers
    # The action ends just after the last byte is written: wait (bounded) for it.
    deadline = time.monotonic() + 20
    while counters.snapshot().not_stored < 2:
        assert time.monotonic() < deadline
        time.sleep(0.005)
    snap = counters.snapshot()
    assert (snap.led, snap.stored, snap.not_stored) == (2, 0, 2)


def test_a_request_body_over_the_request_cap_is_413(server: tuple[str, Dispatch]) -> None:
    url, dispatch = server
    handler = Handler()
    dispatch.app = flask_app(handler, oncely.IdempotencyStore(), {"request_cap": 10})
    r = requests.post(url + "/orders", headers=POST, data=b"x" * 11, timeout=30)
    assert r.status_code == 413 and r.json()["type"] == "urn:oncely:problem:request-too-large"
    assert handler.calls == 0


def test_an_app_that_raises_answers_waiters_500_and_releases_the_key(
    server: tuple[str, Dispatch],
) -> None:
    url, dispatch = server
    calls = 0
    app = flask.Flask("oncely-raise")

    @app.post("/orders")
    def boom() -> Any:
        nonlocal calls
        calls += 1
        if calls == 1:
            time.sleep(1.0)  # the duplicates arrive meanwhile
            raise RuntimeError("the app failed")
        return flask.Response(b"ok", status=201)

    app.config["PROPAGATE_EXCEPTIONS"] = True
    app.wsgi_app = IdempotencyMiddleware(app.wsgi_app, store=oncely.IdempotencyStore())  # type: ignore[method-assign]
    dispatch.app = app
    with ThreadPoolExecutor(max_workers=8) as pool:
        first = pool.submit(requests.post, url + "/orders", headers=POST, data=b"{}", timeout=30)
        while calls == 0:
            time.sleep(0.005)
        waiters = list(
            pool.map(
                lambda _: requests.post(url + "/orders", headers=POST, data=b"{}", timeout=30),
                range(5),
            )
        )
        assert first.result(30).status_code == 500
    for w in waiters:
        assert w.status_code == 500 and w.json()["type"] == "urn:oncely:problem:internal"
    assert calls == 1
    retry = requests.post(url + "/orders", headers=POST, data=b"{}", timeout=30)
    assert (retry.status_code, retry.content, calls) == (201, b"ok", 2)


def test_a_streaming_response_passes_through_and_holds_the_key(
    server: tuple[str, Dispatch],
) -> None:
    url, dispatch = server
    calls = 0
    go_on = threading.Event()
    app = flask.Flask("oncely-stream")

    @app.post("/orders")
    def stream() -> Any:
        nonlocal calls
        calls += 1

        def events() -> Iterator[bytes]:
            yield b"data: first\n\n"
            assert go_on.wait(20)
            yield b"data: second\n\n"

        return flask.Response(events(), mimetype="text/event-stream")

    app.wsgi_app = IdempotencyMiddleware(app.wsgi_app, store=oncely.IdempotencyStore(), body_cap=4)  # type: ignore[method-assign]
    dispatch.app = app
    with ThreadPoolExecutor(max_workers=2) as pool:
        with requests.post(url + "/orders", headers=POST, data=b"{}", stream=True, timeout=30) as r:
            first = r.raw.read(len(b"data: first\n\n"))  # arrives before the app ends
            assert first == b"data: first\n\n"
            # A duplicate now waits: the key is held until the stream has been sent.
            dup = pool.submit(requests.post, url + "/orders", headers=POST, data=b"{}", timeout=30)
            time.sleep(0.1)
            assert calls == 1 and not dup.done()
            go_on.set()
            rest = r.raw.read()
        assert first + rest == b"data: first\n\ndata: second\n\n"
        again = dup.result(30)
    assert (
        again.headers.get("idempotent-replayed") is None
        and again.content == b"data: first\n\ndata: second\n\n"
    )
    assert calls == 2


class _CompleteFails:
    """A store that runs the action, then cannot keep its outcome (as a store that
    became unreachable, or whose lease was lost, while the app ran)."""

    def execute_sync(self, scoped: Any, fp: str, fn: Any, /, *, wait: bool = True) -> Any:
        fn()
        raise oncely.StoreUnavailableError("unavailable: the store went away")


def test_a_response_the_store_cannot_keep_is_still_the_answer(server: tuple[str, Dispatch]) -> None:
    url, dispatch = server
    handler = Handler()
    dispatch.app = flask_app(handler, _CompleteFails(), {})
    r = requests.post(url + "/orders", headers=POST, data=b"{}", timeout=30)
    # Not a 503 inviting a retry that would run the app again.
    assert (r.status_code, r.json(), r.headers["etag"], handler.calls) == (
        201,
        {"call": 1},
        '"call-1"',
        1,
    )


def test_a_close_that_raises_after_the_whole_body_is_answered_and_stored(
    server: tuple[str, Dispatch],
) -> None:
    url, dispatch = server
    calls = 0

    class Body:
        def __iter__(self) -> Iterator[bytes]:
            yield b'{"id":1}'

        def close(self) -> None:
            raise RuntimeError("a teardown failed")

    def app(environ: Any, start_response: Any) -> Any:
        nonlocal calls
        calls += 1
        environ["wsgi.input"].read()
        start_response("201 Created", [("Content-Type", "application/json")])
        return Body()

    dispatch.app = IdempotencyMiddleware(app, store=oncely.IdempotencyStore())
    first = requests.post(url + "/orders", headers=POST, data=b"{}", timeout=30)
    retry = requests.post(url + "/orders", headers=POST, data=b"{}", timeout=30)
    assert (first.status_code, first.content) == (201, b'{"id":1}')
    assert (retry.status_code, retry.content, retry.headers["idempotent-replayed"]) == (
        201,
        b'{"id":1}',
        "true",
    )
    assert calls == 1


def test_an_event_stream_reaches_its_client_as_it_is_produced(server: tuple[str, Dispatch]) -> None:
    url, dispatch = server
    calls = 0
    go_on = threading.Event()
    app = flask.Flask("oncely-sse")

    @app.post("/orders")
    def stream() -> Any:
        nonlocal calls
        calls += 1

        def events() -> Iterator[bytes]:
            yield b"data: first\n\n"  # far below the cap: never read ahead to it
            assert go_on.wait(20)
            yield b"data: second\n\n"

        return flask.Response(events(), mimetype="text/event-stream")

    app.wsgi_app = IdempotencyMiddleware(app.wsgi_app, store=oncely.IdempotencyStore())  # type: ignore[method-assign]
    dispatch.app = app
    with ThreadPoolExecutor(max_workers=1) as pool:
        with requests.post(url + "/orders", headers=POST, data=b"{}", stream=True, timeout=30) as r:
            got = pool.submit(r.raw.read, len(b"data: first\n\n"))
            try:
                assert got.result(10) == b"data: first\n\n"  # before the stream ends
            finally:
                go_on.set()
            rest = r.raw.read()
        assert rest == b"data: second\n\n"
    again = requests.post(url + "/orders", headers=POST, data=b"{}", timeout=30)
    assert again.headers.get("idempotent-replayed") is None and calls == 2


def test_waiters_of_a_response_not_stored_get_all_its_shared_headers(
    server: tuple[str, Dispatch],
) -> None:
    url, dispatch = server
    handler = Handler()
    dispatch.app = flask_app(handler, oncely.IdempotencyStore(), {})
    headers = {**POST, "x-respond": json.dumps({"status": 503, "delay_ms": 300})}
    with ThreadPoolExecutor(max_workers=8) as pool:
        first = pool.submit(requests.post, url + "/orders", headers=headers, data=b"{}", timeout=30)
        while handler.calls == 0:
            time.sleep(0.005)
        waiters = list(
            pool.map(
                lambda _: requests.post(url + "/orders", headers=POST, data=b"{}", timeout=30),
                range(5),
            )
        )
        first.result(30)
    assert handler.calls == 1
    for w in waiters:
        assert (w.status_code, w.headers["idempotent-replayed"]) == (503, "true")
        assert (w.headers.get("x-call"), w.headers.get("set-cookie")) == ("1", None)


def test_a_negative_content_length_is_refused_unread() -> None:
    calls = 0

    read_whole: list[bool] = []

    class Endless:
        """A client that never stops sending (reading it whole would never end: here
        it gives 2 MiB and says so)."""

        def read(self, size: int = -1) -> bytes:
            read_whole.append(size < 0)
            return b"x" * (size if size >= 0 else 2 << 20)

    def app(environ: Any, start_response: Any) -> Any:
        nonlocal calls
        calls += 1
        start_response("201 Created", [])
        return [b""]

    statuses: list[str] = []
    mw = IdempotencyMiddleware(app, store=oncely.IdempotencyStore())
    environ = {
        "REQUEST_METHOD": "POST",
        "PATH_INFO": "/orders",
        "CONTENT_LENGTH": "-1",
        "HTTP_IDEMPOTENCY_KEY": "order-0001",
        "wsgi.input": Endless(),
    }
    body = b"".join(mw(environ, lambda status, headers, exc_info=None: statuses.append(status)))
    assert statuses == ["400 Bad Request"] and calls == 0 and not any(read_whole)
    assert json.loads(body)["type"] == "urn:oncely:problem:body-unreadable"
