"""The ASGI middleware's cost and behaviour against the peers a user would pick, in one
run, on the same Starlette app (POST /orders reads its JSON body and answers 201):

- overhead per request, in process (the ASGI app called directly, no network): the bare
  app, then each middleware on a first call (a new key every request) and on a replay
  (the same key again), minus the bare app;
- 200 concurrent requests with one key against a handler that takes 50 ms: how many
  times the handler ran, how many answers were replays, how many distinct answers.

    bindings-python/bench/run-adapters     # installs the peers, then this
    python bindings-python/bench/adapters.py [--quick]

Peers (those installed): asgi-idempotency-header (IdempotencyHeaderMiddleware,
MemoryBackend) and fastapi-idempotency (IdempotencyMiddleware, its in-memory store).
Wall-clock numbers on a shared machine drift: compare the columns of one run.
"""

from __future__ import annotations

import asyncio
import gc
import json
import sys
import time
import uuid
from typing import Any, Callable, Optional

import oncely
from oncely.asgi import IdempotencyMiddleware
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

QUICK = "--quick" in sys.argv
N = 2_000 if QUICK else 20_000
BODY = b'{"sku":"A1","qty":1}'


def make_app(delay: float, counter: list[int]) -> Starlette:
    async def create(request: Request) -> JSONResponse:
        order = await request.json()
        counter[0] += 1
        if delay:
            await asyncio.sleep(delay)
        return JSONResponse({"id": counter[0], **order}, status_code=201)

    return Starlette(routes=[Route("/orders", create, methods=["POST"])])


def variants() -> dict[str, Callable[[Starlette], None]]:
    out: dict[str, Callable[[Starlette], None]] = {
        "none (bare app)": lambda app: None,
        "oncely.asgi": lambda app: app.add_middleware(
            IdempotencyMiddleware, store=oncely.IdempotencyStore()
        ),
    }
    try:
        from idempotency_header_middleware import IdempotencyHeaderMiddleware
        from idempotency_header_middleware.backends.memory import MemoryBackend

        out["asgi-idempotency-header"] = lambda app: app.add_middleware(
            IdempotencyHeaderMiddleware, backend=MemoryBackend()
        )
    except ImportError:
        pass
    try:
        from fastapi_idempotency import IdempotencyMiddleware as FastapiIdempotency

        out["fastapi-idempotency"] = lambda app: app.add_middleware(FastapiIdempotency)
    except ImportError:
        pass
    return out


async def request(app: Any, key: Optional[str]) -> tuple[int, dict[str, str], bytes]:
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(BODY)).encode())]
    if key is not None:
        headers.append((b"idempotency-key", key.encode()))
    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": "/orders",
        "raw_path": b"/orders",
        "query_string": b"",
        "root_path": "",
        "headers": headers,
        "client": ("127.0.0.1", 1),
        "server": ("127.0.0.1", 80),
    }
    sent = False
    status = 0
    out_headers: dict[str, str] = {}
    chunks: list[bytes] = []

    async def receive() -> dict[str, Any]:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": BODY, "more_body": False}
        await asyncio.sleep(3600)
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        nonlocal status
        if message["type"] == "http.response.start":
            status = message["status"]
            out_headers.update(
                {k.decode().lower(): v.decode() for k, v in message.get("headers", [])}
            )
        elif message["type"] == "http.response.body":
            chunks.append(message.get("body", b""))

    await app(scope, receive, send)
    return status, out_headers, b"".join(chunks)


async def per_request(app: Any, keys: Callable[[int], Optional[str]]) -> float:
    for i in range(200):  # warm up
        await request(app, keys(-1 - i))
    gc.collect()
    t = time.perf_counter()
    for i in range(N):
        await request(app, keys(i))
    return (time.perf_counter() - t) / N * 1e6


async def overhead(name: str, install: Callable[[Starlette], None]) -> tuple[float, float]:
    first_app = make_app(0, [0])
    install(first_app)
    prefix = uuid.uuid4().hex[:8]
    first = await per_request(first_app, lambda i: f"{prefix}-{i}")
    replay_app = make_app(0, [0])
    install(replay_app)
    key = f"{prefix}-replayed"
    replay = await per_request(replay_app, lambda i: key)
    return first, replay


async def concurrent(install: Callable[[Starlette], None]) -> tuple[int, int, int]:
    calls = [0]
    app = make_app(0.05, calls)
    install(app)
    key = str(uuid.uuid4())
    answers = await asyncio.gather(*(request(app, key) for _ in range(200)))
    replayed = sum(h.get("idempotent-replayed") == "true" for _, h, _ in answers)
    distinct = len({(s, b) for s, _, b in answers})
    return calls[0], replayed, distinct


async def main() -> None:
    found = variants()
    print(f"ASGI middleware, in process, {N} sequential requests per cell (µs per request)")
    bare_first, bare_replay = await overhead("bare", found["none (bare app)"])
    print(f"{'middleware':26} {'first call':>11} {'added':>8} {'replay':>9} {'added':>8}")
    for name, install in found.items():
        first, replay = (
            (bare_first, bare_replay) if name.startswith("none") else await overhead(name, install)
        )
        print(
            f"{name:26} {first:11.1f} {first - bare_first:8.1f} {replay:9.1f} {replay - bare_replay:8.1f}"
        )
    print()
    print("200 concurrent requests, one key, a 50 ms handler")
    print(f"{'middleware':26} {'handler calls':>14} {'replayed':>9} {'distinct answers':>17}")
    for name, install in found.items():
        if name.startswith("none"):
            continue
        calls, replayed, distinct = await concurrent(install)
        print(f"{name:26} {calls:14} {replayed:9} {distinct:17}")
    print(json.dumps({"n": N}))


if __name__ == "__main__":
    asyncio.run(main())
