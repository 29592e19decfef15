"""The dedup store: run an action at most once per scoped key (SPEC §6).

The state (who leads, who waits, what is stored until when) is the Rust core's
``MemoryStore``; this module only runs your function when the core says this caller
leads, and waits when it says join:

- ``await store.execute(scoped, fingerprint, fn)``: ``fn()`` is awaited when it returns
  an awaitable (an async function), and taken as is otherwise (a plain function runs
  once, on the event loop's thread); waiting is an ``asyncio`` future woken from the
  core (any thread, any loop);
- ``store.execute_sync(scoped, fingerprint, fn)``: for threads; waiting releases the GIL.
  An async function is refused with ``TypeError`` before anything runs.

Both return an :class:`Executed` (``.value``, ``.source``, ``.replayed``). Every caller
gets the very object the leader returned. An exception raised by ``fn`` reaches the
leader and every waiter unchanged, and is not stored: a later call runs again.

The action keeps its key until it has finished: it runs in a task of its own, so a
cancelled caller stops waiting at once while the action runs on and settles the key for
the waiters (see ``oncely._action``). An action that calls ``execute`` on the key it
leads gets ``ReentrantCallError`` at once.
"""

from __future__ import annotations

import asyncio
import functools
import os
import weakref
from datetime import timedelta
from typing import Any, Awaitable, Callable, Optional, TypeVar, overload

from ._action import (
    Leading,
    call,
    check_reentrant,
    check_sync_action,
    lead,
    run_sync,
    warn_if_coroutine,
)
from ._codes import Code
from ._oncely import Executed, Join, Lease, ManualClock, ScopedKey, _Store
from .extract import code_of

__all__ = ["IdempotencyStore", "Executed"]

T = TypeVar("T")

# Every live store, so that a child made by fork() can forget the running entries it
# copied: their actions stayed with the parent's threads and would never settle here.
_LIVE: "weakref.WeakSet[IdempotencyStore]" = weakref.WeakSet()


def _forget_running_after_fork() -> None:
    for store in list(_LIVE):
        store._forget_running()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_running_after_fork)


class IdempotencyStore(_Store):
    """An in-process dedup store.

    ``IdempotencyStore(ttl=86400.0, max_entries=None, *, in_progress_retry_after=1.0,
    cache_permanent_failures=False)``: ``ttl`` (seconds or timedelta) keeps completed
    results; ``max_entries`` bounds memory (``None``: the default bound, 1,000,000
    entries; past it the oldest completed entries go first and are counted in
    ``counters().evictions``; running ones never); ``cache_permanent_failures`` stores
    failures whose code is permanent (e.g. INVALID_ARGUMENT) like results, until cleared
    with :meth:`remove`.

    A store made before ``fork()`` works in the child: it keeps the completed results,
    and forgets the calls that were running in the parent (their actions stayed there),
    so their keys lead again in the child instead of waiting for ever.
    """

    def __init__(
        self,
        ttl: Optional[float | timedelta] = None,
        max_entries: Optional[int] = None,
        *,
        in_progress_retry_after: Optional[float | timedelta] = None,
        cache_permanent_failures: bool = False,
        _clock: Optional[ManualClock] = None,
    ) -> None:
        # The native __new__ has built the store from the same arguments.
        _LIVE.add(self)

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
        ``scoped`` key within the TTL.

        - a stored result with the same fingerprint is replayed;
        - a running call with the same fingerprint is waited for and shared (with
          ``wait=False``: ``InProgressError`` at once, with ``retry_after``);
        - a different fingerprint raises ``FingerprintMismatchError``;
        - otherwise this call runs ``fn``, in a task of its own. If the caller is
          cancelled, it stops waiting at once; the action runs on, keeps the key until
          it ends, and its outcome is stored and given to the waiters as usual;
        - a call from inside the action on the key it leads raises
          ``ReentrantCallError`` (it would wait for itself).
        """
        ident = (self, scoped)
        check_reentrant(ident, scoped)
        while True:
            begun = self.begin(scoped, fingerprint, wait)
            cls = begun.__class__
            if cls is Executed:
                return begun  # type: ignore[no-any-return]
            if cls is Lease:
                return await lead(ident, functools.partial(self._lead, begun, fn))
            if cls is Join:
                loop = asyncio.get_running_loop()
                fut = loop.create_future()
                out = begun.subscribe(loop, fut)
                if out is fut:
                    try:
                        out = await fut
                    except BaseException:
                        begun.cancel()  # this waiter leaves; the others go on
                        raise
                if out is None:
                    continue  # the leader went away: lead or join anew
                if out.__class__ is Executed:
                    return out
                begun = out
            error, tb = begun
            raise error.with_traceback(tb)

    async def _lead(self, lease: Lease, fn: Callable[[], Any], frame: Leading) -> Executed[Any]:
        try:
            try:
                value = await call(fn)
            finally:
                frame.active = False
        except Exception as exc:
            lease.fail(exc, self._code(exc))
            raise
        except BaseException:
            lease.abandon()  # the action stopped (its task was cancelled): a waiter leads
            raise
        return lease.complete(value)

    def _code(self, exc: BaseException) -> Optional[Code]:
        """The code to cache a failure under, if failures are cached. Reading a foreign
        exception never stops the lease from being settled (``failure_of`` reads an
        unreadable one as UNKNOWN; anything else going wrong: not cached)."""
        if not self.caches_failures:
            return None
        try:
            return code_of(exc)
        except Exception:
            return None

    def execute_sync(
        self,
        scoped: ScopedKey,
        fingerprint: str,
        fn: Callable[[], T],
        /,
        *,
        wait: bool = True,
    ) -> Executed[T]:
        """The blocking variant of :meth:`execute`: runs ``fn()`` if this call leads;
        otherwise blocks the thread (GIL released) until the leader finishes. An async
        function raises ``TypeError`` (use :meth:`execute`) before anything runs."""
        check_sync_action(fn, "IdempotencyStore")
        ident = (self, scoped)
        check_reentrant(ident, scoped)
        while True:
            begun = self.begin(scoped, fingerprint, wait)
            cls = begun.__class__
            if cls is Executed:
                return begun  # type: ignore[no-any-return]
            if cls is Lease:
                try:
                    value = run_sync(ident, fn)
                except Exception as exc:
                    begun.fail(exc, self._code(exc))
                    raise
                except BaseException:
                    begun.abandon()
                    raise
                done = begun.complete(value)
                warn_if_coroutine(value, "IdempotencyStore")
                return done  # type: ignore[no-any-return]
            if cls is Join:
                out = begun.wait()
                if out is None:
                    continue
                if out.__class__ is Executed:
                    return out
                begun = out
            error, tb = begun
            raise error.with_traceback(tb)


def _settle_batch(items: list[tuple[asyncio.Future[Any], Any]]) -> None:
    """Runs on an event loop (scheduled by the native waker thread): hands each waiter
    its outcome, skipping waiters that were cancelled meanwhile."""
    for fut, out in items:
        if not fut.done():
            fut.set_result(out)


