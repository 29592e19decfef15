"""The retry loops: ``await retry(...)``, ``retry_sync(...)`` and ``@retrying(...)``.

The loops only host the waiting. Each failure is reduced to a code (and the server's
delay) by :mod:`oncely.extract`, then the core's sans-IO ``RetryState`` decides: retry
after a delay, or stop with a reason (``not_retryable``, ``attempts_exhausted``,
``deadline``, ``budget``, ``server_said_no``). The success path does not cross into
the native module unless a deadline or a budget is set.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import sys
import time
from datetime import timedelta
from typing import (
    Any,
    Awaitable,
    Callable,
    Coroutine,
    NamedTuple,
    Optional,
    TypeVar,
    Union,
    overload,
)

from ._oncely import Deadline, ManualClock, ReasonCodes, RetryBudget, RetryPolicy, RetryState
from .extract import Classifier, classify_exception

if sys.version_info >= (3, 10):
    from typing import ParamSpec
else:  # pragma: no cover
    from typing_extensions import ParamSpec

__all__ = ["retry", "retry_sync", "retrying", "Attempt", "RetryEvent", "Seconds"]

T = TypeVar("T")
P = ParamSpec("P")

#: A duration: seconds as a float (or int), or a ``datetime.timedelta``.
Seconds = Union[float, timedelta]


class RetryEvent(NamedTuple):
    """What an ``on_retry`` hook sees before each retry."""

    #: The number of the attempt that failed (1 for the first).
    attempt: int
    #: Seconds until the next attempt.
    delay: float
    #: The exception of the failed attempt.
    error: BaseException
    #: The classification rule that allowed the retry (e.g. ``"transient_safe"``).
    rule: str
    #: Whether ``delay`` is the server's (Retry-After, pushback) rather than backoff.
    from_server: bool


class Attempt(NamedTuple):
    """What the action is told with ``pass_attempt=True`` (keyword ``attempt``): forward
    it as a per-attempt timeout or a ``grpc-previous-rpc-attempts`` header."""

    #: 1 for the first attempt, 2 for the first retry, ...
    number: int
    #: Seconds left before the call's deadline (None without a deadline).
    remaining: Optional[float]

    @property
    def previous_attempts(self) -> int:
        return self.number - 1


OnRetry = Callable[[RetryEvent], object]

_DEFAULT_POLICY = RetryPolicy()


def _state(
    policy: Optional[RetryPolicy],
    safe: bool,
    rereads: bool,
    transient_internal: bool,
    deadline: Union[Deadline, Seconds, None],
    budget: Optional[RetryBudget],
    clock: Optional[ManualClock],
) -> RetryState:
    return RetryState(
        policy if policy is not None else _DEFAULT_POLICY,
        safe=safe,
        rereads=rereads,
        transient_internal=transient_internal,
        deadline=deadline,
        budget=budget,
        clock=clock,
    )


def _attempt(state: Optional[RetryState]) -> Attempt:
    if state is None:
        return Attempt(1, None)
    return Attempt(state.attempt, state.remaining())


def _give_up(exc: BaseException, attempts: int, reason: str, why: str) -> None:
    """Attaches the attempt count and the stop reason (attributes and a PEP 678 note)."""
    # Best effort: the user's exception is re-raised unchanged even when it refuses
    # attributes (__slots__, or a __getattr__ / __setattr__ that raises).
    try:
        exc.attempts = attempts  # type: ignore[attr-defined,unused-ignore]
        exc.stop_reason = reason  # type: ignore[attr-defined,unused-ignore]
    except Exception:  # the note still says it
        pass
    note = f"oncely: gave up after {attempts} attempt{'s' if attempts != 1 else ''} ({why})"
    try:
        if hasattr(exc, "add_note"):
            exc.add_note(note)
        else:  # pragma: no cover - Python < 3.11
            notes = getattr(exc, "__notes__", None)
            if notes is None:
                notes = []
                exc.__notes__ = notes  # type: ignore[attr-defined,unused-ignore]
            notes.append(note)
    except Exception:
        pass


def _decide(
    state: RetryState,
    exc: BaseException,
    classify: Optional[Classifier],
    on_retry: Optional[OnRetry],
    reasons: Optional[ReasonCodes] = None,
) -> Optional[float]:
    """The delay before the next attempt, or None after annotating ``exc`` (stop)."""
    attempt = state.attempt
    decision = state.on_failure(classify_exception(exc, classify, reasons))
    if isinstance(decision, str):
        _give_up(exc, attempt, decision, state.why_stopped() or decision)
        return None
    delay, rule, from_server = decision
    if on_retry is not None:
        on_retry(RetryEvent(attempt, delay, exc, rule, from_server))
    return delay


async def retry(
    fn: Callable[..., Awaitable[T]],
    /,
    *args: Any,
    policy: Optional[RetryPolicy] = None,
    deadline: Union[Deadline, Seconds, None] = None,
    safe: bool = False,
    rereads: bool = False,
    transient_internal: bool = False,
    budget: Optional[RetryBudget] = None,
    on_retry: Optional[OnRetry] = None,
    classify: Optional[Classifier] = None,
    reasons: Optional[ReasonCodes] = None,
    _clock: Optional[ManualClock] = None,
    pass_attempt: bool = False,
    _sleep: Optional[Callable[[float], Awaitable[object]]] = None,
    **kwargs: Any,
) -> T:
    """Calls ``await fn(*args, **kwargs)`` until it succeeds or the core says stop.

    ``safe``: the call is idempotent or carries an idempotency key (UNAVAILABLE and
    DEADLINE_EXCEEDED may then be retried). ``rereads``: each attempt re-reads state
    before writing (ABORTED may be retried). ``deadline``: seconds (or a ``Deadline``)
    for the whole call. ``budget``: a shared ``RetryBudget``. ``on_retry``: called with
    a :class:`RetryEvent` before each retry. ``classify``: maps an exception to a code
    or ``Failure`` (None: the built-in extraction). ``reasons``: the domain reason codes
    the extraction understands (a :class:`ReasonCodes`; default the built-in ones).
    ``pass_attempt``: ``fn`` also gets
    ``attempt=Attempt(number, remaining)``.

    On giving up, the last exception is re-raised unchanged, with ``attempts`` and
    ``stop_reason`` attributes and a note. Cancelling the task stops at once.
    """
    state = (
        None
        if deadline is None and budget is None
        else _state(policy, safe, rereads, transient_internal, deadline, budget, _clock)
    )
    while True:
        if pass_attempt:
            kwargs["attempt"] = _attempt(state)
        try:
            return await fn(*args, **kwargs)
        except Exception as exc:
            if state is None:
                state = _state(policy, safe, rereads, transient_internal, None, None, _clock)
            delay = _decide(state, exc, classify, on_retry, reasons)
            if delay is None:
                raise
        if delay > 0.0:
            await (asyncio.sleep(delay) if _sleep is None else _sleep(delay))


def retry_sync(
    fn: Callable[..., T],
    /,
    *args: Any,
    policy: Optional[RetryPolicy] = None,
    deadline: Union[Deadline, Seconds, None] = None,
    safe: bool = False,
    rereads: bool = False,
    transient_internal: bool = False,
    budget: Optional[RetryBudget] = None,
    on_retry: Optional[OnRetry] = None,
    classify: Optional[Classifier] = None,
    reasons: Optional[ReasonCodes] = None,
    _clock: Optional[ManualClock] = None,
    pass_attempt: bool = False,
    _sleep: Optional[Callable[[float], object]] = None,
    **kwargs: Any,
) -> T:
    """The blocking variant of :func:`retry` for thread-per-request code: sleeps with
    ``time.sleep``."""
    state = (
        None
        if deadline is None and budget is None
        else _state(policy, safe, rereads, transient_internal, deadline, budget, _clock)
    )
    while True:
        if pass_attempt:
            kwargs["attempt"] = _attempt(state)
        try:
            return fn(*args, **kwargs)
        except Exception as exc:
            if state is None:
                state = _state(policy, safe, rereads, transient_internal, None, None, _clock)
            delay = _decide(state, exc, classify, on_retry, reasons)
            if delay is None:
                raise
        if delay > 0.0:
            (time.sleep if _sleep is None else _sleep)(delay)


class _Retrying:
    """The decorator made by :func:`retrying`."""

    __slots__ = ("_options",)

    def __init__(self, options: dict[str, Any]) -> None:
        self._options = options

    @overload
    def __call__(
        self, fn: Callable[P, Coroutine[Any, Any, T]]
    ) -> Callable[P, Coroutine[Any, Any, T]]: ...

    @overload
    def __call__(self, fn: Callable[P, T]) -> Callable[P, T]: ...

    def __call__(self, fn: Callable[P, Any]) -> Callable[P, Any]:
        options = self._options
        if inspect.iscoroutinefunction(fn):

            @functools.wraps(fn)
            async def async_wrapper(*args: P.args, **kwargs: P.kwargs) -> Any:
                kw: dict[str, Any] = kwargs
                return await retry(fn, *args, **options, **kw)

            return async_wrapper

        @functools.wraps(fn)
        def sync_wrapper(*args: P.args, **kwargs: P.kwargs) -> Any:
            kw: dict[str, Any] = kwargs
            return retry_sync(fn, *args, **options, **kw)

        return sync_wrapper


def retrying(
    *,
    policy: Optional[RetryPolicy] = None,
    deadline: Union[Seconds, None] = None,
    safe: bool = False,
    rereads: bool = False,
    transient_internal: bool = False,
    budget: Optional[RetryBudget] = None,
    on_retry: Optional[OnRetry] = None,
    classify: Optional[Classifier] = None,
    reasons: Optional[ReasonCodes] = None,
) -> _Retrying:
    """A decorator that retries the function (``async def`` or plain) like
    :func:`retry` / :func:`retry_sync`, keeping its signature for type checkers.

    ``deadline`` is in seconds, counted from each call.
    """
    return _Retrying(
        {
            "policy": policy,
            "deadline": deadline,
            "safe": safe,
            "rereads": rereads,
            "transient_internal": transient_internal,
            "budget": budget,
            "on_retry": on_retry,
            "classify": classify,
            "reasons": reasons,
        }
    )
