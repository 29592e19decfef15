"""An oncely fleet worker (Python): reads jobs as JSON lines on stdin, runs each through
one shared oncely.RedisStore, writes one JSON line per job on stdout.

    python worker.py NAME REDIS_URL PREFIX LEASE_S

The store is on REDIS_URL, or on the Redis Cluster whose node URLs (space-separated)
are in ONCELY_E2E_CLUSTER_URLS (cluster=True); the effect counters stay on REDIS_URL.

Job:    {"id", "key", "payload", "wait", "effect", "hold_ms"}
Action: INCR <effect> on Redis (raw RESP over a socket), then sleep hold_ms, then
        return {"key", "by": NAME, "n": <the INCR reply>}.
Reply:  {"id", "worker", "ok": true, "value", "source"} or
        {"id", "worker", "ok": false, "error": <class>, "code": <code>}.
"""
from __future__ import annotations

import asyncio
import json
import os
import sys
import threading
from urllib.parse import urlparse

import oncely

NAME, URL, PREFIX, LEASE = sys.argv[1], sys.argv[2], sys.argv[3], float(sys.argv[4])
CLUSTER_URLS = os.environ.get("ONCELY_E2E_CLUSTER_URLS", "").split()
_u = urlparse(URL)
HOST, PORT = _u.hostname or "127.0.0.1", _u.port or 6379


async def incr(counter: str) -> int:
    reader, writer = await asyncio.open_connection(HOST, PORT)
    try:
        c = counter.encode()
        writer.write(b"*2\r\n$4\r\nINCR\r\n$%d\r\n%s\r\n" % (len(c), c))
        await writer.drain()
        line = await reader.readline()
        if not line.startswith(b":"):
            raise RuntimeError(f"INCR {counter}: {line!r}")
        return int(line[1:])
    finally:
        writer.close()


def emit(obj: dict) -> None:
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


async def run_job(store: oncely.RedisStore, job: dict) -> None:
    async def action() -> dict:
        n = await incr(job["effect"])
        if job.get("hold_ms"):
            await asyncio.sleep(job["hold_ms"] / 1000)
        return {"key": job["key"], "by": NAME, "n": n}

    scoped = oncely.scope("e2e", "Fleet", job["key"])
    fp = oncely.fingerprint(job["payload"])
    try:
        done = await store.execute(scoped, fp, action, wait=job.get("wait", True))
        emit({"id": job["id"], "worker": NAME, "ok": True, "value": done.value,
              "source": str(done.source)})
    except Exception as exc:  # reported to the driver, which decides what is expected
        emit({"id": job["id"], "worker": NAME, "ok": False, "error": type(exc).__name__,
              "code": getattr(getattr(exc, "code", None), "name", ""), "message": str(exc)})


async def main() -> None:
    if CLUSTER_URLS:
        store = oncely.RedisStore(CLUSTER_URLS, lease=LEASE, prefix=PREFIX, cluster=True)
    else:
        store = oncely.RedisStore(URL, lease=LEASE, prefix=PREFIX)
    loop = asyncio.get_running_loop()
    eof = asyncio.Event()
    tasks: set[asyncio.Task] = set()

    def start(line: str) -> None:
        t = loop.create_task(run_job(store, json.loads(line)))
        tasks.add(t)
        t.add_done_callback(tasks.discard)

    def reader() -> None:
        for line in sys.stdin:
            if line.strip():
                loop.call_soon_threadsafe(start, line)
        loop.call_soon_threadsafe(eof.set)

    threading.Thread(target=reader, daemon=True).start()
    emit({"ready": NAME})
    await eof.wait()
    while tasks:
        await asyncio.gather(*list(tasks))


asyncio.run(main())
