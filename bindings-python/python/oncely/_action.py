"""How both stores run a leader's action (SPEC §6, "Python: work that cannot be
cancelled").

- ``execute`` calls ``fn()`` and awaits what it returns when that is awaitable, so an
  async function, a lambda returning a coroutine and a plain function all run once.
- The action runs in a task of its own, shielded from its caller: a cancelled caller
  stops waiting at once, while the action keeps the key until it has finished and
  settles it (its outcome reaches the waiters as usual). Python cannot tell a coroutine
  that stops when cancelled from one that waits on a thread (``asyncio.to_thread``,
  ``run_in_executor``), whose work would go on after the cancellation; so oncely never
  cancels an action. Its key goes on when it has ended: returned, raised, or its own
  task was cancelled (by its code or at loop shutdown) or left pending on a loop that
  was closed and dropped, which counts as stopped.
- While an action runs, a context variable names the key it leads; a call on that key
  from the action (or from anything started in its context: tasks, ``to_thread``)
  would wait for itself, and fails at once with ``ReentrantCallError`` instead.
- ``execute_sync`` refuses an async function before it touches the store.
"""

from __future__ import annotations

import asyncio
import inspect
import sys
import warnings
from contextvars import ContextVar
from typing import Any, Callable, Coroutine, Hashable, Optional, TypeVar

from . import _oncely
from ._oncely import ScopedKey
from .errors import ArgumentTypeError

T = TypeVar("T")


class Leading:
    """The mark of one running action: the key it leads, in the store it leads it in.
    ``active`` turns false when the action ends, so that tasks it started and that
    outlive it are not taken for it."""

    __slots__ = ("ident", "parent", "active")

    def __init__(self, ident: Hashable, parent: Optional[Leading]) -> None:
        self.ident = ident
        self.parent = parent
        self.active = True


_LEADING: ContextVar[Optional[Leading]] = ContextVar("oncely_leading", default=None)


def check_reentrant(ident: Hashable, scoped: ScopedKey) -> None:
    """Raises ``ReentrantCallError`` if this context runs the action leading ``ident``."""
    frame = _LEADING.get()
    while frame is not None:
        if frame.active and frame.ident == ident:
            raise _oncely.reentrant_error(scoped)
        frame = frame.parent


def check_sync_action(fn: Callable[[], Any], method: str) -> None:
    """``execute_sync`` runs ``fn()`` on the caller's thread and cannot await: an async
    function would store an un-run coroutine. Refused before anything runs."""
    if inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(
        getattr(fn, "__call__", None)  # noqa: B004 (an object with `async def __call__`)
    ):
        name = getattr(fn, "__qualname__", None) or type(fn).__qualname__
        raise ArgumentTypeError(
            f"{method}.execute_sync got an async function ({name}) as fn; it would not be "
            f"awaited. Use `await {method}.execute(...)` for async actions",
            field="fn",
        )


def run_sync(ident: Hashable, fn: Callable[[], T]) -> T:
    """Runs a blocking action marked as leading ``ident``. A plain function that
    returns a coroutine anyway has run: the coroutine is its result (stored as is, then
    :func:`warn_if_coroutine`), never a reason to run it again."""
    frame = Leading(ident, _LEADING.get())
    token = _LEADING.set(frame)
    try:
        return fn()
    finally:
        frame.active = False
        _LEADING.reset(token)


def warn_if_coroutine(value: Any, method: str) -> None:
    """Warns that ``execute_sync``'s action returned a coroutine. Called once the result
    is stored: a warning turned into an error (``-W error``) must not free the key."""
    if inspect.iscoroutine(value):
        warnings.warn(
            f"the action given to {method}.execute_sync returned a coroutine, which is its "
            f"result and is not awaited; use `await {method}.execute(...)` for async actions",
            RuntimeWarning,
            stacklevel=3,
        )


async def call(fn: Callable[[], Any]) -> Any:
    """``fn()``, awaited when it returns an awaitable (inside the action's task)."""
    value = fn()
    if inspect.isawaitable(value):
        value = await value
    return value


# The running actions' tasks (the loop keeps only weak references to tasks), in a set held
# by their loop itself, not by this module: a loop closed and dropped with an action still
# pending could never run it again, and its task, collected with the loop, closes the
# action (abandoning its lease) instead of holding its key for ever.
_RUNNING: set[asyncio.Task[Any]] = set()  # for loops that take no attributes


def _keep(loop: asyncio.AbstractEventLoop, task: asyncio.Task[Any]) -> None:
    running: Optional[set[asyncio.Task[Any]]] = getattr(loop, "_oncely_actions", None)
    if running is None:
        running = set()
        try:
            loop._oncely_actions = running  # type: ignore[attr-defined]
        except AttributeError:
            running = _RUNNING
    running.add(task)
    task.add_done_callback(running.discard)


# From Python 3.12 the action's task starts at once, on the caller's turn of the loop: an
# action that finishes without waiting costs no turn of the loop.
_EAGER: dict[str, Any] = {"eager_start": True} if sys.version_info >= (3, 12) else {}


class _Escaped:
    """A ``KeyboardInterrupt`` or ``SystemExit`` raised by an action. asyncio lets
    those out of a task straight through the event loop; carried back instead, it is
    raised in the caller's task, as it was when the action ran there. When the caller
    has gone, it goes out through the loop (never swallowed)."""

    __slots__ = ("exc",)

    def __init__(self, exc: BaseException) -> None:
        self.exc = exc


async def _drive(run: Coroutine[Any, Any, Any], outcome: asyncio.Future[Any]) -> None:
    """The action's task: runs ``run`` and hands its outcome to the caller's future,
    unless the caller has gone (its future is then cancelled)."""
    try:
        out = await run
    except (KeyboardInterrupt, SystemExit) as exc:
        if outcome.done():
            raise  # its caller has gone: out through the event loop, as asyncio does
        out = _Escaped(exc)
    except asyncio.CancelledError:
        outcome.cancel()  # the action's own task was cancelled: so is its caller
        raise
    except BaseException as exc:
        if not outcome.done():
            outcome.set_exception(exc)
        return
    if not outcome.done():
        outcome.set_result(out)


async def lead(ident: Hashable, run: Callable[[Leading], Coroutine[Any, Any, T]]) -> T:
    """Runs ``run(frame)`` (the action and the settling of its lease) in a task of its
    own, marked as leading ``ident``, and waits for it. Cancelling the caller stops
    the wait only: the task runs on and settles the lease. ``run`` turns
    ``frame.active`` off when the action ends."""
    loop = asyncio.get_running_loop()
    outcome: asyncio.Future[Any] = loop.create_future()
    frame = Leading(ident, _LEADING.get())
    token = _LEADING.set(frame)
    try:
        # The task copies the context, with the mark.
        task = asyncio.Task(_drive(run(frame), outcome), loop=loop, **_EAGER)
    finally:
        _LEADING.reset(token)
    if not task.done():
        _keep(loop, task)
    out = await outcome
    if isinstance(out, _Escaped):
        raise out.exc
    return out  # type: ignore[no-any-return]
