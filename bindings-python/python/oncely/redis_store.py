"""The shared dedup store on Redis: run an action once per scoped key across every
process (and every language) that shares one Redis (SPEC §6).

:class:`RedisStore` has the same ``execute`` / ``execute_sync`` as
:class:`~oncely.IdempotencyStore`; the state lives in Redis (record format v1 of
``redis/README.md``), with an in-process tier in front, so N same-key callers in one
process make one claim. The Rust crate ``oncely-redis`` does the work; this module
runs your function when it says this caller leads (as ``oncely.IdempotencyStore``
does: in a task of its own, keeping the claim until the function has finished), and
waits when it says wait.

Results are stored as bytes, with a one-byte tag (``redis/README.md``, "Result
encoding"), so that a Node or Python instance can read what another one stored:

- ``bytes`` / ``bytearray`` / ``memoryview`` → ``b"b"`` + the raw bytes, read back as
  ``bytes``;
- anything else → ``b"j"`` + ``json.dumps(value, separators=(",", ":"),
  ensure_ascii=False, allow_nan=False)`` in UTF-8, read back with ``json.loads`` (so a
  tuple comes back as a list, and dict keys as strings).

The leader gets its own object back; joiners and replays get the decoded copy. A
value that cannot be encoded fails the call (``TypeError`` / ``ValueError``) and is
not stored. Exceptions raised by ``fn`` are never stored: the claim is released and a
later call (in any process) runs again; callers waiting in this process get the
exception itself, callers in other processes run their own ``fn``.
"""

from __future__ import annotations

import asyncio
import functools
import json
from typing import Any, Awaitable, Callable, NoReturn, TypeVar, overload

from ._action import Leading, call, check_reentrant, check_sync_action, lead, run_sync
from ._oncely import Executed, RedisLease, RedisPending, ScopedKey, _RedisStore
from .errors import StoreUnavailableError

__all__ = ["RedisStore", "encode_result", "decode_result"]

T = TypeVar("T")

TAG_JSON = b"j"
TAG_BYTES = b"b"


def encode_result(value: Any) -> bytes:
    """The stored form of a result: ``b"b"`` + raw bytes for bytes-like values,
    ``b"j"`` + compact UTF-8 JSON for everything else."""
    if isinstance(value, (bytes, bytearray, memoryview)):
        return TAG_BYTES + bytes(value)
    text = json.dumps(value, separators=(",", ":"), ensure_ascii=False, allow_nan=False)
    return TAG_JSON + text.encode("utf-8")


def decode_result(data: bytes) -> Any:
    """Reads a stored result back (see :func:`encode_result`). An unknown tag raises
    ``StoreUnavailableError``: the record was written by something that does not
    follow the encoding, and it is not guessed at."""
    tag = data[:1]
    if tag == TAG_JSON:
        return json.loads(data[1:].decode("utf-8"))
    if tag == TAG_BYTES:
        return bytes(data[1:])
    raise StoreUnavailableError(
        f"the stored result has an unknown encoding tag {tag!r} (expected b'j' for JSON or "
        "b'b' for bytes; see 'Result encoding' in redis/README.md)"
    )


async def _wait(pending: RedisPending) -> Any:
    loop = asyncio.get_running_loop()
    fut = loop.create_future()
    out = pending.subscribe(loop, fut)
    if out is fut:
        try:
            out = await fut
        except BaseException:
            pending.cancel()  # drops the step (a claim won meanwhile is released)
            raise
    return out


def _raise(out: Any) -> NoReturn:
    if isinstance(out, BaseException):
        raise out
    error, tb = out
    raise error.with_traceback(tb)


class RedisStore(_RedisStore):
    """A dedup store shared by every process using one Redis.

    ``RedisStore(url, lease=30.0, ttl=86400.0, *, prefix="oncely", connect_timeout=1.0,
    io_timeout=1.0, workers=4, in_progress_retry_after=1.0)``: ``url`` is
    ``redis://[user:password@]host:port/db``; ``lease`` is how long a claim lasts
    without renewal (renewed every lease/3 while ``fn`` runs; a crashed leader's key is
    taken over after it); ``ttl`` keeps completed results. Durations are seconds or
    ``timedelta``. Redis unreachable or too slow → ``StoreUnavailableError`` and ``fn``
    does not run.
    """

    @overload
    async def execute(
        self,
        scoped: ScopedKey,
        fingerprint: str,
        fn: Callable[[], Awaitable[T]],
        /,
        *,
        wait: bool = True,
    ) -> Executed[T]: ...

    @overload
    async def execute(
        self,
        scoped: ScopedKey,
        fingerprint: str,
        fn: Callable[[], T],
        /,
        *,
        wait: bool = True,
    ) -> Executed[T]: ...

    async def execute(
        self,
        scoped: ScopedKey,
        fingerprint: str,
        fn: Callable[[], Any],
        /,
        *,
        wait: bool = True,
    ) -> Executed[Any]:
        """Runs ``fn()`` (awaiting it if it returns an awaitable) at most once per
        ``scoped`` key across every instance sharing this Redis, within the TTL (the
        rules of :meth:`IdempotencyStore.execute`). Waiting never blocks the event loop.
        ``fn`` runs in a task of its own: if the caller is cancelled, it stops waiting
        at once, while the action runs on with its claim renewed, and its outcome is
        stored and given to the waiters as usual."""
        ident = self.record_key(scoped)
        check_reentrant(ident, scoped)
        while True:
            out = await _wait(self.begin(scoped, fingerprint, wait))
            cls = out.__class__
            if cls is Executed:
                return out  # type: ignore[no-any-return]
            if out is None:
                continue  # the leader went away: claim again
            if cls is not RedisLease:
                _raise(out)
            return await lead(ident, functools.partial(self._lead, out, fn))

    async def _lead(
        self, lease: RedisLease, fn: Callable[[], Any], frame: Leading
    ) -> Executed[Any]:
        try:
            try:
                value = await call(fn)
            finally:
                frame.active = False
            data = encode_result(value)
        except Exception as exc:
            await _wait(lease.fail(exc))
            raise
        except BaseException:
            lease.abandon()  # the action stopped (its task was cancelled): a waiter leads
            raise
        done = await _wait(lease.complete(data, value))
        if done.__class__ is Executed:
            return done
        _raise(done)

    def execute_sync(
        self,
        scoped: ScopedKey,
        fingerprint: str,
        fn: Callable[[], T],
        /,
        *,
        wait: bool = True,
    ) -> Executed[T]:
        """The blocking variant of :meth:`execute`: runs ``fn()`` on this thread if
        this call leads; every wait on Redis releases the GIL. An async function
        raises ``TypeError`` (use :meth:`execute`) before anything runs."""
        check_sync_action(fn, "RedisStore")
        ident = self.record_key(scoped)
        check_reentrant(ident, scoped)
        while True:
            out = self.begin(scoped, fingerprint, wait).wait()
            cls = out.__class__
            if cls is Executed:
                return out  # type: ignore[no-any-return]
            if out is None:
                continue
            if cls is not RedisLease:
                _raise(out)
            lease: RedisLease = out
            try:
                value = run_sync(ident, fn, "RedisStore")
                data = encode_result(value)
            except Exception as exc:
                lease.fail(exc).wait()
                raise
            except BaseException:
                lease.abandon()
                raise
            done = lease.complete(data, value).wait()
            if done.__class__ is Executed:
                return done
            _raise(done)
