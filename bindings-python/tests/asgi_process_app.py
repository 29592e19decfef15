"""A server process for the cross-process test: uvicorn on 127.0.0.1 (a free port,
printed on stdout) serving a Starlette app behind IdempotencyMiddleware on a RedisStore
(``ONCELY_REDIS_URL``, prefix ``PREFIX``). Each handler call appends a line to the file
``EFFECTS``. Run as ``python asgi_process_app.py``; stops when its stdin closes."""

from __future__ import annotations

import asyncio
import os
import socket
import sys
import threading

import oncely
import uvicorn
from oncely.asgi import IdempotencyMiddleware
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route


async def create(request: Request) -> JSONResponse:
    await request.body()
    with open(os.environ["EFFECTS"], "a", encoding="utf-8") as f:
        f.write(f"{os.getpid()}\n")
    await asyncio.sleep(0.3)
    return JSONResponse({"pid": os.getpid()}, status_code=201)


def main() -> None:
    app = Starlette(routes=[Route("/orders", create, methods=["POST"])])
    store = oncely.RedisStore(os.environ["ONCELY_REDIS_URL"], prefix=os.environ["PREFIX"])
    app.add_middleware(IdempotencyMiddleware, store=store, tenant="acme")
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    # Listening before the port is printed: the test connects as soon as it reads it.
    sock.listen(2048)
    server = uvicorn.Server(uvicorn.Config(app, log_level="error", lifespan="off", http="h11"))
    print(sock.getsockname()[1], flush=True)

    def stop_on_eof() -> None:
        sys.stdin.read()
        server.should_exit = True

    threading.Thread(target=stop_on_eof, daemon=True).start()
    server.run(sockets=[sock])


if __name__ == "__main__":
    main()
