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
import os
import weakref
from datetime import timedelta
from typing import Any, Hashable, Optional

from ._codes import Code
from ._driver import Driver
from ._oncely import Executed, Lease, ManualClock, ScopedKey, _Store
from .extract import code_of

__all__ = ["IdempotencyStore", "Executed"]

# Every live store, so that a child made by fork() can forget the running entries it
# copied: their actions stayed with the parent's threads and would never settle here.
_LIVE: "weakref.WeakSet[IdempotencyStore]" = weakref.WeakSet()


def _forget_running_after_fork() -> None:
    for store in list(_LIVE):
        store._forget_running()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_running_after_fork)


class IdempotencyStore(_Store, Driver):
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

    _method = "IdempotencyStore"

    def _ident(self, scoped: ScopedKey) -> Hashable:
        return (self, scoped)

    def _settle_failure(self, lease: Lease, exc: Exception) -> None:
        lease.fail(exc, self._code(exc))

    def _settle_value(self, lease: Lease, stored: Any, value: Any) -> Executed[Any]:
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


def _settle_batch(items: list[tuple[asyncio.Future[Any], Any]]) -> None:
    """Runs on an event loop (scheduled by the native waker thread): hands each waiter
    its outcome, skipping waiters that were cancelled meanwhile."""
    for fut, out in items:
        if not fut.done():
            fut.set_result(out)
