"""oncely.RedisStore against a real Redis (SPEC §6 across processes).

The Redis-backed tests read ONCELY_REDIS_URL and are skipped without it: run them with
scripts/test-redis (or scripts/test redis), which starts a throwaway redis-server. The
encoding tests need no Redis."""

from __future__ import annotations

import _thread
import asyncio
import datetime
import decimal
import enum
import json
import math
import os
import pickle
import signal
import socket
import subprocess
import sys
import threading
import time
from typing import Any

import oncely
import pytest
from oncely import (
    FingerprintMismatchError,
    InProgressError,
    RedisStore,
    StoreUnavailableError,
)
from oncely._driver import wait_step
from oncely.redis_store import decode_result, encode_result

URL = os.environ.get("ONCELY_REDIS_URL")
needs_redis = pytest.mark.skipif(not URL, reason="needs a Redis: run scripts/test-redis")

FP = oncely.fingerprint({"sku": "A1", "qty": 1})
OTHER_FP = oncely.fingerprint({"sku": "A1", "qty": 2})


def key() -> oncely.ScopedKey:
    return oncely.scope("acme", "CreateOrder", oncely.new_key())


def prefix() -> str:
    return "pytest-" + oncely.new_key()


def store(pfx: str, **kw: Any) -> RedisStore:
    assert URL
    return RedisStore(URL, prefix=pfx, **kw)


class Counter:
    def __init__(self) -> None:
        self.calls = 0
        self.lock = threading.Lock()

    def bump(self) -> int:
        with self.lock:
            self.calls += 1
            return self.calls


# ---------------------------------------------------------------------------------------
# Result encoding (redis/README.md, "Result encoding"): no Redis needed
# ---------------------------------------------------------------------------------------


def test_encoding_tags_json_and_bytes() -> None:
    assert encode_result({"b": [1, 2.5, None, True], "a": "é"}) == (
        b"j" + '{"b":[1,2.5,null,true],"a":"é"}'.encode()
    )
    assert encode_result(b"\x00\xff") == b"b\x00\xff"
    assert encode_result(bytearray(b"xy")) == b"bxy"
    assert encode_result(memoryview(b"z")) == b"bz"
    assert encode_result("text") == b'j"text"'
    assert encode_result((1, "a")) == b'j[1,"a"]'
    assert decode_result(b'j{"a":[1,"\xc3\xa9"]}') == {"a": [1, "é"]}
    assert decode_result(b"b\x00\xff") == b"\x00\xff"
    assert decode_result(b"b") == b""
    with pytest.raises(StoreUnavailableError, match="unknown encoding tag"):
        decode_result(b"Q123")
    with pytest.raises(StoreUnavailableError):
        decode_result(b"")


def test_ints_a_javascript_reader_reads_exactly_are_json() -> None:
    assert encode_result([2**53 - 1, -(2**53 - 1)]) == b"j[9007199254740991,-9007199254740991]"


def test_shared_parts_are_not_cycles() -> None:
    part = [1, {"a": "b"}]
    assert encode_result({"x": part, "y": [part, part]}) == (
        b'j{"x":[1,{"a":"b"}],"y":[[1,{"a":"b"}],[1,{"a":"b"}]]}'
    )


def test_none_is_no_value() -> None:
    assert encode_result(None) == b"n"
    assert decode_result(b"n") is None
    assert decode_result(b"jnull") is None


class Money(decimal.Decimal):
    pass


class Color(enum.IntEnum):
    RED = 1


def _cyclic() -> list[Any]:
    v: list[Any] = []
    v.append(v)
    return v


UNSTORABLE = [
    (decimal.Decimal("10.10"), "decimal.Decimal"),
    (datetime.datetime(2024, 5, 1, 12, 0), "datetime.datetime"),
    ({1, 2}, "set"),
    (float("nan"), "float (nan)"),
    (float("inf"), "float (inf)"),
    ("a\ud800b", "str (lone surrogate)"),
    (2**53, "int (beyond 2^53 - 1)"),
    ({"id": [-(2**53)]}, "int (beyond 2^53 - 1)"),
    (2**64, "int (beyond 2^53 - 1)"),
    ({"total": decimal.Decimal("1")}, "decimal.Decimal"),
    ([1, [2, {"at": datetime.date(2024, 1, 1)}]], "datetime.date"),
    ({1: "one"}, "dict with int keys"),
    (Color.RED, f"{__name__}.Color"),
    (Money("1"), f"{__name__}.Money"),
    (_cyclic(), "list (cyclic)"),
    (object(), "object"),
]


@pytest.mark.parametrize("value,type_name", UNSTORABLE, ids=lambda v: repr(v)[:30])
def test_values_json_would_change_are_not_storable(value: Any, type_name: str) -> None:
    assert encode_result(value) == b"x" + type_name.encode()
    with pytest.raises(oncely.ResultNotStoredError) as info:
        decode_result(encode_result(value))
    assert info.value.type_name == type_name
    assert info.value.code == oncely.Code.DATA_LOSS


def test_user_codec_records() -> None:
    assert encode_result(decimal.Decimal("1.5"), pickle.dumps)[:1] == b"u"
    assert decode_result(encode_result(decimal.Decimal("1.5"), pickle.dumps), pickle.loads) == (
        decimal.Decimal("1.5")
    )
    text = encode_result({"at": datetime.date(2024, 1, 2)}, lambda v: json.dumps(v, default=str))
    assert text == b't{"at": "2024-01-02"}'
    assert decode_result(text, json.loads) == {"at": "2024-01-02"}
    assert encode_result(None, pickle.dumps) == b"n"

    def refuses(v: Any) -> bytes:
        raise TypeError("no")

    assert encode_result(decimal.Decimal(1), refuses) == b"xdecimal.Decimal"
    with pytest.raises(StoreUnavailableError, match="user codec"):
        decode_result(b"u\x80")  # no loads given
    with pytest.raises(StoreUnavailableError, match="could not decode") as info:
        decode_result(b"tnot json", json.loads)
    assert isinstance(info.value.__cause__, json.JSONDecodeError)


def test_dumps_and_loads_go_together() -> None:
    with pytest.raises(oncely.InvalidArgumentError):
        RedisStore("redis://127.0.0.1:1", dumps=pickle.dumps)
    with pytest.raises(TypeError):
        RedisStore("redis://127.0.0.1:1", dumps=1, loads=pickle.loads)  # type: ignore[arg-type]
    s = RedisStore("redis://127.0.0.1:1", dumps=pickle.dumps, loads=pickle.loads)
    assert s.dumps is pickle.dumps and s.loads is pickle.loads


def test_settings_and_bad_settings() -> None:
    s = RedisStore("redis://127.0.0.1:1", lease=5, ttl=60.0, prefix="p")
    assert (s.lease, s.ttl, s.prefix) == (5.0, 60.0, "p")
    d = RedisStore("redis://127.0.0.1:1")
    assert (d.lease, d.ttl, d.prefix) == (30.0, 86400.0, "oncely")
    k = oncely.scope("t", "M", "abcdefgh")
    assert d.record_key(k) == "{oncely:" + k.value + "}"
    with pytest.raises(oncely.InvalidArgumentError):
        RedisStore("redis://127.0.0.1:1", ttl=0)
    with pytest.raises(oncely.InvalidArgumentError):
        RedisStore("redis://127.0.0.1:1", workers=0)
    assert d.max_result_bytes == 64 << 20
    assert (
        RedisStore("redis://127.0.0.1:1", max_result_bytes=512 << 20).max_result_bytes == 512 << 20
    )
    for bad in (0, -1, (512 << 20) + 1, 1 << 80):
        with pytest.raises(oncely.InvalidArgumentError, match="max_result_bytes"):
            RedisStore("redis://127.0.0.1:1", max_result_bytes=bad)
    for wrong in ("1", 1.5, True):
        with pytest.raises(TypeError, match="max_result_bytes"):
            RedisStore("redis://127.0.0.1:1", max_result_bytes=wrong)


# ---------------------------------------------------------------------------------------
# Unreachable Redis: no Redis needed either (a closed port on 127.0.0.1)
# ---------------------------------------------------------------------------------------


def closed_port_url() -> str:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return f"redis://127.0.0.1:{port}"


async def test_unreachable_redis_is_unavailable_and_the_action_does_not_run() -> None:
    s = RedisStore(closed_port_url(), connect_timeout=0.5, io_timeout=0.5)
    ran = []

    async def action() -> str:
        ran.append(1)
        return "x"

    with pytest.raises(StoreUnavailableError) as info:
        await s.execute(key(), FP, action)
    assert info.value.code == oncely.Code.UNAVAILABLE
    with pytest.raises(StoreUnavailableError):
        s.execute_sync(key(), FP, lambda: ran.append(2))
    assert ran == []


# ---------------------------------------------------------------------------------------
# With Redis
# ---------------------------------------------------------------------------------------


@needs_redis
async def test_many_concurrent_asyncio_callers_run_once() -> None:
    s = store(prefix())
    c = Counter()
    k = key()

    async def action() -> dict[str, Any]:
        n = c.bump()
        await asyncio.sleep(0.05)
        return {"order": n, "items": [1, 2]}

    results = await asyncio.wait_for(
        asyncio.gather(*(s.execute(k, FP, action) for _ in range(200))), timeout=30
    )
    assert c.calls == 1
    assert all(r.value == {"order": 1, "items": [1, 2]} for r in results)
    sources = [r.source for r in results]
    assert sources.count("led") == 1 and sources.count("joined") == 199
    assert s.counters()["claims"] == 1  # the in-process tier: one claim


@needs_redis
def test_execute_sync_waiter_on_another_instance_stops_at_ctrl_c() -> None:
    pfx = prefix()
    leader_store, waiter_store = store(pfx), store(pfx)
    k = key()
    started = threading.Event()
    release = threading.Event()
    leader_done = threading.Event()

    def work() -> str:
        started.set()
        release.wait(10)
        return "done"

    def lead() -> None:
        leader_store.execute_sync(k, FP, work)
        leader_done.set()

    leader = threading.Thread(target=lead)
    leader.start()
    assert started.wait(10)
    # Ctrl-C while this (main) thread waits in Redis for the leader: the wait ends.
    # Python's own Ctrl-C handler, whatever the suite inherited: a suite started as a
    # background job has SIGINT ignored, and interrupt_main() then does nothing.
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    threading.Timer(0.2, _thread.interrupt_main).start()
    try:
        with pytest.raises(KeyboardInterrupt):
            waiter_store.execute_sync(k, FP, lambda: "not run")
        assert not leader_done.is_set(), "the waiter ignored Ctrl-C until its leader ended"
    finally:
        signal.signal(signal.SIGINT, previous)
        release.set()
        leader.join(30)
    assert waiter_store.execute_sync(k, FP, lambda: "not run").value == "done"


@needs_redis
async def test_a_claim_answered_as_its_caller_is_cancelled_is_released() -> None:
    pfx = prefix()
    s, other = store(pfx), store(pfx)
    k = key()
    pending = s.begin(k, FP, True)

    class AnsweredAsCancelled:
        """The claim's answer reaches its caller's future in the turn of the loop that
        cancels the caller."""

        task: asyncio.Task[Any]

        def subscribe(self, loop: asyncio.AbstractEventLoop, fut: asyncio.Future[Any]) -> Any:
            inner = loop.create_future()
            out = pending.subscribe(loop, inner)

            def deliver(value: Any) -> None:
                fut.set_result(value)
                self.task.cancel()

            if out is inner:
                inner.add_done_callback(lambda f: deliver(f.result()))
            else:
                loop.call_soon(deliver, out)
            return fut

        def cancel(self) -> None:
            pending.cancel()

    step = AnsweredAsCancelled()
    step.task = asyncio.ensure_future(wait_step(step))
    # gather keeps the CancelledError, and with it (its context's traceback) the frame
    # that got the claim: the claim is released all the same, and another instance
    # leads at once (a claim kept would hold the key, renewed, while the error lives).
    outcomes = await asyncio.gather(step.task, return_exceptions=True)
    assert isinstance(outcomes[0], asyncio.CancelledError)
    r = await asyncio.wait_for(other.execute(k, FP, lambda: "second"), 10)
    assert r.value == "second" and r.source == "led"
    del outcomes


@needs_redis
def test_many_threads_run_once() -> None:
    s = store(prefix())
    c = Counter()
    k = key()
    out: list[Any] = []
    barrier = threading.Barrier(16)

    def action() -> list[int]:
        c.bump()
        time.sleep(0.1)
        return [7]

    def worker() -> None:
        barrier.wait()
        out.append(s.execute_sync(k, FP, action))

    threads = [threading.Thread(target=worker) for _ in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert c.calls == 1 and len(out) == 16
    assert all(r.value == [7] for r in out)
    assert [r.source for r in out].count("led") == 1


@needs_redis
async def test_replay_is_an_equal_value_and_bytes_stay_bytes() -> None:
    s = store(prefix())
    value = {"id": "o-1", "total": 12.5, "tags": ["é", None, True], "nested": {"n": 3}}

    async def action() -> dict[str, Any]:
        return value

    first = await s.execute(k := key(), FP, action)
    assert first.source == "led" and first.value is value
    again = await s.execute(k, FP, action)
    assert (again.source, again.replayed) == ("replayed", True)
    assert again.value == value and again.value is not value
    assert s.execute_sync(k, FP, lambda: "never").value == value

    raw = b"\x00\x01binary\xff"
    kb = key()
    assert s.execute_sync(kb, FP, lambda: raw).value is raw
    back = s.execute_sync(kb, FP, lambda: b"never")
    assert back.source == "replayed" and type(back.value) is bytes and back.value == raw

    async def tuple_action() -> tuple[int, str]:
        return (1, "a")

    kt = key()
    await s.execute(kt, FP, tuple_action)
    assert (await s.execute(kt, FP, tuple_action)).value == [1, "a"]  # JSON has lists


@needs_redis
async def test_fingerprint_mismatch() -> None:
    s = store(prefix())
    k = key()

    async def action() -> int:
        return 1

    await s.execute(k, FP, action)
    with pytest.raises(FingerprintMismatchError) as info:
        await s.execute(k, OTHER_FP, action)
    assert info.value.code == oncely.Code.FAILED_PRECONDITION
    with pytest.raises(FingerprintMismatchError):
        store(s.prefix).execute_sync(k, OTHER_FP, lambda: 2)  # another instance too


@needs_redis
async def test_failure_is_not_cached_and_local_waiters_share_it() -> None:
    s = store(prefix())
    k = key()
    c = Counter()

    class Boom(Exception):
        pass

    async def failing() -> int:
        c.bump()
        await asyncio.sleep(0.05)
        raise Boom("no")

    results = await asyncio.gather(
        *(s.execute(k, FP, failing) for _ in range(5)), return_exceptions=True
    )
    assert c.calls == 1
    assert all(isinstance(r, Boom) for r in results)
    assert len({id(r) for r in results}) == 1  # the leader's very exception

    async def ok() -> str:
        c.bump()
        return "second"

    assert (await s.execute(k, FP, ok)).source == "led" and c.calls == 2
    with pytest.raises(Boom):
        store(prefix()).execute_sync(key(), FP, lambda: (_ for _ in ()).throw(Boom()))

    # A value that cannot be stored is not a failure: the call succeeds, and it does not
    # run again.
    kn = key()
    assert math.isnan(s.execute_sync(kn, FP, lambda: float("nan")).value)
    with pytest.raises(oncely.ResultNotStoredError):
        s.execute_sync(kn, FP, lambda: 1.5)


@needs_redis
async def test_no_wait_is_in_progress_with_retry_after() -> None:
    pfx = prefix()
    a = store(pfx)
    b = store(pfx, in_progress_retry_after=0.25)
    k = key()
    release = asyncio.Event()
    started = asyncio.Event()

    async def slow() -> str:
        started.set()
        await release.wait()
        return "done"

    leader = asyncio.ensure_future(a.execute(k, FP, slow))
    await started.wait()
    with pytest.raises(InProgressError) as info:  # another instance: via Redis
        await b.execute(k, FP, slow, wait=False)
    assert info.value.retry_after == pytest.approx(0.25)
    assert info.value.code == oncely.Code.ABORTED
    with pytest.raises(InProgressError):  # the same instance: the in-process tier
        a.execute_sync(k, FP, lambda: "x", wait=False)
    waiter = asyncio.ensure_future(b.execute(k, FP, slow))  # waits on the other instance
    await asyncio.sleep(0.05)
    release.set()
    assert (await leader).source == "led"
    got = await asyncio.wait_for(waiter, 10)
    assert (got.value, got.source) == ("done", "joined")


@needs_redis
async def test_two_instances_share_one_run() -> None:
    pfx = prefix()
    a, b = store(pfx), store(pfx)
    c = Counter()
    k = key()

    async def action() -> dict[str, int]:
        c.bump()
        await asyncio.sleep(0.1)
        return {"n": 1}

    results = await asyncio.wait_for(
        asyncio.gather(*(st.execute(k, FP, action) for st in [a, b] * 20)), timeout=30
    )
    assert c.calls == 1
    assert all(r.value == {"n": 1} for r in results)
    assert a.counters()["claims"] + b.counters()["claims"] == 2
    again = b.execute_sync(k, FP, lambda: {"n": 2})
    assert (again.value, again.source) == ({"n": 1}, "replayed")


@needs_redis
async def test_cancelled_caller_leaves_the_action_its_claim() -> None:
    pfx = prefix()
    a, b = (store(pfx, lease=1.2, io_timeout=0.35) for _ in range(2))
    k = key()
    started = asyncio.Event()
    release = asyncio.Event()

    async def slow() -> str:
        started.set()
        await release.wait()
        return "first"

    async def other() -> str:
        raise AssertionError("the claim went on while its action was running")

    leader = asyncio.ensure_future(a.execute(k, FP, slow))
    await started.wait()
    waiter = asyncio.ensure_future(b.execute(k, FP, other))
    leader.cancel()
    with pytest.raises(asyncio.CancelledError):
        await asyncio.wait_for(leader, 5)  # the caller stops waiting at once
    await asyncio.sleep(2.5)  # two leases: renewed while the action runs
    assert not waiter.done()
    release.set()
    got = await asyncio.wait_for(waiter, 10)
    assert (got.value, got.source) == ("first", "joined")
    assert b.counters()["takeovers"] == 0


@needs_redis
async def test_an_action_whose_task_is_cancelled_lets_a_waiter_take_over() -> None:
    pfx = prefix()
    a, b = store(pfx), store(pfx)
    k = key()
    tasks: list[asyncio.Task[Any]] = []

    async def hang() -> str:
        tasks.append(asyncio.current_task())  # type: ignore[arg-type]
        await asyncio.sleep(60)
        return "never"

    async def quick() -> str:
        return "took over"

    leader = asyncio.ensure_future(a.execute(k, FP, hang))
    while not tasks:
        await asyncio.sleep(0.01)
    waiter = asyncio.ensure_future(b.execute(k, FP, quick))
    await asyncio.sleep(0.05)
    tasks[0].cancel()
    with pytest.raises(asyncio.CancelledError):
        await leader
    got = await asyncio.wait_for(waiter, 10)
    assert (got.value, got.source) == ("took over", "led")


SCRIPT = """
import json, sys
import oncely
url, pfx, tenant, method, k, fp = sys.argv[1:7]
store = oncely.RedisStore(url, prefix=pfx)
done = store.execute_sync(oncely.scope(tenant, method, k), fp, lambda: {"from": "child"})
print(json.dumps({"value": done.value, "source": done.source}))
"""


@needs_redis
async def test_another_process_replays_the_stored_value() -> None:
    assert URL
    pfx = prefix()
    s = store(pfx)
    k_text = oncely.new_key()
    k = oncely.scope("acme", "CreateOrder", k_text)
    value = {"order": "o-42", "amount": [1, 2.5], "note": "ünïcode"}

    async def action() -> dict[str, Any]:
        return value

    await s.execute(k, FP, action)
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT, URL, pfx, "acme", "CreateOrder", k_text, FP],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    got = json.loads(proc.stdout)
    assert got == {"value": value, "source": "replayed"}

    # And the other way: the child stores, this process replays.
    k2_text = oncely.new_key()
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT, URL, pfx, "acme", "CreateOrder", k2_text, FP],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    assert json.loads(proc.stdout)["source"] == "led"
    back = s.execute_sync(oncely.scope("acme", "CreateOrder", k2_text), FP, lambda: "never")
    assert (back.value, back.source) == ({"from": "child"}, "replayed")


def redis_command(*args: str | bytes) -> bytes:
    """One command over a raw RESP connection to ONCELY_REDIS_URL (no client library);
    returns the first reply line."""
    assert URL
    host, port = URL.removeprefix("redis://").split("/")[0].rsplit(":", 1)
    parts = [a.encode() if isinstance(a, str) else a for a in args]
    msg = b"*%d\r\n" % len(parts) + b"".join(b"$%d\r\n%s\r\n" % (len(p), p) for p in parts)
    with socket.create_connection((host, int(port)), timeout=5) as s:
        s.sendall(msg)
        return s.recv(65536).split(b"\r\n")[0]


@needs_redis
def test_a_leader_whose_record_was_taken_gets_lease_lost() -> None:
    s = store(prefix())
    k = key()

    def action() -> str:
        # Another leader took over (simulated: the record is gone): nothing is written.
        assert redis_command("DEL", s.record_key(k)) == b":1"
        return "late"

    with pytest.raises(oncely.LeaseLostError) as info:
        s.execute_sync(k, FP, action)
    assert info.value.code == oncely.Code.ABORTED
    assert redis_command("EXISTS", s.record_key(k)) == b":0"


@needs_redis
async def test_a_result_with_an_unknown_encoding_tag_is_refused() -> None:
    s = store(prefix())
    k = key()
    record = s.record_key(k)
    reply = redis_command(
        "HSET",
        record,
        "v",
        "1",
        "state",
        "done",
        "fp",
        FP,
        "token",
        "t",
        "gen",
        "1",
        "result",
        b"raw-from-elsewhere",
        "done_at",
        "1",
    )
    assert reply == b":7"
    ran = []

    async def action() -> int:
        ran.append(1)
        return 1

    with pytest.raises(StoreUnavailableError, match="unknown encoding tag"):
        await s.execute(k, FP, action)
    assert ran == []
    redis_command("HSET", record, "result", b'j{"ok":true}')
    assert s.execute_sync(k, FP, lambda: 0).value == {"ok": True}


def hget_result(record: str) -> bytes:
    """The raw `result` field of a record."""
    assert URL
    host, port = URL.removeprefix("redis://").split("/")[0].rsplit(":", 1)
    parts = [b"HGET", record.encode(), b"result"]
    msg = b"*3\r\n" + b"".join(b"$%d\r\n%s\r\n" % (len(p), p) for p in parts)
    with socket.create_connection((host, int(port)), timeout=5) as sock:
        sock.sendall(msg)
        reply = b""
        while b"\r\n" not in reply or len(reply) < int(reply[1 : reply.index(b"\r\n")]) + 5:
            reply += sock.recv(65536)
    head, body = reply.split(b"\r\n", 1)
    return body[: int(head[1:])]


@needs_redis
async def test_none_is_stored_as_no_value_and_not_run_again() -> None:
    s = store(prefix())
    k = key()
    runs = Counter()

    async def action() -> None:
        runs.bump()
        await asyncio.sleep(0.05)

    done = await asyncio.gather(*(s.execute(k, FP, action) for _ in range(4)))
    assert [d.value for d in done] == [None] * 4
    assert sorted(d.source for d in done) == ["joined", "joined", "joined", "led"]
    again = await s.execute(k, FP, action)
    assert (again.value, again.source) == (None, "replayed")
    assert s.execute_sync(k, FP, lambda: runs.bump()).value is None
    assert store(s.prefix).execute_sync(k, FP, lambda: runs.bump()).value is None
    assert runs.calls == 1
    assert hget_result(s.record_key(k)) == b"n"


@needs_redis
@pytest.mark.parametrize("value,type_name", UNSTORABLE[:6], ids=lambda v: repr(v)[:30])
async def test_a_result_that_cannot_be_stored_runs_once(value: Any, type_name: str) -> None:
    s = store(prefix())
    k = key()
    runs = Counter()

    async def action() -> Any:
        runs.bump()
        await asyncio.sleep(0.05)
        return value

    # The leader and the callers of this process waiting for it get the value itself.
    done = await asyncio.gather(*(s.execute(k, FP, action) for _ in range(4)))
    assert all(d.value is value for d in done)
    assert sorted(d.source for d in done) == ["joined", "joined", "joined", "led"]
    # Every later caller, in this process or another, gets ResultNotStoredError.
    for later in (s, store(s.prefix)):
        with pytest.raises(oncely.ResultNotStoredError) as info:
            await later.execute(k, FP, action)
        assert (info.value.key, info.value.type_name) == (k.value, type_name)
        assert info.value.code == oncely.Code.DATA_LOSS
        with pytest.raises(oncely.ResultNotStoredError):
            later.execute_sync(k, FP, lambda: runs.bump())
    assert runs.calls == 1
    assert hget_result(s.record_key(k)) == b"x" + type_name.encode()


@needs_redis
async def test_a_result_that_cannot_be_stored_with_many_callers_and_cancelled_joiners() -> None:
    s = store(prefix())
    other = store(s.prefix)
    for _ in range(5):
        k = key()
        runs = Counter()
        value = {"at": datetime.datetime(2024, 5, 1)}
        release = asyncio.Event()

        async def action() -> Any:
            runs.bump()
            await release.wait()
            return value

        tasks = [asyncio.ensure_future(s.execute(k, FP, action)) for _ in range(40)]
        while runs.calls == 0:  # the leader is in this instance
            await asyncio.sleep(0.001)
        remote = [asyncio.ensure_future(other.execute(k, FP, action)) for _ in range(5)]
        await asyncio.sleep(0.05)
        for t in tasks[30:]:
            t.cancel()
        release.set()
        done = await asyncio.gather(*tasks[:30])
        assert all(d.value is value for d in done)
        for r in remote:  # another instance: the value is not there
            with pytest.raises(oncely.ResultNotStoredError):
                await r
        for t in tasks[30:]:
            with pytest.raises(asyncio.CancelledError):
                await t
        with pytest.raises(oncely.ResultNotStoredError):
            await s.execute(k, FP, action)
        assert runs.calls == 1


@needs_redis
def test_a_result_that_cannot_be_stored_runs_once_across_threads() -> None:
    s = store(prefix())
    k = key()
    runs = Counter()
    value = {decimal.Decimal("9.99")}
    start = threading.Barrier(6)
    out: list[Any] = []

    def action() -> Any:
        runs.bump()
        time.sleep(0.05)
        return value

    def call() -> None:
        start.wait()
        try:
            out.append(s.execute_sync(k, FP, action).value)
        except oncely.ResultNotStoredError as e:
            out.append(e)

    threads = [threading.Thread(target=call) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert runs.calls == 1 and len(out) == 6
    # Threads that joined the leader get the value; a thread that came after it
    # finished gets the error: never a second run.
    assert all(v is value or isinstance(v, oncely.ResultNotStoredError) for v in out)
    assert any(v is value for v in out)


@needs_redis
def test_a_result_over_max_result_bytes_is_not_stored_and_not_run_again() -> None:
    pfx = prefix()
    s, other = store(pfx, max_result_bytes=1000), store(pfx)
    k, small = key(), key()
    runs = Counter()
    big = b"x" * 5000

    def action() -> Any:
        runs.bump()
        return big

    assert s.execute_sync(k, FP, action).value is big
    assert s.execute_sync(small, FP, lambda: b"y" * 999).value == b"y" * 999
    for st in (s, other):
        with pytest.raises(oncely.ResultNotStoredError, match="5001 bytes"):
            st.execute_sync(k, FP, action)
        assert st.execute_sync(small, FP, action).value == b"y" * 999
    assert runs.calls == 1


@needs_redis
async def test_waiters_on_another_instance_get_result_not_stored_for_a_result_over_max_result_bytes() -> (
    None
):
    pfx = prefix()
    s, other = store(pfx, max_result_bytes=1000), store(pfx)
    k = key()
    runs = Counter()
    gate = asyncio.Event()
    big = b"z" * 5000

    async def lead() -> Any:
        runs.bump()
        await gate.wait()
        return big

    async def again() -> Any:
        runs.bump()
        return b"again"

    leader = asyncio.create_task(s.execute(k, FP, lead))
    while runs.calls == 0:
        await asyncio.sleep(0.005)
    waiters = [asyncio.create_task(other.execute(k, FP, again)) for _ in range(4)]
    # Bounded: a hang fails the test instead of stalling it.
    for _ in range(4000):
        if other.counters()["remote_waits"]:
            break
        await asyncio.sleep(0.005)
    assert other.counters()["remote_waits"]
    gate.set()
    assert (await leader).value is big
    for w in waiters:
        with pytest.raises(oncely.ResultNotStoredError) as info:
            await asyncio.wait_for(w, 30)
        assert info.value.key == k.value
        assert "5001 bytes" in info.value.type_name and "1000" in info.value.type_name
        assert info.value.code == oncely.Code.DATA_LOSS
    assert runs.calls == 1
    record = await other.get(k)
    assert record is not None and record.state == "done" and record.data is not None
    with pytest.raises(oncely.ResultNotStoredError, match="5001 bytes"):
        decode_result(record.data)


@needs_redis
async def test_user_codec_round_trips_and_a_failing_decoder_does_not_rerun() -> None:
    pfx = prefix()
    s = store(pfx, dumps=pickle.dumps, loads=pickle.loads)
    k = key()
    value = {"total": decimal.Decimal("10.10"), "at": datetime.datetime(2024, 5, 1), "ids": {1, 2}}
    runs = Counter()

    def action() -> Any:
        runs.bump()
        return value

    assert s.execute_sync(k, FP, action).value is value
    back = await store(pfx, dumps=pickle.dumps, loads=pickle.loads).execute(k, FP, action)
    assert back.source == "replayed" and back.value == value and back.value is not value
    assert hget_result(s.record_key(k))[:1] == b"u"

    js = store(pfx, dumps=lambda v: json.dumps(v, default=str), loads=json.loads)
    kj = key()
    assert js.execute_sync(kj, FP, lambda: {"at": datetime.date(2024, 1, 2)}).value
    assert js.execute_sync(kj, FP, action).value == {"at": "2024-01-02"}

    def broken(data: bytes) -> Any:
        raise ValueError("corrupt")

    for reader in (store(pfx, dumps=pickle.dumps, loads=broken), store(pfx)):
        with pytest.raises(StoreUnavailableError) as info:
            reader.execute_sync(k, FP, action)
        assert k.value in str(info.value)
    assert runs.calls == 1

    def refuses(v: Any) -> bytes:
        raise TypeError("not mine")

    r = store(pfx, dumps=refuses, loads=pickle.loads)
    kr = key()
    assert r.execute_sync(kr, FP, action).value is value
    with pytest.raises(oncely.ResultNotStoredError):
        r.execute_sync(kr, FP, action)
    assert runs.calls == 2


CRASHING = """
import sys, time
import oncely
url, pfx, k, fp = sys.argv[1:5]
store = oncely.RedisStore(url, prefix=pfx, lease=0.5)

def action():
    print("STARTED", flush=True)
    time.sleep(60)

store.execute_sync(oncely.scope("acme", "CreateOrder", k), fp, action)
"""


@needs_redis
async def test_a_killed_leader_process_is_taken_over_after_its_lease() -> None:
    assert URL
    pfx = prefix()
    k_text = oncely.new_key()
    child = subprocess.Popen(
        [sys.executable, "-c", CRASHING, URL, pfx, k_text, FP],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert child.stdout is not None
        assert child.stdout.readline().strip() == "STARTED"
        child.kill()  # SIGKILL: no release; the lease (0.5 s) has to run out
        child.wait(10)
        s = store(pfx)
        t0 = time.monotonic()

        async def action() -> str:
            return "taken over"

        got = await asyncio.wait_for(
            s.execute(oncely.scope("acme", "CreateOrder", k_text), FP, action), 10
        )
        assert (got.value, got.source) == ("taken over", "led")
        assert time.monotonic() - t0 > 0.2  # not before the lease ran out
        assert s.counters()["takeovers"] == 1
    finally:
        if child.poll() is None:
            child.kill()
            child.wait(10)
        if child.stdout is not None:
            child.stdout.close()


@needs_redis
def test_event_loops_in_several_threads_and_instances_share_one_run() -> None:
    pfx = prefix()
    stores = [store(pfx), store(pfx)]
    c = Counter()
    keys = [key() for _ in range(20)]
    seen: list[Any] = []
    lock = threading.Lock()

    async def action() -> dict[str, int]:
        n = c.bump()
        await asyncio.sleep(0.02)
        return {"n": n}

    async def one_loop(s: RedisStore) -> None:
        got = await asyncio.gather(*(s.execute(k, FP, action) for k in keys for _ in range(10)))
        with lock:
            seen.extend((r.value["n"], i // 10) for i, r in enumerate(got))

    threads = [
        threading.Thread(target=asyncio.run, args=(one_loop(stores[i % 2]),)) for i in range(4)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert c.calls == len(keys) and len(seen) == 4 * 10 * len(keys)
    by_key: dict[int, set[int]] = {}
    for n, k in seen:
        by_key.setdefault(k, set()).add(n)
    assert all(len(ns) == 1 for ns in by_key.values())  # every caller got the one result


# ---------------------------------------------------------------------------------------
# Operability: get / remove by scoped key, ping, connect at construction, counters
# ---------------------------------------------------------------------------------------


def test_connect_fails_a_closed_port_at_construction() -> None:
    bad = closed_port_url()
    with pytest.raises(StoreUnavailableError):
        RedisStore(bad, connect=True, connect_timeout=0.5, io_timeout=0.5)
    lazy = RedisStore(bad, connect_timeout=0.5, io_timeout=0.5)
    with pytest.raises(StoreUnavailableError):
        lazy.ping_sync()
    with pytest.raises(StoreUnavailableError):
        lazy.get_sync(key())
    assert lazy.counters()["unavailable"] == 2


@needs_redis
async def test_get_remove_ping_and_counters() -> None:
    assert URL
    RedisStore(URL, connect=True)
    pfx = prefix()
    s = store(pfx)
    await s.ping()
    s.ping_sync()
    k = key()
    assert await s.get(k) is None
    assert await s.remove(k) is False
    await s.execute(k, FP, lambda: {"bad": True})
    rec = await s.get(k)
    assert rec is not None
    assert (rec.state, rec.fingerprint, rec.generation, rec.lease_left) == ("done", FP, 1, 0.0)
    assert rec.data is not None and decode_result(rec.data) == {"bad": True}
    assert s.get_sync(k) == rec
    assert await s.remove(k) is True
    assert await s.get(k) is None
    done = await s.execute(k, FP, lambda: {"good": True})
    assert (done.value, done.source) == ({"good": True}, "led")
    assert s.remove_sync(k) is True
    counters = s.counters()
    assert counters["claims"] == 2 and counters["leads"] == 2
    assert counters["unavailable"] == 0


@needs_redis
async def test_a_running_record_with_a_live_lease_is_not_removed() -> None:
    pfx = prefix()
    s, other = store(pfx), store(pfx)
    k = key()
    started, release = asyncio.Event(), asyncio.Event()

    async def slow() -> str:
        started.set()
        await release.wait()
        return "first"

    task = asyncio.create_task(s.execute(k, FP, slow))
    await asyncio.wait_for(started.wait(), 10)
    rec = await other.get(k)
    assert rec is not None and rec.state == "running" and rec.data is None
    assert 0 < rec.lease_left <= s.lease
    assert await other.remove(k) is False
    with pytest.raises(InProgressError):
        await other.execute(k, FP, lambda: "second", wait=False)
    release.set()
    assert (await task).value == "first"
    assert (await other.execute(k, FP, lambda: "third")).value == "first"


@needs_redis
async def test_a_lead_given_up_unsettled_is_counted_as_abandoned() -> None:
    pfx = prefix()
    s = store(pfx)
    k = key()

    async def interrupted() -> None:
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        await s.execute(k, FP, interrupted)
    counters = s.counters()
    assert (counters["leads"], counters["abandoned"]) == (1, 1)
    done = await store(pfx).execute(k, FP, lambda: "second")
    assert (done.value, done.source) == ("second", "led")
    assert s.counters()["abandoned"] == 1
