"""oncely (Python) against its peers, in one run: retry overhead against tenacity,
stamina and backoff (those that are installed), and the store against the usual
asyncio dict-of-futures single-flight. Prints absolute numbers and ratios.

    bindings-python/bench/run            # installs the peers into the venv, then this
    python bindings-python/bench/bench.py [--quick]

Wall-clock numbers on a shared 2-core machine drift by 10-20 %: compare the ratios.
"""

from __future__ import annotations

import asyncio
import gc
import os
import subprocess
import sys
import time
from typing import Any, Awaitable, Callable, Optional

import oncely

QUICK = "--quick" in sys.argv
N = 20_000 if QUICK else 200_000
KEYS = 100_000 if QUICK else 1_000_000
rows: list[tuple[str, str, float, str]] = []


def report(group: str, name: str, value: float, unit: str) -> None:
    rows.append((group, name, value, unit))
    print(f"{group:<28} {name:<22} {value:>10.2f} {unit}", flush=True)


def per_call(fn: Callable[[], Awaitable[None]], n: int) -> float:
    """Seconds per call of `n` sequential awaits of fn(), best of 3."""

    async def run() -> float:
        t0 = time.perf_counter()
        for _ in range(n):
            await fn()
        return time.perf_counter() - t0

    best = min(asyncio.run(run()) for _ in range(3))
    return best / n


# --- retry ---------------------------------------------------------------------------


async def ok() -> int:
    return 1


class FailTwice:
    def __init__(self) -> None:
        self.n = 0

    async def __call__(self) -> int:
        self.n += 1
        if self.n % 3:
            raise ConnectionError("reset")
        return 1


def retry_peers() -> dict[
    str, Callable[[Callable[[], Awaitable[int]]], Callable[[], Awaitable[int]]]
]:
    peers: dict[str, Any] = {}
    zero = oncely.RetryPolicy(base_delay=0.0, max_delay=0.0)

    def oncely_wrap(fn: Callable[[], Awaitable[int]]) -> Callable[[], Awaitable[int]]:
        return lambda: oncely.retry(fn, policy=zero, safe=True)

    peers["oncely"] = oncely_wrap
    try:
        import tenacity

        def tenacity_wrap(fn: Callable[[], Awaitable[int]]) -> Callable[[], Awaitable[int]]:
            return tenacity.retry(
                stop=tenacity.stop_after_attempt(3),
                wait=tenacity.wait_none(),
                retry=tenacity.retry_if_exception_type(ConnectionError),
            )(fn)

        peers["tenacity"] = tenacity_wrap
    except ImportError:
        pass
    try:
        import stamina
        import stamina.instrumentation

        stamina.instrumentation.set_on_retry_hooks([])  # no log line per retry

        def stamina_wrap(fn: Callable[[], Awaitable[int]]) -> Callable[[], Awaitable[int]]:
            return stamina.retry(
                on=ConnectionError, attempts=3, wait_initial=0.0, wait_max=0.0, wait_jitter=0.0
            )(fn)

        peers["stamina"] = stamina_wrap
    except ImportError:
        pass
    try:
        import backoff

        def backoff_wrap(fn: Callable[[], Awaitable[int]]) -> Callable[[], Awaitable[int]]:
            return backoff.on_exception(
                backoff.constant, ConnectionError, max_tries=3, interval=0, jitter=None
            )(fn)

        peers["backoff"] = backoff_wrap
    except ImportError:
        pass
    return peers


def bench_retry() -> None:
    direct = per_call(ok, N)
    report("retry: success path", "direct await", direct * 1e9, "ns")
    for name, wrap in retry_peers().items():
        t = per_call(wrap(ok), N)
        report("retry: success overhead", name, (t - direct) * 1e6, "us net")
    for name, wrap in retry_peers().items():
        f = FailTwice()

        async def attempt(f: FailTwice = f) -> int:  # a plain coroutine function
            return await f()

        t = per_call(wrap(attempt), N // 10)
        report("retry: fail-fail-succeed", name, t * 1e6, "us")


# --- single flight -------------------------------------------------------------------


class HandWritten:
    """The usual pattern: a dict of in-flight futures and a dict of results."""

    def __init__(self) -> None:
        self.inflight: dict[str, asyncio.Future[Any]] = {}
        self.done: dict[str, Any] = {}

    async def execute(self, key: str, fn: Callable[[], Awaitable[Any]]) -> Any:
        if key in self.done:
            return self.done[key]
        fut = self.inflight.get(key)
        if fut is not None:
            return await fut
        fut = asyncio.get_running_loop().create_future()
        self.inflight[key] = fut
        try:
            value = await fn()
        except BaseException as e:
            del self.inflight[key]
            fut.set_exception(e)
            fut.exception()
            raise
        del self.inflight[key]
        self.done[key] = value
        fut.set_result(value)
        return value


async def slow() -> int:
    await asyncio.sleep(0.001)
    return 1


def rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def bench_store() -> None:
    store = oncely.IdempotencyStore()
    hw = HandWritten()
    k = oncely.scope("t", "m", oncely.new_key())
    asyncio.run(store.execute(k, "fp", ok))
    asyncio.run(hw.execute("k", ok))
    t_on = per_call(lambda: store.execute(k, "fp", ok), N)
    t_hw = per_call(lambda: hw.execute("k", ok), N)
    report("store: hot replay", "oncely", t_on * 1e9, "ns")
    report("store: hot replay", "hand-written", t_hw * 1e9, "ns")

    async def waiters(execute: Callable[[], Awaitable[Any]]) -> float:
        t0 = time.perf_counter()
        await asyncio.gather(*(execute() for _ in range(10_000)))
        return (time.perf_counter() - t0) / 10_000

    def on_fresh_key() -> Callable[[], Awaitable[Any]]:
        key = oncely.scope("t", "m", oncely.new_key())
        return lambda: store.execute(key, "fp", slow)

    def hw_fresh_key() -> Callable[[], Awaitable[Any]]:
        key = oncely.new_key()
        return lambda: hw.execute(key, slow)

    for name, make in [("oncely", on_fresh_key), ("hand-written", hw_fresh_key)]:
        best = min(asyncio.run(waiters(make())) for _ in range(3))
        report("store: 10,000 waiters", name, best * 1e6, "us/waiter")

    for name in ("oncely", "hand-written"):
        # Each in a fresh process, so that neither reuses memory the other freed.
        out = subprocess.run(
            [sys.executable, __file__, "--keys", name] + (["--quick"] if QUICK else []),
            check=True,
            capture_output=True,
            text=True,
        ).stdout.split()
        report(f"store: {KEYS:,} keys", name, float(out[0]), "us/key")
        report(f"store: {KEYS:,} keys", name, float(out[1]), "B/key")


def many_keys(name: str) -> tuple[float, float]:
    """Inserts KEYS keys: seconds and bytes (RSS growth) per key, keys made beforehand."""
    if name == "oncely":
        store = oncely.IdempotencyStore()
        keys: list[Any] = [oncely.scope("t", "m", f"key-{i:010d}") for i in range(KEYS)]

        def execute(key: Any) -> Awaitable[Any]:
            return store.execute(key, "fp", ok)
    else:
        hw = HandWritten()
        keys = [f"v1:t:m:key-{i:010d}" for i in range(KEYS)]

        def execute(key: Any) -> Awaitable[Any]:
            return hw.execute(key, ok)

    gc.collect()
    before = rss()

    async def run() -> float:
        t0 = time.perf_counter()
        for key in keys:
            await execute(key)
        return time.perf_counter() - t0

    t = asyncio.run(run())
    return t / KEYS * 1e6, (rss() - before) / KEYS


def ratios() -> None:
    print("\nratios (oncely / peer; < 1 means oncely is faster or smaller)")
    by: dict[tuple[str, str], dict[str, float]] = {}
    for group, name, value, unit in rows:
        by.setdefault((group, unit), {})[name] = value
    for (group, unit), values in by.items():
        mine: Optional[float] = values.get("oncely")
        if mine is None:
            continue
        for peer, v in values.items():
            if peer != "oncely" and v > 0:
                print(f"  {group:<28} vs {peer:<14} {mine / v:6.2f}  ({unit})")


if __name__ == "__main__":
    if "--keys" in sys.argv:
        t, b = many_keys(sys.argv[sys.argv.index("--keys") + 1])
        print(t, b)
        sys.exit(0)
    print(f"oncely {oncely.__version__}, Python {sys.version.split()[0]}, N={N:,}\n")
    bench_retry()
    bench_store()
    ratios()
