"""The one execute loop both stores run (SPEC §6): begin, then replay, wait, lead or
raise, as the native store answers.

A store supplies its native ``begin`` (an outcome, or a pending step to wait on: the
memory store's ``Join``, the Redis store's ``RedisPending``, both with
``subscribe``/``cancel``/``wait``) and four small hooks that say how its lease is
settled. Everything else (re-entrancy, the action's own task, what an interrupt
does, the order of settling and warning) is here once.
"""

from __future__ import annotations

import asyncio
import functools
from typing import (
    TYPE_CHECKING,
    Any,
    Awaitable,
    Callable,
    ClassVar,
    Hashable,
    NoReturn,
    TypeVar,
    overload,
)

from ._action import (
    Leading,
    call,
    check_reentrant,
    check_sync_action,
    lead,
    run_sync,
    warn_if_coroutine,
)
from ._oncely import Executed, Join, Lease, RedisLease, RedisPending, ScopedKey

T = TypeVar("T")

# The native steps that are waited on, and the native leases.
_PENDING = (Join, RedisPending)
_LEASES = (Lease, RedisLease)


async def wait_step(step: Any) -> Any:
    """Awaits a native pending step without blocking the event loop. A cancelled
    caller cancels the step (a claim won meanwhile is released; the other waiters go
    on)."""
    loop = asyncio.get_running_loop()
    fut = loop.create_future()
    out = step.subscribe(loop, fut)
    if out is fut:
        try:
            out = await fut
        except BaseException:
            step.cancel()
            if fut.done() and not fut.cancelled():
                # Answered in the turn that cancelled the caller: a claim won then is
                # released now, not held (and renewed) while the traceback keeps it.
                won = fut.result()
                if won.__class__ in _LEASES:
                    won.abandon()
            raise
    return out


def raise_outcome(out: Any) -> NoReturn:
    """Raises a failed outcome: an exception, or an ``(exception, traceback)`` pair."""
    if isinstance(out, BaseException):
        raise out
    error, tb = out
    raise error.with_traceback(tb)


class Driver:
    """``execute`` and ``execute_sync`` over a native store. Listed after the native
    base class, whose ``begin`` it calls."""

    _method: ClassVar[str]
    """The class name used in messages (``RedisStore.execute_sync got ...``)."""

    if TYPE_CHECKING:

        def begin(self, scoped: ScopedKey, fingerprint: str, wait: bool = True) -> Any: ...

    def _ident(self, scoped: ScopedKey) -> Hashable:
        """What marks a running action for re-entrancy checks."""
        raise NotImplementedError

    def _settle_failure(self, lease: Any, exc: Exception) -> Any:
        """Settles a lease whose action raised: None, or a step to wait on."""
        raise NotImplementedError

    def _encode(self, value: Any) -> Any:
        """What is stored for ``value``. May raise only when interrupted."""
        return value

    def _not_storable(self, value: Any) -> Any:
        """What is stored when encoding ``value`` was interrupted."""
        return value

    def _settle_value(self, lease: Any, stored: Any, value: Any) -> Any:
        """Settles a lease with a result: an ``Executed``, or a step to wait on."""
        raise NotImplementedError

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
        ``scoped`` key within the TTL, across every caller sharing this store.

        - a stored result with the same fingerprint is replayed;
        - a running call with the same fingerprint is waited for and shared (with
          ``wait=False``: ``InProgressError`` at once, with ``retry_after``); waiting
          never blocks the event loop;
        - a different fingerprint raises ``FingerprintMismatchError``;
        - otherwise this call runs ``fn``, in a task of its own. If the caller is
          cancelled, it stops waiting at once; the action runs on, keeps the key until
          it ends, and its outcome is stored and given to the waiters as usual;
        - a call from inside the action on the key it leads raises
          ``ReentrantCallError`` (it would wait for itself).
        """
        ident = self._ident(scoped)
        check_reentrant(ident, scoped)
        while True:
            out = self.begin(scoped, fingerprint, wait)
            if out.__class__ in _PENDING:
                out = await wait_step(out)
            cls = out.__class__
            if cls is Executed:
                return out  # type: ignore[no-any-return]
            if out is None:
                continue  # the leader went away: lead or join anew
            if cls in _LEASES:
                return await lead(ident, functools.partial(self._lead, out, fn))
            raise_outcome(out)

    async def _lead(self, lease: Any, fn: Callable[[], Any], frame: Leading) -> Executed[Any]:
        try:
            try:
                value = await call(fn)
            finally:
                frame.active = False
        except Exception as exc:
            step = self._settle_failure(lease, exc)
            if step is not None:
                await wait_step(step)
            raise
        except BaseException:
            lease.abandon()  # the action stopped (its task was cancelled): a waiter leads
            raise
        try:
            stored = self._encode(value)
        except BaseException:
            # Interrupted (Ctrl-C in a codec) after the action ran: the key keeps its
            # outcome, as not storable, instead of going to a leader that runs it again.
            step = self._settle_value(lease, self._not_storable(value), value)
            if step.__class__ in _PENDING:
                await wait_step(step)
            raise
        done = self._settle_value(lease, stored, value)
        if done.__class__ in _PENDING:
            done = await wait_step(done)
        if done.__class__ is Executed:
            return done
        raise_outcome(done)

    def execute_sync(
        self,
        scoped: ScopedKey,
        fingerprint: str,
        fn: Callable[[], T],
        /,
        *,
        wait: bool = True,
    ) -> Executed[T]:
        """The blocking variant of :meth:`execute`: runs ``fn()`` on this thread if this
        call leads; otherwise blocks the thread (GIL released) until the leader
        finishes, or until a signal handler raises (Ctrl-C: ``KeyboardInterrupt``; the
        leader runs on). An async function raises ``TypeError`` (use :meth:`execute`) before
        anything runs."""
        check_sync_action(fn, self._method)
        ident = self._ident(scoped)
        check_reentrant(ident, scoped)
        while True:
            out = self.begin(scoped, fingerprint, wait)
            if out.__class__ in _PENDING:
                out = out.wait()
            cls = out.__class__
            if cls is Executed:
                return out  # type: ignore[no-any-return]
            if out is None:
                continue
            if cls not in _LEASES:
                raise_outcome(out)
            lease = out
            try:
                value = run_sync(ident, fn)
            except Exception as exc:
                step = self._settle_failure(lease, exc)
                if step is not None:
                    step.wait()
                raise
            except BaseException:
                lease.abandon()
                raise
            try:
                stored = self._encode(value)
            except BaseException:
                step = self._settle_value(lease, self._not_storable(value), value)
                if step.__class__ in _PENDING:
                    step.wait()
                raise
            done = self._settle_value(lease, stored, value)
            if done.__class__ in _PENDING:
                done = done.wait()
            warn_if_coroutine(value, self._method)
            if done.__class__ is Executed:
                return done
            raise_outcome(done)
