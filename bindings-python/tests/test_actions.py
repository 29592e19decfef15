"""How both stores run the leader's action (SPEC §6, "Python: work that cannot be
cancelled"), under the rule that decides them all: a key goes to another leader only
when the action that holds it has finished (or its lease expired); an action never runs
again because of anything that happened after it ran; every waiter ends.

- the kind of callable: ``execute`` runs a plain function once; ``execute_sync``
  refuses an async function before anything runs;
- work that cannot be cancelled (``asyncio.to_thread`` in an action, ``execute_sync``
  in a thread): cancelled callers stop waiting at once, and there is never a second
  copy of the action running;
- re-entrant calls fail fast with ``ReentrantCallError``, without false positives;
- a failure whose exception cannot be read (raising ``code``, ``__str__``...) still
  reaches every waiter.

The Redis-backed cases read ONCELY_REDIS_URL and are skipped without it."""

from __future__ import annotations

import asyncio
import functools
import gc
import os
import random
import threading
import time
import warnings
from typing import Any, Callable, Iterator, Union

import oncely
import pytest
from oncely import IdempotencyStore, RedisStore, ReentrantCallError

URL = os.environ.get("ONCELY_REDIS_URL")
needs_redis = pytest.mark.skipif(not URL, reason="needs a Redis: run scripts/test-redis")

pytestmark = pytest.mark.timeout(120, method="thread")

FP = oncely.fingerprint({"op": "charge"})
Store = Union[IdempotencyStore, RedisStore]


def key() -> oncely.ScopedKey:
    return oncely.scope("acme", "Charge", oncely.new_key())


def redis_store(prefix: str, **kw: Any) -> RedisStore:
    assert URL
    return RedisStore(URL, prefix=prefix, **kw)


@pytest.fixture(params=["memory", pytest.param("redis", marks=needs_redis)])
def make_store(request: pytest.FixtureRequest) -> Iterator[Callable[[], Store]]:
    """Makes stores that share their keys: one memory store, or RedisStores on one
    prefix (each a separate instance, as separate processes would be)."""
    if request.param == "memory":
        shared = IdempotencyStore()
        yield lambda: shared
    else:
        prefix = "pytest-" + oncely.new_key()
        yield lambda: redis_store(prefix, lease=1.2, io_timeout=0.35)


class Copies:
    """Counts the running copies of an action (from any thread) and their maximum."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.now = 0
        self.max = 0
        self.calls = 0

    def work(self, seconds: float) -> dict[str, int]:
        with self.lock:
            self.calls += 1
            self.now += 1
            self.max = max(self.max, self.now)
            n = self.calls
        try:
            time.sleep(seconds)
        finally:
            with self.lock:
                self.now -= 1
        return {"run": n}


# ---------------------------------------------------------------------------------------
# The kind of callable
# ---------------------------------------------------------------------------------------


async def test_execute_runs_a_plain_function_once(make_store: Callable[[], Store]) -> None:
    store = make_store()
    k = key()
    charges = 0

    def charge() -> dict[str, int]:
        nonlocal charges
        charges += 1
        return {"charged": charges}

    first = await store.execute(k, FP, charge)
    again = await make_store().execute(k, FP, charge)
    assert charges == 1
    assert (first.value, first.source) == ({"charged": 1}, "led")
    assert (again.value, again.source) == ({"charged": 1}, "replayed")


async def test_execute_awaits_what_a_plain_function_returns(
    make_store: Callable[[], Store],
) -> None:
    store = make_store()
    k = key()
    runs = 0

    async def charge(amount: int) -> dict[str, int]:
        nonlocal runs
        runs += 1
        await asyncio.sleep(0)
        return {"amount": amount}

    first = await store.execute(k, FP, lambda: charge(5))
    second = await store.execute(k, FP, functools.partial(charge, 5))
    assert runs == 1 and first.value == second.value == {"amount": 5}


class AsyncCallable:
    def __init__(self) -> None:
        self.calls = 0

    async def __call__(self) -> str:
        self.calls += 1
        return "never"


async def _charge_async() -> str:
    return "never"


@pytest.mark.parametrize(
    "fn",
    [_charge_async, functools.partial(_charge_async), AsyncCallable()],
    ids=["async def", "partial", "async __call__"],
)
def test_execute_sync_refuses_an_async_function_before_it_runs(
    make_store: Callable[[], Store], fn: Callable[[], Any]
) -> None:
    store = make_store()
    k = key()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no coroutine is ever made ("never awaited")
        with pytest.raises(
            TypeError, match=r"execute_sync got an async function.*await \w+Store\.execute"
        ):
            store.execute_sync(k, FP, fn)
    if isinstance(fn, AsyncCallable):
        assert fn.calls == 0
    # Nothing was claimed: the key is free for the right method.
    assert store.execute_sync(k, FP, lambda: "sync").source == "led"


async def test_execute_sync_result_that_is_a_coroutine_is_its_result_not_a_rerun() -> None:
    store = IdempotencyStore()
    k = key()
    calls = 0

    def sneaky() -> Any:  # a plain function that returns a coroutine: it ran
        nonlocal calls
        calls += 1
        return _charge_async()

    with pytest.warns(RuntimeWarning, match="returned a coroutine"):
        first = store.execute_sync(k, FP, sneaky)
    again = store.execute_sync(k, FP, sneaky)
    assert calls == 1 and again.value is first.value and again.replayed
    assert await first.value == "never"


# ---------------------------------------------------------------------------------------
# Work that cannot be cancelled
# ---------------------------------------------------------------------------------------


async def _retry_until_done(
    store: Store, k: oncely.ScopedKey, fn: Callable[[], Any], rng: random.Random
) -> oncely.Executed[Any]:
    """A caller that gives up after a random short time and tries again with the key."""
    while True:
        try:
            return await asyncio.wait_for(store.execute(k, FP, fn), rng.uniform(0.001, 0.08))
        except asyncio.TimeoutError:
            await asyncio.sleep(rng.uniform(0, 0.01))


async def test_cancelled_callers_leave_to_thread_work_the_key(
    make_store: Callable[[], Store],
) -> None:
    rng = random.Random(8)
    copies = Copies()
    k = key()

    async def action() -> dict[str, int]:
        await asyncio.sleep(0)
        return await asyncio.to_thread(copies.work, 2.0)  # cannot be cancelled

    stores = [make_store() for _ in range(3)]
    callers = [
        asyncio.ensure_future(_retry_until_done(stores[i % 3], k, action, rng)) for i in range(30)
    ]
    # Others are cancelled at random points, at every await they may be in.
    for t in callers[::3]:
        await asyncio.sleep(rng.uniform(0, 0.05))
        t.cancel()
    done = await asyncio.wait_for(asyncio.gather(*callers, return_exceptions=True), 30)
    assert copies.max == 1 and copies.calls == 1
    values = [d.value for d in done if isinstance(d, oncely.Executed)]
    assert len(values) == 20 and all(v == {"run": 1} for v in values)
    assert sum(isinstance(d, asyncio.CancelledError) for d in done) == 10
    again = await stores[0].execute(k, FP, action)
    assert again.replayed and copies.calls == 1


async def test_many_keys_callers_cancelled_at_random_never_two_copies(
    make_store: Callable[[], Store],
) -> None:
    rng = random.Random(88)
    stores = [make_store() for _ in range(2)]
    keys = [key() for _ in range(8)]
    copies = {k.value: Copies() for k in keys}

    def action_for(k: oncely.ScopedKey) -> Callable[[], Any]:
        async def action() -> dict[str, int]:
            await asyncio.sleep(rng.uniform(0, 0.02))
            out = await asyncio.to_thread(copies[k.value].work, rng.uniform(0.05, 0.3))
            await asyncio.sleep(rng.uniform(0, 0.02))
            return out

        return action

    async def caller(i: int) -> Any:
        k = keys[i % len(keys)]
        while True:
            try:
                return await asyncio.wait_for(
                    stores[i % 2].execute(k, FP, action_for(k)), rng.uniform(0.001, 0.2)
                )
            except asyncio.TimeoutError:
                pass

    tasks = [asyncio.ensure_future(caller(i)) for i in range(200)]
    for t in rng.sample(tasks, 60):
        await asyncio.sleep(rng.uniform(0, 0.005))
        t.cancel()
    done = await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), 60)
    assert all(c.max == 1 and c.calls == 1 for c in copies.values())
    for d in done:
        assert isinstance(d, (oncely.Executed, asyncio.CancelledError)), d
        if isinstance(d, oncely.Executed):
            assert d.value == {"run": 1}


async def test_the_action_of_a_cancelled_caller_is_delivered_to_waiters() -> None:
    store = IdempotencyStore()
    k = key()
    gate = asyncio.Event()
    ran: list[str] = []

    async def leader_fn() -> str:
        ran.append("leader")
        await gate.wait()
        return "leader"

    async def waiter_fn() -> str:
        ran.append("waiter")
        return "waiter"

    leader = asyncio.ensure_future(store.execute(k, FP, leader_fn))
    await asyncio.sleep(0.01)
    waiters = [asyncio.ensure_future(store.execute(k, FP, waiter_fn)) for _ in range(5)]
    await asyncio.sleep(0.01)
    leader.cancel()
    with pytest.raises(asyncio.CancelledError):
        await asyncio.wait_for(leader, 5)  # the caller stops waiting at once
    assert not any(w.done() for w in waiters)
    gate.set()
    results = await asyncio.wait_for(asyncio.gather(*waiters), timeout=10)
    assert ran == ["leader"]
    assert all((r.value, r.source) == ("leader", "joined") for r in results)
    assert (await store.execute(k, FP, waiter_fn)).replayed


async def test_an_action_whose_own_task_is_cancelled_hands_the_key_on() -> None:
    store = IdempotencyStore()
    k = key()
    tasks: list[asyncio.Task[Any]] = []

    async def stoppable() -> str:
        tasks.append(asyncio.current_task())  # type: ignore[arg-type]
        await asyncio.sleep(60)
        return "never"

    async def quick() -> str:
        return "took over"

    leader = asyncio.ensure_future(store.execute(k, FP, stoppable))
    await asyncio.sleep(0.01)
    waiter = asyncio.ensure_future(store.execute(k, FP, quick))
    await asyncio.sleep(0.01)
    tasks[0].cancel()  # the action itself stops: the key may go on
    with pytest.raises(asyncio.CancelledError):
        await asyncio.wait_for(leader, 5)
    got = await asyncio.wait_for(waiter, 5)
    assert (got.value, got.source) == ("took over", "led")


async def test_execute_sync_in_threads_with_cancelled_callers(
    make_store: Callable[[], Store],
) -> None:
    rng = random.Random(2)
    copies = Copies()
    k = key()
    stores = [make_store() for _ in range(3)]

    async def caller(i: int) -> oncely.Executed[Any]:
        while True:
            call = asyncio.to_thread(stores[i % 3].execute_sync, k, FP, lambda: copies.work(2.0))
            try:
                return await asyncio.wait_for(call, rng.uniform(0.001, 0.08))
            except asyncio.TimeoutError:
                pass

    done = await asyncio.wait_for(asyncio.gather(*(caller(i) for i in range(12))), 30)
    assert copies.max == 1 and copies.calls == 1
    assert all(d.value == {"run": 1} for d in done)


# ---------------------------------------------------------------------------------------
# Re-entrancy
# ---------------------------------------------------------------------------------------


async def test_reentrant_execute_fails_fast(make_store: Callable[[], Store]) -> None:
    store = make_store()
    k = key()
    inner_runs = 0
    caught: list[BaseException] = []

    async def inner() -> str:
        nonlocal inner_runs
        inner_runs += 1
        return "inner"

    async def outer() -> str:
        t0 = time.perf_counter()
        try:
            await store.execute(k, FP, inner)
        except ReentrantCallError as e:
            caught.append(e)
        assert time.perf_counter() - t0 < 5  # a hang detector, not a speed claim
        try:  # also through a thread the action waits for
            await asyncio.to_thread(store.execute_sync, k, FP, lambda: "inner")
        except ReentrantCallError as e:
            caught.append(e)
        try:  # and through a task it awaits
            await asyncio.ensure_future(store.execute(k, FP, inner))
        except ReentrantCallError as e:
            caught.append(e)
        return "outer"

    out = await asyncio.wait_for(store.execute(k, FP, outer), 10)
    assert (out.value, out.source) == ("outer", "led") and inner_runs == 0
    assert len(caught) == 3
    for e in caught:
        assert e.key == k.value and e.code == oncely.Code.FAILED_PRECONDITION
        assert isinstance(e, oncely.OncelyError)


def test_reentrant_execute_sync_fails_fast(make_store: Callable[[], Store]) -> None:
    store = make_store()
    k = key()
    caught: list[BaseException] = []

    def outer() -> str:
        try:
            store.execute_sync(k, FP, lambda: "inner")
        except ReentrantCallError as e:
            caught.append(e)
        return "outer"

    result: list[oncely.Executed[str]] = []
    t = threading.Thread(
        target=lambda: result.append(store.execute_sync(k, FP, outer)), daemon=True
    )
    t.start()
    t.join(10)
    assert not t.is_alive(), "the re-entrant call waits for itself"
    assert result[0].value == "outer" and len(caught) == 1 and caught[0].key == k.value


async def test_no_false_reentrancy(make_store: Callable[[], Store]) -> None:
    store = make_store()
    k, other = key(), key()
    gate = asyncio.Event()
    spawned: list[asyncio.Task[Any]] = []

    async def late_caller() -> oncely.Executed[Any]:
        await gate.wait()  # runs on after the action that started it has finished
        return await store.execute(k, FP, lambda: "again")

    async def outer() -> str:
        nested = await store.execute(other, FP, lambda: "nested")  # another key
        elsewhere = await IdempotencyStore().execute(k, FP, lambda: "elsewhere")  # another store
        assert (nested.source, elsewhere.source) == ("led", "led")
        spawned.append(asyncio.ensure_future(late_caller()))
        await asyncio.sleep(0.05)
        return "outer"

    async def concurrent() -> str:
        raise AssertionError("a concurrent caller joins, it does not run")

    leader = asyncio.ensure_future(store.execute(k, FP, outer))
    await asyncio.sleep(0.01)
    joined = await asyncio.wait_for(store.execute(k, FP, concurrent), 10)  # a concurrent task
    assert (joined.value, (await leader).value) == ("outer", "outer")
    gate.set()
    late = await asyncio.wait_for(spawned[0], 10)
    assert (late.value, late.source) == ("outer", "replayed")


# ---------------------------------------------------------------------------------------
# Failures whose exception cannot be read
# ---------------------------------------------------------------------------------------


def _raise(*_: Any) -> Any:
    raise RuntimeError("do not read me")


class Unreadable(Exception):
    """An exception whose every attribute a classifier may look at raises."""

    code = property(_raise)
    status = property(_raise)
    status_code = property(_raise)
    response = property(_raise)
    headers = property(_raise)
    __str__ = _raise
    __repr__ = _raise

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):  # (what traceback printing looks for)
            raise AttributeError(name)
        raise RuntimeError(f"do not read {name}")


def test_failure_of_an_unreadable_exception_is_unknown() -> None:
    assert oncely.failure_of(Unreadable()) == int(oncely.Code.UNKNOWN)
    assert oncely.code_of(Unreadable()) is oncely.Code.UNKNOWN


@pytest.mark.parametrize("cache", [False, True], ids=["plain", "cache_permanent_failures"])
async def test_an_unreadable_failure_reaches_every_waiter(cache: bool) -> None:
    store = IdempotencyStore(cache_permanent_failures=cache)
    await _unreadable_failure_reaches_every_waiter([store] * 3, cached=cache)


@needs_redis
async def test_an_unreadable_failure_reaches_every_waiter_redis() -> None:
    prefix = "pytest-" + oncely.new_key()
    await _unreadable_failure_reaches_every_waiter([redis_store(prefix) for _ in range(3)])


async def _unreadable_failure_reaches_every_waiter(stores: list[Any], cached: bool = False) -> None:
    k = key()
    boom = Unreadable()
    calls = 0

    async def fail() -> str:
        nonlocal calls
        calls += 1
        await asyncio.sleep(0.05)
        raise boom

    async def ok() -> str:
        return "ok"

    outcomes = await asyncio.wait_for(
        asyncio.gather(
            *(stores[i % 3].execute(k, FP, fail) for i in range(30)), return_exceptions=True
        ),
        10,
    )
    # In one process all get the leader's exception; another store instance may run its
    # own action after the failure (it was not stored) and fail the same way.
    assert all(o is boom for o in outcomes) and 1 <= calls <= 3
    if cached:  # a code that cannot be read is UNKNOWN, a permanent failure
        with pytest.raises(Unreadable) as info:
            await asyncio.wait_for(stores[0].execute(k, FP, ok), 10)
        assert info.value is boom
    else:
        assert (await asyncio.wait_for(stores[0].execute(k, FP, ok), 10)).value == "ok"


class NoTraceback(Exception):
    __traceback__ = property(_raise, lambda self, tb: None)  # type: ignore[assignment]


@pytest.mark.parametrize("store_kind", ["memory", pytest.param("redis", marks=needs_redis)])
async def test_a_failure_whose_traceback_cannot_be_read_reaches_every_waiter(
    store_kind: str,
) -> None:
    s: Store = (
        IdempotencyStore() if store_kind == "memory" else redis_store("pytest-" + oncely.new_key())
    )
    k = key()
    boom = NoTraceback()

    async def fail() -> str:
        await asyncio.sleep(0.05)
        raise boom

    outcomes = await asyncio.wait_for(
        asyncio.gather(*(s.execute(k, FP, fail) for _ in range(20)), return_exceptions=True), 10
    )
    same = [o is boom for o in outcomes]
    assert all(same), same
    again = await asyncio.wait_for(s.execute(k, FP, lambda: "ok"), 10)
    assert again.source == "led"


def test_an_unreadable_failure_reaches_sync_waiters() -> None:
    store = IdempotencyStore(cache_permanent_failures=True)
    k = key()
    boom = Unreadable()
    started = threading.Event()

    def fail() -> None:
        started.set()
        time.sleep(0.05)
        raise boom

    errors: list[BaseException] = []

    def call() -> None:
        try:
            store.execute_sync(k, FP, fail)
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=call, daemon=True) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
        assert not t.is_alive(), "a waiter hangs"
    assert len(errors) == 8 and all(e is boom for e in errors)
    assert len(store) == 1  # cached under UNKNOWN, as any exception without a code


async def test_retry_gives_up_on_an_unreadable_exception_unchanged() -> None:
    boom = Unreadable()
    calls = 0

    async def fail() -> None:
        nonlocal calls
        calls += 1
        raise boom

    with pytest.raises(Unreadable) as info:
        await oncely.retry(fail)
    assert info.value is boom and calls == 1


# ---------------------------------------------------------------------------------------
# An event loop closed while an action runs
# ---------------------------------------------------------------------------------------


def _lead_when_free(
    store: Store, k: oncely.ScopedKey, fn: Callable[[], str]
) -> oncely.Executed[str]:
    """``execute_sync(wait=False)`` until the key is free (bounded: a held key fails)."""
    deadline = time.monotonic() + 5.0
    while True:
        try:
            return store.execute_sync(k, FP, fn, wait=False)
        except oncely.InProgressError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.02)


@pytest.mark.parametrize("store_kind", ["memory", pytest.param("redis", marks=needs_redis)])
def test_an_action_left_on_a_closed_loop_hands_the_key_on(store_kind: str) -> None:
    """A loop closed (and dropped) with the action's task still pending can never run
    that action again: the action has stopped, so its key goes on."""
    store: Store = (
        IdempotencyStore()
        if store_kind == "memory"
        else redis_store("pytest-" + oncely.new_key(), lease=1.2, io_timeout=0.35)
    )
    k = key()
    started = threading.Event()

    async def stuck() -> str:
        started.set()
        await asyncio.sleep(3600)
        return "never"

    async def caller() -> None:
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(store.execute(k, FP, stuck), 0.2)

    loop = asyncio.new_event_loop()
    loop.run_until_complete(caller())
    assert started.is_set()
    loop.close()  # the action's task is left pending on it
    del loop
    gc.collect()
    got = _lead_when_free(store, k, lambda: "ran")
    assert (got.value, got.source) == ("ran", "led")


@pytest.mark.parametrize("exc", [SystemExit, KeyboardInterrupt])
def test_an_action_that_exits_after_its_caller_left_still_stops_the_loop(
    exc: type[BaseException],
) -> None:
    store = IdempotencyStore()
    k = key()

    async def main() -> str:
        gate = asyncio.Event()

        async def action() -> str:
            await gate.wait()
            raise exc()

        caller = asyncio.ensure_future(store.execute(k, FP, action))
        await asyncio.sleep(0.01)
        caller.cancel()
        gate.set()
        await asyncio.sleep(2)  # the exit ends the loop before this
        return "the exit was swallowed"

    with pytest.raises(exc):
        asyncio.run(main())
    # The action stopped: its key goes on.
    got = store.execute_sync(k, FP, lambda: "ran", wait=False)
    assert (got.value, got.source) == ("ran", "led")


# ---------------------------------------------------------------------------------------
# What happens after the action ran never runs it again
# ---------------------------------------------------------------------------------------


def test_execute_sync_coroutine_warning_raised_as_error_does_not_rerun(
    make_store: Callable[[], Store],
) -> None:
    """Under ``-W error`` the warning about a returned coroutine is an exception; it
    comes after the action ran, so the key keeps that result."""
    store = make_store()
    k = key()
    made: list[Any] = []

    def sneaky() -> Any:
        made.append(_charge_async())
        return made[-1]

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", RuntimeWarning)
            with pytest.raises(RuntimeWarning, match="returned a coroutine"):
                store.execute_sync(k, FP, sneaky)
        try:
            again = store.execute_sync(k, FP, sneaky)
        except oncely.ResultNotStoredError:
            pass  # Redis: a coroutine is not storable; it still is not run again
        else:
            assert again.replayed and again.value is made[0]
        assert len(made) == 1
    finally:
        for c in made:
            c.close()


class _InterruptedDumps:
    """A ``dumps`` hit by Ctrl-C once: after the action ran, while its result is encoded."""

    def __init__(self) -> None:
        self.hit = False

    def __call__(self, value: Any) -> bytes:
        if not self.hit:
            self.hit = True
            raise KeyboardInterrupt
        return repr(value).encode()


@needs_redis
def test_redis_execute_sync_interrupted_while_encoding_does_not_rerun() -> None:
    prefix = "pytest-" + oncely.new_key()
    store = redis_store(prefix, lease=1.2, io_timeout=0.35, dumps=_InterruptedDumps(), loads=bytes)
    k = key()
    calls = 0

    def action() -> str:
        nonlocal calls
        calls += 1
        return "charged"

    with pytest.raises(KeyboardInterrupt):
        store.execute_sync(k, FP, action)
    other = redis_store(prefix, lease=1.2, io_timeout=0.35, dumps=repr, loads=str)
    with pytest.raises(oncely.ResultNotStoredError):
        other.execute_sync(k, FP, action)
    assert calls == 1


@needs_redis
async def test_redis_execute_interrupted_while_encoding_does_not_rerun() -> None:
    prefix = "pytest-" + oncely.new_key()
    store = redis_store(prefix, lease=1.2, io_timeout=0.35, dumps=_InterruptedDumps(), loads=bytes)
    k = key()
    calls = 0

    async def action() -> str:
        nonlocal calls
        calls += 1
        return "charged"

    with pytest.raises(KeyboardInterrupt):
        await store.execute(k, FP, action)
    other = redis_store(prefix, lease=1.2, io_timeout=0.35, dumps=repr, loads=str)
    with pytest.raises(oncely.ResultNotStoredError):
        await asyncio.wait_for(other.execute(k, FP, action), 10)
    assert calls == 1
