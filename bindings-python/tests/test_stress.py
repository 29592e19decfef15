"""Concurrency under load, with hard timeouts: hanging means a deadlock.

- thousands of asyncio waiters released by a leader on another thread (the wake comes
  from a thread that does not hold the GIL while the loop thread polls);
- one store used from many threads, each with its own event loop, plus blocking
  callers, on shared keys;
- waiters cancelled while leaders complete from other threads.
"""

from __future__ import annotations

import asyncio
import faulthandler
import random
import sys
import threading
import time
from collections.abc import Iterator

import oncely
import pytest
from oncely import IdempotencyStore

pytestmark = pytest.mark.timeout(120, method="thread")

FP = "fp"


@pytest.fixture(autouse=True)
def dump_stacks_if_hung() -> Iterator[None]:
    faulthandler.dump_traceback_later(100, exit=True, file=sys.stderr)
    yield
    faulthandler.cancel_dump_traceback_later()


def test_thousands_of_asyncio_waiters_released_from_other_threads() -> None:
    store = IdempotencyStore()
    rounds, waiters = 20, 5_000
    for _ in range(rounds):
        k = oncely.scope("t", "m", oncely.new_key())
        release = threading.Event()
        led = threading.Event()
        result = object()

        def leader() -> None:
            def work() -> object:
                led.set()
                assert release.wait(30)
                return result

            store.execute_sync(k, FP, work)

        t = threading.Thread(target=leader)
        t.start()
        assert led.wait(30)

        async def wait_all() -> list[oncely.Executed[object]]:
            async def never() -> object:
                raise AssertionError("a waiter ran while the leader was alive")

            tasks = [asyncio.ensure_future(store.execute(k, FP, never)) for _ in range(waiters)]
            await asyncio.sleep(0)  # every waiter has subscribed
            # Release from another thread while this loop is busy polling.
            threading.Timer(0.001, release.set).start()
            for _ in range(50):
                await asyncio.sleep(0)
            return await asyncio.wait_for(asyncio.gather(*tasks), timeout=60)

        results = asyncio.run(wait_all())
        t.join(30)
        assert not t.is_alive()
        assert len(results) == waiters and all(r.value is result for r in results)


def test_one_store_many_threads_each_with_its_own_loop() -> None:
    store = IdempotencyStore()
    keys = [oncely.scope("t", "m", oncely.new_key()) for _ in range(50)]
    calls = {str(k): 0 for k in keys}
    calls_lock = threading.Lock()
    errors: list[BaseException] = []
    values: dict[str, set[int]] = {str(k): set() for k in keys}

    def count(k: oncely.ScopedKey) -> object:
        with calls_lock:
            calls[str(k)] += 1
        return ("value", str(k))

    def loop_thread(seed: int) -> None:
        rng = random.Random(seed)

        async def one(k: oncely.ScopedKey) -> None:
            async def work() -> object:
                await asyncio.sleep(rng.random() * 0.002)
                return count(k)

            r = await store.execute(k, FP, work)
            values[str(k)].add(id(r.value))

        async def main() -> None:
            await asyncio.gather(*(one(rng.choice(keys)) for _ in range(2_000)))

        try:
            asyncio.run(main())
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    def blocking_thread(seed: int) -> None:
        rng = random.Random(seed)
        try:
            for _ in range(300):
                k = rng.choice(keys)

                def work(k: oncely.ScopedKey = k) -> object:
                    time.sleep(rng.random() * 0.001)
                    return count(k)

                r = store.execute_sync(k, FP, work)
                values[str(k)].add(id(r.value))
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=loop_thread, args=(i,)) for i in range(4)]
    threads += [threading.Thread(target=blocking_thread, args=(100 + i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(100)
        assert not t.is_alive(), "deadlock: a thread did not finish"
    assert not errors, errors
    # Within the TTL each key ran once, and everybody got that one object.
    assert all(n == 1 for n in calls.values()), calls
    assert all(len(ids) == 1 for ids in values.values())


def test_waiters_cancelled_while_leaders_settle_from_other_threads() -> None:
    store = IdempotencyStore()

    async def main() -> None:
        for _ in range(30):
            k = oncely.scope("t", "m", oncely.new_key())
            release = threading.Event()
            lead_started = threading.Event()

            def work() -> str:
                lead_started.set()
                release.wait(30)
                return "v"

            leader = threading.Thread(target=lambda: store.execute_sync(k, FP, work))
            leader.start()
            assert lead_started.wait(30)

            async def never() -> str:
                raise AssertionError("leader alive")

            tasks = [asyncio.ensure_future(store.execute(k, FP, never)) for _ in range(500)]
            await asyncio.sleep(0)
            release.set()
            for t in tasks[::2]:
                t.cancel()
            done = await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), 60)
            for i, d in enumerate(done):
                if not isinstance(d, asyncio.CancelledError):
                    assert isinstance(d, oncely.Executed) and d.value == "v", (i, d)
            leader.join(30)

    asyncio.run(main())


def test_takeover_chain_under_cancellation() -> None:
    """Actions are cancelled one after another (each stops, so its key may go on);
    every time one waiter takes over, and in the end every surviving caller has the
    same value."""
    store = IdempotencyStore()
    k = oncely.scope("t", "m", oncely.new_key())

    async def main() -> None:
        gate = asyncio.Event()
        started: list[asyncio.Task[object]] = []

        def make(i: int):  # type: ignore[no-untyped-def]
            async def work() -> int:
                started.append(asyncio.current_task())  # type: ignore[arg-type]
                await gate.wait()
                return i

            return work

        tasks = [asyncio.ensure_future(store.execute(k, FP, make(i))) for i in range(200)]
        await asyncio.sleep(0.01)
        for n in range(20):
            assert len(started) == n + 1
            started[-1].cancel()
            await asyncio.sleep(0.005)
        gate.set()
        out = await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), 30)
        values = {o.value for o in out if isinstance(o, oncely.Executed)}
        assert len(values) == 1
        assert sum(isinstance(o, asyncio.CancelledError) for o in out) == 20

    asyncio.run(main())
