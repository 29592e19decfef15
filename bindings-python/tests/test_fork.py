"""Stores made before ``fork()`` work in the child: ``os.fork``, ``multiprocessing``
with the fork start method, and the gunicorn ``--preload`` pattern (a store made at
import in the master, then forked workers).

A child that hangs is killed by its alarm (or its join timeout) and the test says so.
The RedisStore tests read ONCELY_REDIS_URL and are skipped without it: run them with
scripts/test-redis, which starts a throwaway redis-server."""

from __future__ import annotations

import asyncio
import json
import multiprocessing
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
import traceback
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import oncely
import pytest
from oncely import IdempotencyStore, RedisStore

URL = os.environ.get("ONCELY_REDIS_URL")
needs_redis = pytest.mark.skipif(not URL, reason="needs a Redis: run scripts/test-redis")
pytestmark = pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")

FP = oncely.fingerprint({"sku": "A1"})
ALARM = 20  # seconds a child may take before it counts as hung


def key() -> oncely.ScopedKey:
    return oncely.scope("acme", "CreateOrder", oncely.new_key())


def store(pfx: str) -> RedisStore:
    assert URL
    return RedisStore(URL, prefix=pfx, lease=0.5)


def fork(child: Callable[[], None]) -> int:
    """Forks; the child runs ``child`` under an alarm and exits 0 if it returned."""
    with warnings.catch_warnings():
        # Python 3.12+ warns that forking a process with threads may deadlock: the
        # stores are made to survive it, which is what is tested here.
        warnings.simplefilter("ignore", DeprecationWarning)
        pid = os.fork()
    if pid:
        return pid
    code = 1
    try:
        hang_alarm()
        child()
        code = 0
    except BaseException:
        traceback.print_exc()
    finally:
        os._exit(code)


def hang_alarm() -> None:
    """Kills this process in ALARM seconds (the default action: a handler, such as
    pytest-timeout's, would not run while a call blocks in native code)."""
    signal.signal(signal.SIGALRM, signal.SIG_DFL)
    signal.alarm(ALARM)


def wait_child(pid: int) -> None:
    _, status = os.waitpid(pid, 0)
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        assert sig != signal.SIGALRM, f"the child hung: killed by its {ALARM} s alarm"
        raise AssertionError(f"the child was killed by signal {sig}")
    assert os.WEXITSTATUS(status) == 0, "the child failed (its traceback is above)"


def warm_up(s: RedisStore, other: RedisStore) -> None:
    """Starts every thread the store has before the fork: workers and renewer (a
    lead), the listener and the pump (an asyncio wait on another instance's lead)."""
    assert s.execute_sync(key(), FP, lambda: "warm").value == "warm"
    k = key()
    go = threading.Event()

    def slow() -> str:
        go.wait(10)
        return "w"

    leads, waits = other.counters()["leads"], s.counters()["remote_waits"]
    leader = threading.Thread(target=other.execute_sync, args=(k, FP, slow))
    leader.start()
    try:
        deadline = time.monotonic() + 10
        while other.counters()["leads"] == leads:
            assert time.monotonic() < deadline
            time.sleep(0.005)

        async def wait() -> Any:
            waiter = asyncio.ensure_future(s.execute(k, FP, lambda: never()))
            while s.counters()["remote_waits"] == waits:
                await asyncio.sleep(0.005)
            go.set()
            return await waiter

        done = asyncio.run(wait())
        assert (done.value, done.source) == ("w", "joined")
    finally:
        go.set()
        leader.join()


async def never() -> str:
    raise AssertionError("this action must not run")


@needs_redis
def test_os_fork_child_leads_replays_and_waits_and_the_parent_keeps_working() -> None:
    pfx = "pytest-" + oncely.new_key()
    s, other = store(pfx), store(pfx)
    warm_up(s, other)
    ka, kb = key(), key()

    def child() -> None:
        assert s.execute_sync(ka, FP, lambda: "a").source == "led"
        assert s.execute_sync(ka, FP, lambda: "x").value == "a"

        async def main() -> None:
            async def b() -> str:
                return "b"

            assert (await s.execute(kb, FP, b)).source == "led"
            assert (await s.execute(kb, FP, never)).source == "replayed"

        asyncio.run(main())
        warm_up(s, other)  # waits on another instance from the child too

    wait_child(fork(child))
    assert s.execute_sync(ka, FP, lambda: "y").value == "a"
    assert s.execute_sync(kb, FP, lambda: "y").value == "b"
    assert s.execute_sync(key(), FP, lambda: "p").source == "led"
    warm_up(s, other)


@needs_redis
def test_os_fork_child_waits_for_the_parents_running_call_without_running_it() -> None:
    """A call that runs in a parent thread when the parent forks stays the parent's:
    the child's caller does not join its in-process flight (nothing would settle it
    in the child) but waits for it in Redis, and gets the parent's result."""
    pfx = "pytest-" + oncely.new_key()
    s, other = store(pfx), store(pfx)
    warm_up(s, other)
    k = key()
    started, go = threading.Event(), threading.Event()

    def slow() -> str:
        started.set()
        go.wait(30)
        return "parent"

    leader = threading.Thread(target=s.execute_sync, args=(k, FP, slow))
    leader.start()
    assert started.wait(10)
    ready_r, ready_w = os.pipe()

    def child() -> None:
        os.close(ready_r)
        os.write(ready_w, b"1")

        def must_not_run() -> str:
            raise AssertionError("the child ran the action the parent is running")

        assert s.execute_sync(k, FP, must_not_run).value == "parent"

    pid = fork(child)
    os.close(ready_w)
    try:
        assert os.read(ready_r, 1) == b"1"  # the child is about to call
        time.sleep(0.2)  # most likely waiting by now; either way it must get "parent"
    finally:
        go.set()
        leader.join()
        os.close(ready_r)
    wait_child(pid)
    assert s.execute_sync(k, FP, lambda: "again").value == "parent"


@needs_redis
def test_a_call_in_flight_at_fork_raises_unavailable_in_the_child() -> None:
    """A coroutine of the parent waits for another instance's leader when the parent
    forks (from inside its event loop). In the child it raises StoreUnavailableError
    (the answer would come to the parent's threads) without running its action; in
    the parent it gets the leader's result."""
    pfx = "pytest-" + oncely.new_key()
    s, other = store(pfx), store(pfx)
    warm_up(s, other)
    k = key()
    go = threading.Event()

    def slow() -> str:
        go.wait(30)
        return "w"

    leads = other.counters()["leads"]
    leader = threading.Thread(target=other.execute_sync, args=(k, FP, slow))
    leader.start()
    deadline = time.monotonic() + 10
    while other.counters()["leads"] == leads:
        assert time.monotonic() < deadline
        time.sleep(0.005)

    async def main() -> Any:
        waits = s.counters()["remote_waits"]
        waiter = asyncio.ensure_future(s.execute(k, FP, never))
        while s.counters()["remote_waits"] == waits:
            await asyncio.sleep(0.005)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            pid = os.fork()
        if pid == 0:
            code = 1
            try:
                hang_alarm()
                try:
                    # Not wait_for: asyncio forgets the running loop in a child, though
                    # this one goes on (its alarm ends a hang).
                    await waiter
                except oncely.StoreUnavailableError as e:
                    code = 0 if "forked" in str(e) else 2
                    if code:
                        print(f"child: {e}", file=sys.stderr)
                except BaseException:
                    traceback.print_exc()
            finally:
                os._exit(code)
        # The parent's loop does not run until the child is done (they share the
        # loop's wake-up pipe).
        try:
            wait_child(pid)
        finally:
            go.set()
            leader.join()
        return await waiter

    done = asyncio.run(main())
    assert (done.value, done.source) == ("w", "joined")


def _mp_worker(s: RedisStore, shared: list[str], runs: str, out: Any, n: int) -> None:
    hang_alarm()
    results: dict[str, Any] = {}

    def action(name: str) -> Callable[[], Any]:
        async def run() -> Any:
            with open(runs, "a") as f:
                f.write(f"{name}\n")
            await asyncio.sleep(0.05)
            return {"by": n, "key": name}

        return run

    async def main() -> None:
        mine = oncely.scope("acme", "Own", oncely.new_key())
        calls = [(k, s.execute(oncely.scope("acme", "Shared", k), FP, action(k))) for k in shared]
        calls.append(("own", s.execute(mine, FP, action(f"own-{n}"))))
        for name, done in zip([c[0] for c in calls], await asyncio.gather(*[c[1] for c in calls])):
            results[name] = done.value

    asyncio.run(main())
    out.send(results)
    out.close()


@needs_redis
def test_multiprocessing_fork_workers_share_the_parents_store(tmp_path: Path) -> None:
    pfx = "pytest-" + oncely.new_key()
    s, other = store(pfx), store(pfx)
    warm_up(s, other)
    ctx = multiprocessing.get_context("fork")
    shared = [oncely.new_key() for _ in range(5)]
    runs = str(tmp_path / "runs")
    procs, pipes = [], []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        for n in range(4):
            r, w = ctx.Pipe(duplex=False)
            p = ctx.Process(target=_mp_worker, args=(s, shared, runs, w, n))
            p.start()
            w.close()
            procs.append(p)
            pipes.append(r)
    results = []
    for p, r in zip(procs, pipes):
        assert r.poll(ALARM + 5), "a worker hung"
        results.append(r.recv())
        p.join(10)
        assert p.exitcode == 0
    lines = Path(runs).read_text().split()
    for k in shared:
        assert lines.count(k) == 1, f"the shared key {k} ran {lines.count(k)} times"
        assert len({json.dumps(res[k], sort_keys=True) for res in results}) == 1
    assert sorted(x for x in lines if x.startswith("own-")) == [f"own-{n}" for n in range(4)]


PRELOAD_APP = textwrap.dedent(
    """
    import asyncio, json, os, signal, sys, traceback, warnings
    import oncely

    # The app module, imported once by the master (gunicorn --preload): the store is
    # made, and used, before the workers are forked.
    URL, PREFIX, RUNS, WORKERS = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
    STORE = oncely.RedisStore(URL, prefix=PREFIX, lease=0.5)
    assert STORE.execute_sync(oncely.scope("app", "Boot", oncely.new_key()), "fp",
                              lambda: "ready").value == "ready"
    SHARED = [f"shared-key-{i}" for i in range(6)]

    async def handle(name):
        async def charge():
            with open(RUNS, "a") as f:
                f.write(name + "\\n")
            await asyncio.sleep(0.05)
            return {"charged": name, "pid": os.getpid()}
        done = await STORE.execute(oncely.scope("app", "Charge", name), "fp", charge)
        return name, done.value

    async def serve(n):
        names = SHARED + SHARED + [f"own-key-{n}-{i}" for i in range(3)]
        return dict(await asyncio.gather(*(handle(x) for x in names)))

    def worker(n):
        signal.alarm(20)
        got = asyncio.run(serve(n))
        # Every worker also serves one request on a thread (a sync handler).
        got["sync"] = STORE.execute_sync(oncely.scope("app", "Charge", SHARED[0]), "fp",
                                         lambda: "must not run")
        got["sync"] = got["sync"].value
        os.write(1, (json.dumps(got) + "\\n").encode())  # one atomic write per line

    if __name__ == "__main__":
        pids = []
        for n in range(WORKERS):
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", DeprecationWarning)
                pid = os.fork()
            if pid == 0:
                code = 1
                try:
                    worker(n)
                    code = 0
                except BaseException:
                    traceback.print_exc()
                finally:
                    os._exit(code)
            pids.append(pid)
        failed = []
        for pid in pids:
            _, status = os.waitpid(pid, 0)
            if os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGALRM:
                failed.append("hung (killed by its alarm)")
            elif status != 0:
                failed.append(status)
        sys.exit(f"workers failed: {failed}" if failed else 0)
    """
)


@needs_redis
def test_preload_pattern_forked_workers_run_each_shared_key_once(tmp_path: Path) -> None:
    """gunicorn --preload: the master imports the app (which makes and uses the store),
    then forks workers; each serves concurrent requests on shared and own keys."""
    assert URL
    app, runs = tmp_path / "app.py", tmp_path / "runs"
    app.write_text(PRELOAD_APP)
    workers = 4
    proc = subprocess.run(
        [sys.executable, str(app), URL, "pytest-" + oncely.new_key(), str(runs), str(workers)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    results = [json.loads(line) for line in proc.stdout.splitlines()]
    assert len(results) == workers
    lines = runs.read_text().split()
    for i in range(6):
        name = f"shared-key-{i}"
        assert lines.count(name) == 1, f"{name} ran {lines.count(name)} times"
        assert len({json.dumps(r[name], sort_keys=True) for r in results}) == 1
    assert all(r["sync"] == results[0]["shared-key-0"] for r in results)
    assert len([x for x in lines if x.startswith("own-")]) == 3 * workers


def test_idempotency_store_in_a_forked_child() -> None:
    """The in-process store after fork: the child replays what the parent completed,
    and its own calls (asyncio joiners woken by the pump, threads) work."""
    s = IdempotencyStore()
    done = s.execute_sync(key(), FP, lambda: "warm")
    k = key()
    assert s.execute_sync(k, FP, lambda: "parent").value == "parent"

    async def joiners() -> None:
        go = asyncio.Event()
        runs: list[int] = []

        async def slow() -> str:
            runs.append(1)
            await go.wait()
            return "x"

        kk = key()
        tasks = [asyncio.ensure_future(s.execute(kk, FP, slow)) for _ in range(20)]
        await asyncio.sleep(0.01)
        go.set()
        outs = await asyncio.gather(*tasks)
        assert {o.value for o in outs} == {"x"} and runs == [1]

    asyncio.run(joiners())  # starts the pump in the parent

    def child() -> None:
        assert s.execute_sync(k, FP, lambda: "child").value == "parent"
        asyncio.run(joiners())
        kt = key()
        out: list[Any] = []
        threads = [
            threading.Thread(target=lambda: out.append(s.execute_sync(kt, FP, lambda: "t")))
            for _ in range(8)
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert [o.value for o in out] == ["t"] * 8

    wait_child(fork(child))
    assert done.value == "warm"
    asyncio.run(joiners())


def test_idempotency_store_child_leads_a_key_a_parent_thread_was_running() -> None:
    """A key that a parent thread was running at the fork: its action stayed in the
    parent, so the child's store forgets that call and the child's caller leads (it
    used to join a flight nothing settles, and hang). What the parent completed is
    still replayed in the child; the parent's own call is unaffected."""
    s = IdempotencyStore()
    done_key = key()
    assert s.execute_sync(done_key, FP, lambda: "parent").value == "parent"
    k = key()
    started, go = threading.Event(), threading.Event()

    def slow() -> str:
        started.set()
        go.wait()
        return "parent-running"

    out: list[Any] = []
    t = threading.Thread(target=lambda: out.append(s.execute_sync(k, FP, slow)))
    t.start()
    assert started.wait(5)

    def child() -> None:
        got = s.execute_sync(k, FP, lambda: "child")
        assert (got.value, got.source) == ("child", "led"), got
        assert s.execute_sync(k, FP, lambda: "again").value == "child"
        assert s.execute_sync(done_key, FP, lambda: "rerun").value == "parent"

    try:
        wait_child(fork(child))
    finally:
        go.set()
        t.join()
    assert out[0].value == "parent-running" and out[0].source == "led"
    assert s.execute_sync(k, FP, lambda: "x").value == "parent-running"
