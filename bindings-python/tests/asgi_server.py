"""A real uvicorn server on 127.0.0.1 in a thread, and the test app of
tests/vectors/http_server.json (see tests/vectors/README.md): one handler on
``/orders``, ``/orders/{id}`` and ``/payments`` that counts its calls and answers as the
``x-respond`` request header says."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from typing import Any, Callable, Optional

import uvicorn
from oncely import http
from oncely.asgi import Scope


class Dispatch:
    """The ASGI app the server runs: hands every request to ``app``, which a test may
    replace between cases."""

    def __init__(self) -> None:
        self.app: Any = None

    async def __call__(self, scope: Scope, receive: Any, send: Any) -> None:
        await self.app(scope, receive, send)


class Server:
    def __init__(self, app: Any) -> None:
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        config = uvicorn.Config(
            app, log_level="error", lifespan="off", loop="asyncio", http="h11", backlog=2048
        )
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]})

    def __enter__(self) -> Server:
        self.thread.start()
        deadline = time.monotonic() + 20
        while not self.server.started:
            assert self.thread.is_alive() and time.monotonic() < deadline, "uvicorn did not start"
            time.sleep(0.01)
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self.thread.join(20)
        self.sock.close()


class Handler:
    """Counts its calls; call n answers ``{"call":n}`` (or ``bytes`` x's), with
    ``etag: "call-n"``, ``x-call: n`` and ``set-cookie: call=n``."""

    def __init__(self) -> None:
        self.calls = 0

    async def answer(
        self, respond_header: Optional[str]
    ) -> tuple[int, bytes, list[tuple[str, str]]]:
        self.calls += 1
        n = self.calls
        respond = json.loads(respond_header) if respond_header else {}
        if respond.get("delay_ms"):
            await asyncio.sleep(respond["delay_ms"] / 1000)
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
        return respond.get("status", 201), body, headers


def tenant_of(scope: Scope) -> str:
    for name, value in scope.get("headers") or ():
        if name == b"x-tenant":
            return str(value.decode("latin-1"))
    return http.DEFAULT_TENANT


def wait_until(cond: Callable[[], bool], what: str, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.005)
