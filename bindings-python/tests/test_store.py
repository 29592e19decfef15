"""SPEC §6 through the Python store: every rule, cancellation and takeover, TTL on the
core's manual clock, failures, counters."""

from __future__ import annotations

import _thread
import asyncio
import gc
import signal
import threading
from typing import Any

import oncely
import pytest
from oncely import IdempotencyStore, ManualClock


def key() -> oncely.ScopedKey:
    return oncely.scope("acme", "CreateOrder", oncely.new_key())


FP = oncely.fingerprint({"sku": "A1", "qty": 1})
OTHER_FP = oncely.fingerprint({"sku": "A1", "qty": 2})


class Counter:
    def __init__(self) -> None:
        self.calls = 0

    async def slow(self, value: Any = None, delay: float = 0.01) -> Any:
        self.calls += 1
        await asyncio.sleep(delay)
        return value if value is not None else {"order": self.calls}


async def test_10000_concurrent_executes_on_one_key_run_once() -> None:
    store = IdempotencyStore()
    c = Counter()
    k = key()
    results = await asyncio.wait_for(
        asyncio.gather(*(store.execute(k, FP, c.slow) for _ in range(10_000))), timeout=60
    )
    assert c.calls == 1
    first = results[0].value
    assert all(r.value is first for r in results)  # the very same object
    sources = [r.source for r in results]
    assert sources.count("led") == 1 and sources.count("joined") == 9_999
    counters = store.counters()
    assert (counters.leads, counters.joins) == (1, 9_999)


async def test_replay_returns_the_stored_object() -> None:
    store = IdempotencyStore()
    c = Counter()
    k = key()
    first = await store.execute(k, FP, c.slow)
    again = await store.execute(k, FP, c.slow)
    assert (first.source, first.replayed) == ("led", False)
    assert (again.source, again.replayed) == ("replayed", True)
    assert again.value is first.value and c.calls == 1
    assert store.counters().replays == 1
    sync_again = store.execute_sync(k, FP, lambda: "never")
    assert sync_again.value is first.value


async def test_fingerprint_mismatch_completed_and_in_flight() -> None:
    store = IdempotencyStore()
    c = Counter()
    k = key()
    await store.execute(k, FP, c.slow)
    with pytest.raises(oncely.FingerprintMismatchError) as info:
        await store.execute(k, OTHER_FP, c.slow)
    assert info.value.code == oncely.Code.FAILED_PRECONDITION
    k2 = key()
    running = asyncio.ensure_future(store.execute(k2, FP, lambda: c.slow(delay=0.05)))
    await asyncio.sleep(0.01)
    with pytest.raises(oncely.FingerprintMismatchError):
        await store.execute(k2, OTHER_FP, c.slow)
    await running
    assert store.counters().conflicts == 2


async def test_ttl_expiry_on_the_manual_clock() -> None:
    clock = ManualClock()
    store = IdempotencyStore(ttl=60.0, _clock=clock)
    c = Counter()
    k = key()
    await store.execute(k, FP, c.slow)
    clock.advance(59.999)
    assert (await store.execute(k, FP, c.slow)).replayed
    clock.advance(0.001)
    r = await store.execute(k, FP, c.slow)
    assert r.source == "led" and c.calls == 2
    assert store.counters().expirations == 1


async def test_failure_is_given_to_every_waiter_and_not_cached() -> None:
    store = IdempotencyStore()
    k = key()
    boom = ValueError("card declined")
    calls = 0

    async def fail() -> None:
        nonlocal calls
        calls += 1
        await asyncio.sleep(0.02)
        raise boom

    outcomes = await asyncio.gather(
        *(store.execute(k, FP, fail) for _ in range(100)), return_exceptions=True
    )
    assert calls == 1
    assert all(o is boom for o in outcomes)  # the user's own exception, unchanged
    assert len(store) == 0  # removed: not cached

    async def ok() -> str:
        return "second try"

    assert (await store.execute(k, FP, ok)).value == "second try"


async def test_waiter_traceback_does_not_grow() -> None:
    store = IdempotencyStore()
    k = key()

    async def fail() -> None:
        await asyncio.sleep(0.01)
        raise RuntimeError("x")

    outcomes = await asyncio.gather(
        *(store.execute(k, FP, fail) for _ in range(500)), return_exceptions=True
    )
    exc = outcomes[-1]
    assert isinstance(exc, RuntimeError)
    depth = 0
    tb = exc.__traceback__
    while tb is not None:
        depth += 1
        tb = tb.tb_next
    assert depth < 20


async def test_permanent_failures_cached_when_asked_and_cleared_by_hand() -> None:
    store = IdempotencyStore(cache_permanent_failures=True)
    k = key()
    calls = 0

    class Invalid(Exception):
        code = oncely.Code.INVALID_ARGUMENT

    async def invalid() -> None:
        nonlocal calls
        calls += 1
        raise Invalid("bad sku")

    with pytest.raises(Invalid) as first:
        await store.execute(k, FP, invalid)
    with pytest.raises(Invalid) as second:
        await store.execute(k, FP, invalid)
    assert second.value is first.value and calls == 1
    assert store.remove(k) is True
    with pytest.raises(Invalid):
        await store.execute(k, FP, invalid)
    assert calls == 2

    async def transient() -> None:
        raise ConnectionError("reset")  # UNAVAILABLE: never cached

    k2 = key()
    for _ in range(2):
        with pytest.raises(ConnectionError):
            await store.execute(k2, FP, transient)
    assert len(store) == 1  # only the cached INVALID_ARGUMENT entry


async def test_waiter_cancelled_others_unaffected() -> None:
    store = IdempotencyStore()
    k = key()
    gate = asyncio.Event()

    async def leader_fn() -> str:
        await gate.wait()
        return "done"

    leader = asyncio.ensure_future(store.execute(k, FP, leader_fn))
    await asyncio.sleep(0)
    waiters = [asyncio.ensure_future(store.execute(k, FP, leader_fn)) for _ in range(10)]
    await asyncio.sleep(0.01)
    for w in waiters[:5]:
        w.cancel()
    await asyncio.sleep(0.01)
    gate.set()
    assert (await leader).value == "done"
    for w in waiters[5:]:
        assert (await asyncio.wait_for(w, 10)).value == "done"
    for w in waiters[:5]:
        assert w.cancelled()


async def test_no_wait_gives_in_progress_with_retry_after() -> None:
    store = IdempotencyStore(in_progress_retry_after=0.5)
    k = key()
    c = Counter()
    running = asyncio.ensure_future(store.execute(k, FP, lambda: c.slow(delay=0.05)))
    await asyncio.sleep(0.01)
    with pytest.raises(oncely.InProgressError) as info:
        await store.execute(k, FP, c.slow, wait=False)
    assert info.value.code == oncely.Code.ABORTED and info.value.retry_after == 0.5
    await running
    assert (await store.execute(k, FP, c.slow, wait=False)).replayed


async def test_capacity_and_eviction() -> None:
    store = IdempotencyStore(max_entries=2)
    c = Counter()
    await store.execute(key(), FP, c.slow)
    await store.execute(key(), FP, c.slow)
    await store.execute(key(), FP, c.slow)  # evicts the oldest completed
    assert store.counters().evictions == 1 and len(store) == 2
    gate = asyncio.Event()

    async def hold() -> None:
        await gate.wait()

    running = [asyncio.ensure_future(store.execute(key(), FP, hold)) for _ in range(2)]
    await asyncio.sleep(0.01)
    with pytest.raises(oncely.CapacityError) as info:
        await store.execute(key(), FP, c.slow)
    assert info.value.code == oncely.Code.RESOURCE_EXHAUSTED and info.value.max_entries == 2
    gate.set()
    await asyncio.gather(*running)


async def test_leader_raising_base_exception_abandons() -> None:
    store = IdempotencyStore()
    k = key()

    async def interrupted() -> None:
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        await store.execute(k, FP, interrupted)
    assert len(store) == 0
    assert (await store.execute(k, FP, Counter().slow)).source == "led"


def test_execute_sync_threads_share_one_call() -> None:
    store = IdempotencyStore()
    k = key()
    calls = 0
    started = threading.Event()
    release = threading.Event()

    def work() -> object:
        nonlocal calls
        calls += 1
        started.set()
        assert release.wait(10)
        return object()

    results: list[oncely.Executed[object]] = []
    lock = threading.Lock()

    def call() -> None:
        r = store.execute_sync(k, FP, work)
        with lock:
            results.append(r)

    threads = [threading.Thread(target=call) for _ in range(32)]
    for t in threads:
        t.start()
    assert started.wait(10)
    release.set()
    for t in threads:
        t.join(30)
        assert not t.is_alive(), "a waiter hangs"
    assert calls == 1 and len(results) == 32
    assert len({id(r.value) for r in results}) == 1


def test_execute_sync_waiter_stops_at_ctrl_c_while_the_leader_runs_on() -> None:
    store = IdempotencyStore()
    k = key()
    started = threading.Event()
    release = threading.Event()
    leader_done = threading.Event()

    def work() -> str:
        started.set()
        release.wait(10)
        return "done"

    def lead() -> None:
        store.execute_sync(k, FP, work)
        leader_done.set()

    leader = threading.Thread(target=lead)
    leader.start()
    assert started.wait(10)
    # Ctrl-C while this (main) thread waits for the leader: the wait ends with it.
    # Python's own Ctrl-C handler, whatever the suite inherited: a suite started as a
    # background job has SIGINT ignored, and interrupt_main() then does nothing.
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    threading.Timer(0.1, _thread.interrupt_main).start()
    try:
        with pytest.raises(KeyboardInterrupt):
            store.execute_sync(k, FP, lambda: "not run")
        assert not leader_done.is_set(), "the waiter ignored Ctrl-C until its leader ended"
    finally:
        signal.signal(signal.SIGINT, previous)
        release.set()
        leader.join(30)
    assert store.execute_sync(k, FP, lambda: "not run").value == "done"


def test_execute_sync_leader_failure_reaches_waiters() -> None:
    store = IdempotencyStore()
    k = key()
    release = threading.Event()
    boom = OSError("disk full")

    def work() -> None:
        release.wait(10)
        raise boom

    errors: list[BaseException] = []

    def call() -> None:
        try:
            store.execute_sync(k, FP, work)
        except OSError as e:
            errors.append(e)

    threads = [threading.Thread(target=call) for _ in range(8)]
    for t in threads:
        t.start()
    threading.Timer(0.05, release.set).start()
    for t in threads:
        t.join(30)
    assert len(errors) == 8 and all(e is boom for e in errors)


def test_abandoned_lease_by_garbage_collection_lets_a_waiter_lead() -> None:
    store = IdempotencyStore()
    k = key()
    lease = store.begin(k, FP)
    assert lease.__class__.__name__ == "Lease"
    join = store.begin(k, FP)
    assert join.__class__.__name__ == "Join"
    del lease
    gc.collect()
    assert join.wait() is None  # abandoned: begin again
    assert store.begin(k, FP).__class__.__name__ == "Lease"


def test_settled_lease_cannot_settle_twice() -> None:
    store = IdempotencyStore()
    lease = store.begin(key(), FP)
    lease.complete(1)
    with pytest.raises(RuntimeError):
        lease.complete(2)


def test_counters_and_repr() -> None:
    store = IdempotencyStore()
    assert store.counters() == store.counters()
    assert "leads=0" in repr(store.counters())
    assert store.ttl == 86400.0
    assert oncely.DEFAULT_TTL == 86400.0


def test_scoped_key_is_required() -> None:
    store = IdempotencyStore()
    with pytest.raises(TypeError, match="oncely.scope"):
        store.execute_sync("v1:acme:CreateOrder:abcdefgh", FP, lambda: 1)  # type: ignore[arg-type]
