"""The Python worker of the chaos soak (driven by soak.py; same protocol as the Rust
worker, soak/src/main.rs, and worker.js).

    python worker.py NAME REDIS_URL PREFIX LEASE_MS LEDGER_PATH

With ONCELY_SOAK_CLUSTER=1, REDIS_URL is a Redis Cluster's node URLs (space-separated);
ONCELY_SOAK_MIN_REPLICAS sets the store's min_replicas.

Job (one JSON line on stdin): {"id", "key", "payload", "kind": ok|none|big|flaky|perm,
"dur_ms", "size", "pfail", "cancel_ms", "deadline_ms"}. Each job is one caller:
``oncely.retry`` around ``RedisStore.execute``, cancelled after ``cancel_ms`` if set.
Reply: {"id", "w", "ok": true, "v": <summary>, "src"} | {"id", "w", "ok": false,
"code", "err"} | {"id", "w", "cancelled": true}. Every execution of the action appends
``start`` and ``end`` lines to the ledger. At the end of stdin: {"end", "counters",
"calls"}.
"""
from __future__ import annotations

import asyncio
import hashlib
import json
import os
import sys
import threading
import time
from typing import Any

import oncely

NAME, URL, PREFIX, LEASE_MS, LEDGER = sys.argv[1:6]
LEDGER_FD = os.open(LEDGER, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
EXECS = 0
CALLS = {"led": 0, "joined": 0, "replayed": 0}
# The checker's own test (scripts/soak --self-check): run every action without the
# store, as a service without oncely would; the soak must then fail.
BYPASS = os.environ.get("ONCELY_SOAK_BYPASS") == "1"


class Bypassed:
    """What the store would have given, for a call that went around it."""

    def __init__(self, value: Any) -> None:
        self.value, self.source = value, "led"


class Flaky(Exception):
    """A failure the caller retries (UNAVAILABLE)."""


class Permanent(Exception):
    """A failure the caller does not retry (INVALID_ARGUMENT)."""


class DeadlineExceeded(Exception):
    """The caller's deadline passed during an attempt (DEADLINE_EXCEEDED)."""


def classify(exc: BaseException) -> Any:
    if isinstance(exc, Flaky):
        return oncely.Code.UNAVAILABLE
    if isinstance(exc, Permanent):
        return oncely.Code.INVALID_ARGUMENT
    if isinstance(exc, DeadlineExceeded):
        return oncely.Code.DEADLINE_EXCEEDED
    return None


def emit(obj: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


def ledger(obj: dict[str, Any]) -> None:
    os.write(LEDGER_FD, (json.dumps(obj) + "\n").encode())


def coin(seed: str) -> float:
    return int.from_bytes(hashlib.sha256(seed.encode()).digest()[:8], "big") / 2**64


def summary(v: Any) -> str:
    if v is None:
        return "none"
    if isinstance(v, (bytes, bytearray)):
        v = bytes(v).decode("utf-8", "replace")
    if isinstance(v, str):
        return f"big:{v.split('|', 1)[0]}:{len(v)}"
    if isinstance(v, dict):
        return f"x:{v.get('x')}"
    return f"unexpected:{v!r}"


def make_action(job: dict[str, Any]) -> Any:
    async def action() -> Any:
        global EXECS
        key = job["key"]
        x = f"{NAME}-{EXECS}"
        EXECS += 1
        ledger({"ev": "start", "k": key, "w": NAME, "x": x, "t": time.time() * 1000})
        status = "cancel"
        try:
            if job.get("dur_ms"):
                await asyncio.sleep(job["dur_ms"] / 1000)
            kind = job.get("kind", "ok")
            if kind == "perm":
                status = "fail"
                raise Permanent(key)
            if kind == "flaky" and coin(x) < job.get("pfail", 0.5):
                status = "fail"
                raise Flaky(key)
            status = "ok"
            if kind == "none":
                return None
            if kind == "big":
                head = f"{x}|"
                return head + "z" * max(0, job.get("size", 1 << 20) - len(head))
            return {"k": key, "x": x}
        finally:
            ledger({"ev": "end", "k": key, "x": x, "st": status, "t": time.time() * 1000})

    return action


async def run_job(store: oncely.RedisStore, job: dict[str, Any]) -> None:
    scoped = oncely.scope("soak", "Soak", job["key"])
    fp = oncely.fingerprint(job["payload"])
    action = make_action(job)

    async def call(attempt: oncely.Attempt) -> Any:
        if BYPASS:
            return Bypassed(await action())
        # The time left is this attempt's timeout, as a client forwards it: a waiter
        # stops at the caller's deadline (a leader's action runs on in its own task).
        remaining = attempt.remaining if attempt.remaining is not None else 60.0
        try:
            return await asyncio.wait_for(store.execute(scoped, fp, action), max(remaining, 0.001))
        except TimeoutError:
            raise DeadlineExceeded(job["key"]) from None
        except oncely.OncelyError as exc:
            # Each failed attempt's store error, for a failure report (the checker skips it).
            ledger({"ev": "err", "k": job["key"], "x": "", "t": time.time() * 1000,
                    "err": f"{type(exc).__name__}: {exc}"})
            raise

    policy = oncely.RetryPolicy(max_attempts=1000, base_delay=0.05, max_delay=1.0)
    task = asyncio.ensure_future(
        oncely.retry(call, policy=policy, safe=True, classify=classify, pass_attempt=True,
                     deadline=job.get("deadline_ms", 20000) / 1000)
    )
    if job.get("cancel_ms") is not None:
        asyncio.get_running_loop().call_later(job["cancel_ms"] / 1000, task.cancel)
    try:
        done = await task
    except asyncio.CancelledError:
        emit({"id": job["id"], "w": NAME, "cancelled": True})
        return
    except Exception as exc:  # noqa: BLE001 - reported to the driver, which judges it
        code = classify(exc) or getattr(exc, "code", None)
        emit({"id": job["id"], "w": NAME, "ok": False,
              "code": getattr(code, "name", str(code)), "err": f"{type(exc).__name__}: {exc}"})
        return
    CALLS[done.source] += 1
    emit({"id": job["id"], "w": NAME, "ok": True, "v": summary(done.value), "src": done.source})


async def main() -> None:
    # ONCELY_SOAK_CLUSTER=1: URL is a Redis Cluster's node URLs, space-separated.
    cluster = os.environ.get("ONCELY_SOAK_CLUSTER") == "1"
    store = oncely.RedisStore(URL.split() if cluster else URL, lease=int(LEASE_MS) / 1000,
                              prefix=PREFIX, cluster=cluster,
                              min_replicas=int(os.environ.get("ONCELY_SOAK_MIN_REPLICAS") or 0))
    loop = asyncio.get_running_loop()
    eof = asyncio.Event()
    tasks: set[asyncio.Task[None]] = set()

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
    emit({"end": NAME, "counters": store.counters(), "calls": CALLS})


asyncio.run(main())
