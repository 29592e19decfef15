"""The dedup store: run an action at most once per scoped key (SPEC §6).

The state (who leads, who waits, what is stored until when) is the Rust core's
``MemoryStore``; this module only runs your function when the core says this caller
leads, and waits when it says join:

- ``await store.execute(scoped, fingerprint, fn)``: ``fn`` is an async callable;
  waiting is an ``asyncio`` future woken from the core (any thread, any loop);
- ``store.execute_sync(scoped, fingerprint, fn)``: for threads; waiting releases the GIL.

Both return an :class:`Executed` (``.value``, ``.source``, ``.replayed``). Every caller
gets the very object the leader returned. An exception raised by ``fn`` reaches the
leader and every waiter unchanged, and is not stored: a later call runs again.
"""

from __future__ import annotations

import asyncio
from typing import Any, Awaitable, Callable, TypeVar

from ._oncely import Executed, Join, Lease, ScopedKey, _Store
from .extract import code_of

__all__ = ["IdempotencyStore", "Executed"]

T = TypeVar("T")


class IdempotencyStore(_Store):
    """An in-process dedup store.

    ``IdempotencyStore(ttl=86400.0, max_entries=None, *, in_progress_retry_after=1.0,
    cache_permanent_failures=False)``: ``ttl`` (seconds or timedelta) keeps completed
    results; ``max_entries`` bounds memory (``None``: the default bound, 1,000,000
    entries; past it the oldest completed entries go first and are counted in
    ``counters().evictions``; running ones never); ``cache_permanent_failures`` stores
    failures whose code is permanent (e.g. INVALID_ARGUMENT) like results, until cleared
    with :meth:`remove`.
    """

    async def execute(
        self,
        scoped: ScopedKey,
        fingerprint: str,
        fn: Callable[[], Awaitable[T]],
        /,
        *,
        wait: bool = True,
    ) -> Executed[T]:
        """Runs ``await fn()`` at most once per ``scoped`` key within the TTL.

        - a stored result with the same fingerprint is replayed;
        - a running call with the same fingerprint is waited for and shared (with
          ``wait=False``: ``InProgressError`` at once, with ``retry_after``);
        - a different fingerprint raises ``FingerprintMismatchError``;
        - otherwise this call runs ``fn``. If its task is cancelled, one waiter takes
          over and runs its own ``fn``.
        """
        while True:
            begun = self.begin(scoped, fingerprint, wait)
            cls = begun.__class__
            if cls is Executed:
                return begun  # type: ignore[no-any-return]
            if cls is Lease:
                try:
                    value = await fn()
                except Exception as exc:
                    begun.fail(exc, code_of(exc) if self.caches_failures else None)
                    raise
                except BaseException:
                    begun.abandon()  # cancelled: a waiter takes over
                    raise
                return begun.complete(value)  # type: ignore[no-any-return]
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
        otherwise blocks the thread (GIL released) until the leader finishes."""
        while True:
            begun = self.begin(scoped, fingerprint, wait)
            cls = begun.__class__
            if cls is Executed:
                return begun  # type: ignore[no-any-return]
            if cls is Lease:
                try:
                    value = fn()
                except Exception as exc:
                    begun.fail(exc, code_of(exc) if self.caches_failures else None)
                    raise
                except BaseException:
                    begun.abandon()
                    raise
                return begun.complete(value)  # type: ignore[no-any-return]
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


