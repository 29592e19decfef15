"""The retry loops: every stop reason, server delays, hooks, cancellation, decorators and
the extraction of codes from client exceptions."""

from __future__ import annotations

import asyncio
import errno
import time
from datetime import timedelta
from typing import Any

import oncely
import pytest
from oncely import Code, RetryBudget, RetryPolicy

FAST = RetryPolicy(max_attempts=4, base_delay=0.0, max_delay=0.0, jitter=0.0)


class Flaky:
    """Fails with the given exceptions in turn, then returns `value`."""

    def __init__(self, *errors: BaseException, value: Any = "ok") -> None:
        self.errors = list(errors)
        self.calls = 0
        self.value = value

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self.calls += 1
        self.args = (args, kwargs)
        if self.errors:
            raise self.errors.pop(0)
        return self.value

    async def acall(self, *args: Any, **kwargs: Any) -> Any:
        return self(*args, **kwargs)


async def test_success_passes_arguments_and_result() -> None:
    f = Flaky(value=41)
    assert await oncely.retry(f.acall, 1, 2, x=3) == 41
    assert f.calls == 1 and f.args == ((1, 2), {"x": 3})


async def test_retries_unavailable_on_a_safe_call() -> None:
    f = Flaky(ConnectionError("reset"), ConnectionResetError("reset"))
    assert await oncely.retry(f.acall, policy=FAST, safe=True) == "ok"
    assert f.calls == 3


async def test_stop_not_retryable_reraises_the_same_exception() -> None:
    err = ConnectionError("reset")
    f = Flaky(err)
    with pytest.raises(ConnectionError) as info:
        await oncely.retry(f.acall, policy=FAST)  # not safe: the outcome is unknown
    assert info.value is err
    assert err.attempts == 1 and err.stop_reason == "not_retryable"  # type: ignore[attr-defined]
    assert err.__notes__ == [
        "oncely: gave up after 1 attempt (not_retryable: the first attempt may have been applied"
        " and the call is not safe to resend (declare it safe when it is idempotent or carries"
        " an idempotency key) (rule unsafe_to_resend))"
    ]
    assert f.calls == 1


async def test_unknown_exceptions_are_not_retried() -> None:
    f = Flaky(KeyError("x"))
    with pytest.raises(KeyError) as info:
        await oncely.retry(f.acall, policy=FAST, safe=True)
    assert info.value.stop_reason == "not_retryable"  # type: ignore[attr-defined]


async def test_stop_attempts_exhausted() -> None:
    f = Flaky(*[TimeoutError() for _ in range(10)])
    with pytest.raises(TimeoutError) as info:
        await oncely.retry(f.acall, policy=FAST, safe=True)
    assert f.calls == 4
    assert (info.value.attempts, info.value.stop_reason) == (4, "attempts_exhausted")  # type: ignore[attr-defined]
    assert "gave up after 4 attempts (attempts_exhausted: " in info.value.__notes__[0]


async def test_an_in_progress_answer_is_resent_by_a_safe_call_after_its_delay() -> None:
    busy = oncely.InProgressError("busy", retry_after=0.25)
    f = Flaky(busy, oncely.InProgressError("busy", retry_after=0.25))
    slept: list[float] = []
    events: list[oncely.RetryEvent] = []

    async def sleep(s: float) -> None:
        slept.append(s)

    got = await oncely.retry(f.acall, policy=FAST, safe=True, on_retry=events.append, _sleep=sleep)
    assert got == "ok" and f.calls == 3 and slept == [0.25, 0.25]
    assert [(e.rule, e.from_server) for e in events] == [("in_progress_keyed", True)] * 2


def test_an_in_progress_answer_is_not_resent_by_a_call_that_is_not_safe_and_the_note_says_why() -> (
    None
):
    f = Flaky(oncely.InProgressError("busy", retry_after=0.25))
    with pytest.raises(oncely.InProgressError) as info:
        oncely.retry_sync(f, policy=FAST, _sleep=lambda s: None)
    assert f.calls == 1 and info.value.stop_reason == "not_retryable"  # type: ignore[attr-defined]
    (note,) = info.value.__notes__
    assert note.startswith("oncely: gave up after 1 attempt (not_retryable: a conflict (ABORTED)")
    assert note.endswith("(rule conflict_needs_reread))")


def test_classify_counts_the_server_delay_of_a_failure() -> None:
    in_progress = oncely.Failure(Code.ABORTED, delay=1.0)
    assert oncely.classify(in_progress, safe=True) == oncely.classify(in_progress, safe=True)
    assert (
        oncely.classify(in_progress, safe=True).rule,
        oncely.classify(Code.ABORTED, safe=True).rule,
    ) == (
        "in_progress_keyed",
        "conflict_needs_reread",
    )


async def test_stop_deadline_never_sleeps_into_a_dead_attempt() -> None:
    policy = RetryPolicy(base_delay=0.5, max_delay=1.0, jitter=0.0)
    f = Flaky(ConnectionError(), ConnectionError())
    started = time.monotonic()
    with pytest.raises(ConnectionError) as info:
        await oncely.retry(f.acall, policy=policy, safe=True, deadline=0.3)
    assert time.monotonic() - started < 0.25
    assert info.value.stop_reason == "deadline"  # type: ignore[attr-defined]
    assert f.calls == 1


async def test_deadline_accepts_timedelta_and_deadline_objects() -> None:
    f = Flaky(ConnectionError())
    with pytest.raises(ConnectionError) as info:
        await oncely.retry(f.acall, safe=True, deadline=timedelta(milliseconds=10))
    assert info.value.stop_reason == "deadline"  # type: ignore[attr-defined]
    d = oncely.Deadline(5.0)
    assert 4.9 < d.remaining() <= 5.0 and not d.expired
    assert (
        await oncely.retry(Flaky(ConnectionError()).acall, policy=FAST, safe=True, deadline=d)
        == "ok"
    )


async def test_stop_budget() -> None:
    clock = oncely.ManualClock()
    budget = RetryBudget(ratio=0.0, window=10.0, min_per_sec=0, _clock=clock)
    f = Flaky(ConnectionError())
    with pytest.raises(ConnectionError) as info:
        await oncely.retry(f.acall, policy=FAST, safe=True, budget=budget)
    assert info.value.stop_reason == "budget"  # type: ignore[attr-defined]
    assert budget.snapshot().requests == 1


def test_budget_allows_ratio_of_requests() -> None:
    clock = oncely.ManualClock()
    budget = RetryBudget(0.1, 10.0, 0, _clock=clock)
    for _ in range(20):
        budget.record_request()
    assert [budget.try_withdraw() for _ in range(3)] == [True, True, False]
    clock.advance(11.0)
    assert budget.snapshot().requests == 0


class ServerSaysNo(Exception):
    code = Code.RESOURCE_EXHAUSTED


async def test_stop_server_said_no_via_classify() -> None:
    f = Flaky(ServerSaysNo())
    with pytest.raises(ServerSaysNo) as info:
        await oncely.retry(
            f.acall,
            policy=FAST,
            classify=lambda e: oncely.Failure(Code.RESOURCE_EXHAUSTED, do_not_retry=True),
        )
    assert info.value.stop_reason == "server_said_no"  # type: ignore[attr-defined]


async def test_server_delay_overrides_backoff_and_on_retry_sees_it() -> None:
    events: list[oncely.RetryEvent] = []
    f = Flaky(ServerSaysNo(), ServerSaysNo())
    slept: list[float] = []

    async def sleep(d: float) -> None:
        slept.append(d)

    result = await oncely.retry(
        f.acall,
        policy=RetryPolicy(base_delay=0.01, jitter=0.0),
        classify=lambda e: (
            oncely.Failure(Code.RESOURCE_EXHAUSTED, delay=0.25) if f.calls == 1 else None
        ),
        on_retry=events.append,
        _sleep=sleep,
    )
    assert result == "ok"
    assert slept == [0.25, 0.02]
    assert [(e.attempt, e.delay, e.rule, e.from_server) for e in events] == [
        (1, 0.25, "rate_limited", True),
        (2, 0.02, "rate_limited", False),
    ]
    assert all(isinstance(e.error, ServerSaysNo) for e in events)


async def test_cancellation_during_sleep_stops_at_once() -> None:
    f = Flaky(*[ConnectionError() for _ in range(10)])
    policy = RetryPolicy(max_attempts=10, base_delay=30.0, max_delay=30.0)
    task = asyncio.ensure_future(oncely.retry(f.acall, policy=policy, safe=True))
    await asyncio.sleep(0.05)
    assert f.calls == 1
    started = time.monotonic()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert time.monotonic() - started < 1.0
    assert f.calls == 1


async def test_cancellation_of_the_attempt_is_not_retried() -> None:
    calls = 0

    async def slow() -> None:
        nonlocal calls
        calls += 1
        await asyncio.sleep(10)

    task = asyncio.ensure_future(oncely.retry(slow, policy=FAST, safe=True))
    await asyncio.sleep(0.01)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert calls == 1


def test_retry_sync_sleeps_and_retries() -> None:
    f = Flaky(TimeoutError(), TimeoutError())
    policy = RetryPolicy(base_delay=0.01, jitter=0.0)
    started = time.monotonic()
    assert oncely.retry_sync(f, policy=policy, safe=True) == "ok"
    assert time.monotonic() - started >= 0.03 - 0.005  # 10 ms + 20 ms
    assert f.calls == 3


def test_seeded_delays_are_the_cores() -> None:
    p = RetryPolicy(max_attempts=3, seed=42)
    assert [round(d * 1000) for d in p.backoff()] == [22, 35]
    events: list[oncely.RetryEvent] = []
    f = Flaky(ConnectionError(), ConnectionError())
    oncely.retry_sync(f, policy=p, safe=True, on_retry=events.append, _sleep=lambda d: None)
    assert [round(e.delay * 1000) for e in events] == [22, 35]


def test_decorator_on_sync_and_async_functions() -> None:
    flaky = Flaky(ConnectionError())

    @oncely.retrying(policy=FAST, safe=True)
    def double(n: int) -> int:
        flaky()
        return n * 2

    assert double(21) == 42 and flaky.calls == 2
    assert double.__name__ == "double"

    aflaky = Flaky(ConnectionError(), ConnectionError())

    @oncely.retrying(policy=FAST, safe=True)
    async def adouble(n: int) -> int:
        aflaky()
        return n * 2

    assert asyncio.run(adouble(4)) == 8 and aflaky.calls == 3
    assert asyncio.iscoroutinefunction(adouble)

    @oncely.retrying(policy=FAST)
    def never(n: int) -> int:
        raise ConnectionError("not safe")

    with pytest.raises(ConnectionError) as info:
        never(1)
    assert info.value.stop_reason == "not_retryable"  # type: ignore[attr-defined]


def test_on_retry_exception_propagates() -> None:
    def hook(e: oncely.RetryEvent) -> None:
        raise RuntimeError("hook failed")

    with pytest.raises(RuntimeError, match="hook failed"):
        oncely.retry_sync(Flaky(ConnectionError()), policy=FAST, safe=True, on_retry=hook)


# --- extraction --------------------------------------------------------------------------


class FakeStatus:
    """Like grpc.StatusCode members: .value == (number, name)."""

    def __init__(self, n: int, name: str) -> None:
        self.value = (n, name.lower())
        self.name = name


class FakeRpcError(Exception):
    """Duck-types grpc.RpcError / grpc.aio.AioRpcError."""

    def __init__(self, code: Code, trailers: tuple[tuple[str, str], ...] = ()) -> None:
        self._code = FakeStatus(int(code), code.name)
        self._trailers = trailers

    def code(self) -> FakeStatus:
        return self._code

    def trailing_metadata(self) -> tuple[tuple[str, str], ...]:
        return self._trailers


class FakeResponse:
    def __init__(self, status: int, headers: dict[str, str] | None = None) -> None:
        self.status_code = status
        self.headers = headers or {}


class FakeHTTPStatusError(Exception):
    """Duck-types httpx.HTTPStatusError / requests.HTTPError (a .response)."""

    def __init__(self, status: int, headers: dict[str, str] | None = None) -> None:
        self.response = FakeResponse(status, headers)


class FakeClientResponseError(Exception):
    """Duck-types aiohttp.ClientResponseError (.status, .headers)."""

    def __init__(self, status: int, headers: dict[str, str] | None = None) -> None:
        self.status = status
        self.headers = headers


def _delay(f: Any) -> Any:
    return None if isinstance(f, int) else (f.code, f.delay, f.do_not_retry)


def test_extraction_table() -> None:
    assert oncely.code_of(ConnectionResetError()) == Code.UNAVAILABLE
    assert oncely.code_of(TimeoutError()) == Code.DEADLINE_EXCEEDED
    assert oncely.code_of(asyncio.TimeoutError()) == Code.DEADLINE_EXCEEDED
    assert oncely.code_of(ValueError()) == Code.UNKNOWN
    assert oncely.code_of(FakeRpcError(Code.UNAVAILABLE)) == Code.UNAVAILABLE
    assert _delay(
        oncely.failure_of(
            FakeRpcError(Code.RESOURCE_EXHAUSTED, (("grpc-retry-pushback-ms", "250"),))
        )
    ) == (8, 0.25, False)
    assert _delay(
        oncely.failure_of(FakeRpcError(Code.UNAVAILABLE, (("grpc-retry-pushback-ms", "-1"),)))
    ) == (14, None, True)
    # a malformed pushback means do not retry (gRFC A6)
    assert _delay(
        oncely.failure_of(FakeRpcError(Code.UNAVAILABLE, (("grpc-retry-pushback-ms", "soon"),)))
    ) == (14, None, True)
    assert oncely.code_of(FakeHTTPStatusError(503)) == Code.UNAVAILABLE
    assert _delay(oncely.failure_of(FakeHTTPStatusError(429, {"Retry-After": "3"}))) == (
        8,
        3.0,
        False,
    )
    assert _delay(oncely.failure_of(FakeClientResponseError(429, {"Retry-After": "1"}))) == (
        8,
        1.0,
        False,
    )
    assert oncely.failure_of(FakeClientResponseError(404, None)) == Code.NOT_FOUND

    class WithCode(Exception):
        def __init__(self, code: Any) -> None:
            self.code = code

    assert oncely.code_of(WithCode(14)) == Code.UNAVAILABLE
    assert oncely.code_of(WithCode("resource_exhausted")) == Code.RESOURCE_EXHAUSTED
    assert oncely.code_of(WithCode(Code.ABORTED)) == Code.ABORTED
    assert oncely.code_of(WithCode(503)) == Code.UNAVAILABLE  # urllib.error.HTTPError style
    assert oncely.code_of(WithCode("nonsense")) == Code.UNKNOWN

    class WithStatusCode(Exception):
        status_code = 429

    assert oncely.code_of(WithStatusCode()) == Code.RESOURCE_EXHAUSTED
    err = oncely.InProgressError("busy", retry_after=2.0)
    assert _delay(oncely.failure_of(err)) == (10, 2.0, False)

    # an OSError's errno, by its name
    assert oncely.code_of(OSError(errno.ETIMEDOUT, "timed out")) == Code.DEADLINE_EXCEEDED
    # the __cause__ chain: a wrapper raised from a socket error
    wrapper = RuntimeError("request failed")
    wrapper.__cause__ = ConnectionResetError()
    assert oncely.code_of(wrapper) == Code.UNAVAILABLE
    # reason codes: built-in and registered
    assert oncely.code_of(WithCode("RATE_LIMITED")) == Code.RESOURCE_EXHAUSTED
    reasons = oncely.ReasonCodes()
    reasons.register("PAYMENT_PENDING", "UNAVAILABLE")
    assert oncely.code_of(WithCode("PAYMENT_PENDING")) == Code.UNKNOWN
    assert oncely.code_of(WithCode("PAYMENT_PENDING"), reasons) == Code.UNAVAILABLE
    with pytest.raises(oncely.InvalidArgumentError):
        reasons.register("RATE_LIMITED", Code.UNAVAILABLE)


def test_retry_understands_registered_reasons() -> None:
    reasons = oncely.ReasonCodes()
    reasons.register("PAYMENT_PENDING", Code.UNAVAILABLE)
    calls = []

    class Pending(Exception):
        code = "PAYMENT_PENDING"

    def pending() -> str:
        calls.append(1)
        if len(calls) < 2:
            raise Pending()
        return "paid"

    assert oncely.retry_sync(pending, safe=True, reasons=reasons, _sleep=lambda _s: None) == "paid"
    assert len(calls) == 2


def test_real_client_exceptions_when_installed() -> None:
    grpc = pytest.importorskip("grpc")

    class RpcError(grpc.RpcError):  # type: ignore[misc]
        def code(self) -> Any:
            return grpc.StatusCode.UNAVAILABLE

        def trailing_metadata(self) -> Any:
            return (("grpc-retry-pushback-ms", "100"),)

    assert _delay(oncely.failure_of(RpcError())) == (14, 0.1, False)
    aio = pytest.importorskip("grpc.aio")
    md = aio.Metadata(("grpc-retry-pushback-ms", "7"))
    e = aio.AioRpcError(grpc.StatusCode.RESOURCE_EXHAUSTED, aio.Metadata(), md)
    assert _delay(oncely.failure_of(e)) == (8, 0.007, False)


def test_httpx_exceptions_when_installed() -> None:
    httpx = pytest.importorskip("httpx")
    req = httpx.Request("POST", "http://127.0.0.1/orders")
    resp = httpx.Response(503, headers={"Retry-After": "2"}, request=req)
    e = httpx.HTTPStatusError("x", request=req, response=resp)
    assert _delay(oncely.failure_of(e)) == (14, 2.0, False)
    assert oncely.code_of(httpx.ConnectError("x")) == Code.UNAVAILABLE
    assert oncely.code_of(httpx.ReadTimeout("x")) == Code.DEADLINE_EXCEEDED


def test_requests_exceptions_when_installed() -> None:
    requests = pytest.importorskip("requests")
    resp = requests.Response()
    resp.status_code = 429
    resp.headers["Retry-After"] = "5"
    assert _delay(oncely.failure_of(requests.HTTPError(response=resp))) == (8, 5.0, False)
    assert oncely.code_of(requests.ConnectionError()) == Code.UNAVAILABLE
    assert oncely.code_of(requests.ReadTimeout()) == Code.DEADLINE_EXCEEDED


async def test_retry_through_a_grpc_style_error() -> None:
    f = Flaky(FakeRpcError(Code.UNAVAILABLE), FakeRpcError(Code.UNAVAILABLE))
    assert await oncely.retry(f.acall, policy=FAST, safe=True) == "ok"
    g = Flaky(FakeRpcError(Code.INVALID_ARGUMENT))
    with pytest.raises(FakeRpcError):
        await oncely.retry(g.acall, policy=FAST, safe=True)
    assert g.calls == 1


async def test_retry_waits_for_in_progress_then_gets_the_replay() -> None:
    store = oncely.IdempotencyStore()
    scoped = oncely.scope("t", "m", oncely.new_key())
    gate = asyncio.Event()

    async def slow() -> str:
        await gate.wait()
        return "done"

    leader = asyncio.ensure_future(store.execute(scoped, "fp", slow))
    await asyncio.sleep(0)

    async def no_wait() -> str:
        r = await store.execute(scoped, "fp", slow, wait=False)
        return r.value

    events: list[oncely.RetryEvent] = []
    asyncio.get_running_loop().call_later(0.05, gate.set)
    got = await oncely.retry(
        no_wait,
        policy=RetryPolicy(max_attempts=50),
        on_retry=events.append,
        classify=lambda e: (
            oncely.Failure(Code.UNAVAILABLE, delay=0.01)
            if isinstance(e, oncely.InProgressError)
            else None
        ),
        safe=True,
    )
    assert got == "done" and (await leader).value == "done"
    assert events and all(isinstance(e.error, oncely.InProgressError) for e in events)


async def test_the_action_is_told_its_attempt() -> None:
    seen: list[oncely.Attempt] = []

    async def action(x: int, *, attempt: oncely.Attempt) -> int:
        seen.append(attempt)
        if attempt.number < 3:
            raise ConnectionError()
        return x

    assert await oncely.retry(action, 7, policy=FAST, safe=True, pass_attempt=True) == 7
    assert [a.number for a in seen] == [1, 2, 3]
    assert [a.previous_attempts for a in seen] == [0, 1, 2]
    assert all(a.remaining is None for a in seen)
    seen.clear()
    oncely.retry_sync(
        lambda attempt: seen.append(attempt) or "ok", policy=FAST, deadline=5.0, pass_attempt=True
    )
    assert seen[0].number == 1 and seen[0].remaining is not None and 4.5 < seen[0].remaining <= 5.0
