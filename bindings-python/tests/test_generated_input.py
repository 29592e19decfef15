"""Generated bad input (hypothesis) for every public function and constructor.

Whatever a caller passes, only the documented exceptions come out (``OncelyError``
subclasses, ``TypeError``, ``ValueError``): never a crash, never a hang (each store
call is bounded), never a leaked lease (after an ``execute`` that raised, the key is
free). The default profile keeps the suite short; ``ONCELY_HYPOTHESIS_PROFILE=soak``
(with ``ONCELY_HYPOTHESIS_EXAMPLES``, default 20,000) runs the long form, without the
suite's per-test timeout.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import threading
from datetime import timedelta
from typing import Any, Callable, Optional

import oncely
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from oncely import Code

settings.register_profile(
    "default",
    max_examples=40,
    deadline=None,
    database=None,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.register_profile(
    "soak",
    max_examples=int(os.environ.get("ONCELY_HYPOTHESIS_EXAMPLES", "20000")),
    deadline=None,
    database=None,
    print_blob=True,
    suppress_health_check=list(HealthCheck),
)
settings.load_profile(os.environ.get("ONCELY_HYPOTHESIS_PROFILE", "default"))
if settings().max_examples > 1000:
    # A long run outlasts the suite's per-test timeout; each store call stays bounded.
    pytestmark = pytest.mark.timeout(0)

DOCUMENTED = (oncely.OncelyError, TypeError, ValueError)
# A store call that has not returned after this long is a hang.
HANG = 20.0


def documented(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """``fn(*args, **kwargs)``, or None if it raised a documented exception."""
    try:
        return fn(*args, **kwargs)
    except DOCUMENTED:
        return None


def bounded(fn: Callable[[], Any]) -> Any:
    """Runs ``fn`` on a thread and fails the example if it does not end within HANG."""
    out: dict[str, Any] = {}

    def run() -> None:
        try:
            out["value"] = fn()
        except BaseException as exc:  # handed to the test thread
            out["error"] = exc

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(HANG)
    assert not t.is_alive(), f"hung for {HANG} s"
    if "error" in out:
        raise out["error"]
    return out.get("value")


# ---- strategies ----------------------------------------------------------------------

lone_surrogates = st.integers(0xD800, 0xDFFF).map(chr)
any_char = st.one_of(st.characters(), lone_surrogates)
texts = st.one_of(
    st.text(),
    st.text(any_char, max_size=20),
    st.text("abcXYZ019_-:%/{} ", max_size=70),
    st.from_regex(r"[A-Za-z0-9_-]{6,66}", fullmatch=True),
)
floats = st.one_of(
    st.floats(),
    st.sampled_from(
        [math.nan, math.inf, -math.inf, -0.0, 5e-324, 1.8e308, 2.0**64, 1e19, -1e19, 1e-9]
    ),
)
ints = st.one_of(
    st.integers(-5, 100),
    st.integers(),
    st.sampled_from([2**31, 2**32, 2**53 + 1, 2**63, 2**64, -(2**63) - 1, 10**400]),
)
durations = st.one_of(
    floats,
    ints,
    st.builds(timedelta, seconds=st.floats(-1e9, 1e9, allow_nan=False)),
    st.just(timedelta.max),
    st.just(timedelta.min),
)


class Weird:
    """An object of no type a caller should pass."""

    def __index__(self) -> int:
        raise ZeroDivisionError("no index")

    def __float__(self) -> float:
        raise ZeroDivisionError("no float")


anything = st.one_of(
    st.none(),
    st.booleans(),
    ints,
    floats,
    texts,
    st.binary(max_size=20),
    durations,
    st.builds(Weird),
    st.builds(object),
    st.lists(st.integers(), max_size=3),
)


class Deep:
    """``depth`` levels of lists and dicts around ``leaf``, built when the test runs (so
    that hypothesis never has to print it)."""

    def __init__(self, depth: int, leaf: Any) -> None:
        self.depth, self.leaf = depth, leaf

    def __repr__(self) -> str:
        return f"Deep({self.depth}, {self.leaf!r})"

    def build(self) -> Any:
        value = self.leaf
        for i in range(self.depth):
            value = [value] if i % 2 else {"k": value}
        return value


def build(value: Any) -> Any:
    return value.build() if isinstance(value, Deep) else value


json_like = st.recursive(
    st.one_of(
        st.none(),
        st.booleans(),
        ints,
        floats,
        st.text(any_char, max_size=10),
        st.binary(max_size=8),
    ),
    lambda inner: st.one_of(
        st.lists(inner, max_size=4),
        st.lists(inner, max_size=4).map(tuple),
        st.dictionaries(st.text(any_char, max_size=6), inner, max_size=4),
        st.dictionaries(st.one_of(st.integers(), st.none(), st.booleans()), inner, max_size=2),
        st.frozensets(st.integers(), max_size=3),
    ),
    max_leaves=20,
)
values = st.one_of(
    json_like,
    st.builds(Deep, st.integers(0, 200_000), st.one_of(st.none(), st.integers(), st.text())),
)


def plain_json(value: Any) -> bool:
    """Whether ``value`` is JSON data a fingerprint is documented to accept."""
    if value is None or isinstance(value, bool):
        return True
    if isinstance(value, int):
        return abs(value) < 2**1000
    if isinstance(value, float):
        return math.isfinite(value)
    if isinstance(value, str):
        return not any(0xD800 <= ord(c) <= 0xDFFF for c in value)
    if isinstance(value, (list, tuple)):
        return all(plain_json(v) for v in value)
    if isinstance(value, dict):
        return all(isinstance(k, str) and plain_json(k) and plain_json(v) for k, v in value.items())
    return False


# ---- policies, deadlines, budgets, clocks --------------------------------------------

POLICY_FIELDS = [
    "max_attempts",
    "base_delay",
    "max_delay",
    "multiplier",
    "jitter",
    "seed",
    "min_attempt",
]


@given(st.dictionaries(st.sampled_from(POLICY_FIELDS), anything), st.integers(), st.integers())
def test_policies(kwargs: dict[str, Any], n: int, seed: int) -> None:
    policy = documented(oncely.RetryPolicy, **kwargs)
    if policy is None:
        return
    delays = documented(policy.backoff)
    # backoff() lists at most 100,000 delays (documented); delay_after(n) has them all.
    assert (delays is None) == (policy.max_attempts - 1 > 100_000)
    if delays is not None:
        assert len(delays) == policy.max_attempts - 1
        assert all(math.isfinite(d) and d >= 0 for d in delays)
    for fn, args in [(policy.delay_after, (n,)), (policy.delay_with_seed, (n, seed))]:
        d = documented(fn, *args)
        assert d is None or (math.isfinite(d) and d >= 0)
    assert policy == oncely.RetryPolicy(**kwargs)


@given(
    anything,
    anything,
    st.dictionaries(st.sampled_from(["ratio", "window", "min_per_sec"]), anything),
)
def test_deadlines_clocks_budgets(seconds: Any, step: Any, budget: dict[str, Any]) -> None:
    clock = oncely.ManualClock()
    documented(clock.advance, step)
    documented(clock.set, step)
    assert math.isfinite(clock.now()) and clock.now() >= 0
    for d in [
        documented(oncely.Deadline, seconds),
        documented(oncely.Deadline, seconds, _clock=clock),
    ]:
        if d is not None:
            assert d.remaining() >= 0
            assert isinstance(d.expired, bool)
    b = documented(oncely.RetryBudget, **budget)
    if b is not None:
        b.record_request()
        assert isinstance(b.try_withdraw(), bool)
        assert b.snapshot().requests >= 1


# ---- keys, scopes, fingerprints -------------------------------------------------------


@given(texts, texts, texts)
def test_keys_and_scopes(tenant: str, method: str, key: str) -> None:
    valid = documented(oncely.validate_key, key)
    if valid is not None:
        assert valid == key
    derived = documented(oncely.derive_key, tenant, method)
    if derived is not None:
        assert oncely.validate_key(derived) == derived
        assert derived == oncely.derive_key(tenant, method)
    scoped = documented(oncely.scope, tenant, method, key)
    if scoped is not None:
        assert valid is not None
        assert scoped.value.startswith("v1:") and scoped.value.isascii()
        assert scoped == oncely.scope(tenant, method, key)
    for bad in [None, 1, b"key-0001", Weird()]:
        with pytest.raises(DOCUMENTED):
            oncely.scope(bad, method, key)  # type: ignore[arg-type]


@given(values)
def test_fingerprints(generated: Any) -> None:
    value = build(generated)
    fp = documented(oncely.fingerprint, value)
    canonical = documented(oncely.canonical_json, value)
    assert (fp is None) == (canonical is None)
    if isinstance(generated, Deep):
        # Deep nesting is refused past the documented depth, never a crash.
        assert fp is not None or generated.depth > 100
        return
    if plain_json(value):
        assert fp is not None, f"plain JSON refused: {value!r}"
    if canonical is None:
        return
    assert len(fp) == 64 and fp == oncely.fingerprint_bytes(canonical)
    back = json.loads(canonical)
    assert oncely.canonical_json(back) == canonical
    if isinstance(value, dict) and all(isinstance(k, str) for k in value):
        assert oncely.fingerprint(dict(reversed(list(value.items())))) == fp


@given(st.one_of(st.binary(), anything))
def test_fingerprint_bytes(data: Any) -> None:
    fp = documented(oncely.fingerprint_bytes, data)
    if isinstance(data, bytes):
        assert fp is not None and len(fp) == 64


# ---- server delays, codes, classification ---------------------------------------------


@given(st.one_of(texts, anything), st.one_of(st.none(), anything))
def test_server_delay_parsers(value: Any, now: Any) -> None:
    d = documented(oncely.parse_retry_after, value, now)
    assert d is None or (d >= 0 and not math.isnan(d))
    p = documented(oncely.parse_pushback_ms, value)
    assert p is None or p >= 0 or math.isinf(p) is False


@given(anything, anything, st.one_of(texts, anything), st.one_of(texts, anything))
def test_codes_and_failures(code: Any, delay: Any, reason: Any, header: Any) -> None:
    documented(oncely.classify, code)
    documented(Code.from_http, code)
    documented(Code.parse, reason)
    documented(oncely.Failure, code, delay)
    documented(
        oncely.Failure.from_headers, code, {"retry-after": header, "grpc-retry-pushback-ms": header}
    )
    reasons = oncely.ReasonCodes()
    documented(reasons.register, reason, code)
    r = documented(reasons.resolve, reason)
    assert r is None or 0 <= r <= 16


# ---- foreign exceptions -----------------------------------------------------------------


class Boom(Exception):
    """What a raising property raises."""


ATTRS = ["code", "status", "status_code", "headers", "response", "retry_after", "errno", "details"]


def raising(exc: type[BaseException]) -> property:
    def get(self: Any) -> Any:
        raise exc("cannot read")

    return property(get)


class Headers(dict[str, Any]):
    """A mapping whose ``get`` may raise."""

    def __init__(self, items: dict[str, Any], fail: bool) -> None:
        super().__init__(items)
        self.fail = fail

    def get(self, key: str, default: Any = None) -> Any:
        if self.fail:
            raise Boom("headers")
        return super().get(key, default)


header_values = st.one_of(
    texts,
    st.binary(max_size=30),
    anything,
    st.sampled_from(["-0", "1", "Sun, 06 Nov 1994 08:49:37 GMT"]),
)
headers = st.builds(
    Headers,
    st.dictionaries(
        st.sampled_from(
            ["retry-after", "Retry-After", "grpc-retry-pushback-ms", "grpc-status-details-bin", "x"]
        ),
        header_values,
        max_size=3,
    ),
    st.booleans(),
)


@st.composite
def foreign_exceptions(draw: st.DrawFn, depth: int = 0) -> BaseException:
    """An exception of a made-up class with any attributes, some of them raising."""
    base = draw(
        st.sampled_from(
            [
                Exception,
                OSError,
                ConnectionResetError,
                TimeoutError,
                ValueError,
                oncely.StoreUnavailableError,
            ]
        )
    )
    name = draw(
        st.one_of(
            st.sampled_from(["HTTPError", "RpcError", "E"]),
            st.text(any_char, min_size=1, max_size=8),
        )
    )
    namespace: dict[str, Any] = {}
    attrs: dict[str, Any] = {}
    for attr in draw(st.lists(st.sampled_from(ATTRS), max_size=4, unique=True)):
        kind = draw(st.sampled_from(["value", "raising", "callable"]))
        if kind == "raising":
            namespace[attr] = raising(
                draw(st.sampled_from([Boom, AttributeError, TypeError, RecursionError]))
            )
        elif attr == "headers":
            attrs[attr] = draw(headers)
        elif attr == "response":
            attrs[attr] = type(
                "Response", (), {"status_code": draw(anything), "headers": draw(headers)}
            )()
        elif kind == "callable":
            v = draw(anything)
            attrs[attr] = lambda v=v: v
        else:
            attrs[attr] = draw(
                st.one_of(
                    anything,
                    st.integers(0, 16),
                    st.sampled_from(["UNAVAILABLE", "ECONNRESET", "RATE_LIMITED"]),
                )
            )
    try:
        cls = type(name, (base,), namespace)
    except (TypeError, ValueError):
        cls = type("E", (base,), namespace)
    message = draw(texts)
    try:
        exc = cls(message)
    except AttributeError:  # a base whose __init__ sets what a raising property shadows
        exc = type("E", (Exception,), namespace)(message)
    for attr, v in attrs.items():
        try:
            setattr(exc, attr, v)
        except (AttributeError, TypeError):
            pass
    if depth < 5 and draw(st.booleans()):
        exc.__cause__ = draw(foreign_exceptions(depth + 1))
    assert isinstance(exc, BaseException)
    return exc


@given(foreign_exceptions(), st.booleans())
def test_reading_foreign_exceptions_never_raises(exc: BaseException, with_reasons: bool) -> None:
    reasons = oncely.ReasonCodes() if with_reasons else None
    f = oncely.failure_of(exc, reasons)
    code = oncely.code_of(exc, reasons)
    assert isinstance(code, Code)
    assert (f if isinstance(f, int) else f.code) == int(code)


@given(st.integers(0, 16), headers, st.text(any_char, min_size=1, max_size=8))
def test_a_readable_code_is_read_whatever_else_the_error_carries(
    code: int, hdrs: Headers, name: str
) -> None:
    hdrs.fail = False
    try:
        cls = type(name, (Exception,), {})
    except (TypeError, ValueError):
        cls = type("E", (Exception,), {})
    exc: Any = cls("x")
    exc.code = code
    exc.headers = hdrs
    assert oncely.code_of(exc) == Code(code)


@given(st.lists(foreign_exceptions(), min_size=1, max_size=3), st.booleans())
def test_retry_raises_the_callers_own_exception(excs: list[BaseException], safe: bool) -> None:
    calls = iter(excs + excs[-1:] * 3)

    def fn() -> None:
        raise next(calls)

    policy = oncely.RetryPolicy(max_attempts=len(excs), base_delay=0, max_delay=0)
    with pytest.raises(Exception) as info:
        bounded(lambda: oncely.retry_sync(fn, policy=policy, safe=safe, _sleep=lambda s: None))
    assert info.value in excs


# ---- stores -----------------------------------------------------------------------------

STORE_FIELDS = ["ttl", "max_entries", "in_progress_retry_after", "cache_permanent_failures"]


@given(st.dictionaries(st.sampled_from(STORE_FIELDS), anything))
def test_memory_store_options(kwargs: dict[str, Any]) -> None:
    store = documented(oncely.IdempotencyStore, **kwargs)
    if store is not None:
        k = oncely.scope("t", "m", oncely.new_key())
        assert bounded(lambda: store.execute_sync(k, "fp", lambda: 7)).value == 7
        assert store.execute_sync(k, "fp", lambda: 8).value == 7


REDIS_FIELDS = [
    "lease",
    "ttl",
    "prefix",
    "connect_timeout",
    "io_timeout",
    "workers",
    "in_progress_retry_after",
    "max_result_bytes",
]
URLS = st.one_of(
    texts,
    anything,
    st.sampled_from(
        [
            "redis://127.0.0.1:1/0",
            "redis://",
            "redis://h:99999",
            "rediss://x",
            "unix:///nope",
            "redis://[::1/",
        ]
    ),
)


@given(URLS, st.dictionaries(st.sampled_from(REDIS_FIELDS), st.one_of(anything, texts)))
def test_redis_store_options(url: Any, kwargs: dict[str, Any]) -> None:
    store = bounded(lambda: documented(oncely.RedisStore, url, **kwargs))
    if store is not None and isinstance(url, str) and url.startswith("redis://127.0.0.1:1/"):
        k = oncely.scope("t", "m", oncely.new_key())
        with pytest.raises(oncely.StoreUnavailableError):
            bounded(lambda: store.execute_sync(k, "fp", lambda: 1))


def actions() -> st.SearchStrategy[tuple[str, Any]]:
    return st.one_of(
        st.tuples(st.just("return"), values),
        st.tuples(st.just("raise"), foreign_exceptions()),
    )


def check_execute(store: Any, fp: str, action: tuple[str, Any]) -> None:
    """Runs ``action`` under a fresh key twice; the second call must replay or run."""
    k = oncely.scope("tenant", "Method", oncely.new_key())
    kind, payload = action
    ran: list[int] = []

    def first() -> Any:
        ran.append(1)
        if kind == "raise":
            raise payload
        return payload

    def second() -> Any:
        ran.append(2)
        return "second"

    if kind == "return":
        payload = build(payload)
    try:
        out = bounded(lambda: store.execute_sync(k, fp, first))
        assert kind == "return" and out.value is payload and out.source == "led"
    except BaseException as exc:
        if exc is not payload:
            assert isinstance(exc, DOCUMENTED), repr(exc)
            assert not isinstance(exc, oncely.StoreUnavailableError), repr(exc)
    try:
        again = bounded(lambda: store.execute_sync(k, fp, second))
    except BaseException as exc:
        # A failure cached as permanent, or a result that could not be stored, replays
        # as its error; the action does not run again.
        assert ran == [1]
        assert exc is payload or isinstance(exc, oncely.ResultNotStoredError), repr(exc)
        return
    if ran == [1, 2]:
        assert kind == "raise" and again.value == "second", "a completed key ran again"
    else:
        assert ran == [1] and again.replayed


@given(actions(), st.booleans())
def test_memory_store_execute_never_leaks_a_lease(action: tuple[str, Any], cache: bool) -> None:
    store = oncely.IdempotencyStore(cache_permanent_failures=cache)
    check_execute(store, "fp", action)
    assert len(store) <= 1


@given(actions())
def test_memory_store_async_execute_never_leaks_a_lease(action: tuple[str, Any]) -> None:
    store = oncely.IdempotencyStore()
    k = oncely.scope("tenant", "Method", oncely.new_key())
    kind, payload = action
    payload = build(payload)

    async def first() -> Any:
        if kind == "raise":
            raise payload
        return payload

    async def main() -> None:
        try:
            await asyncio.wait_for(store.execute(k, "fp", first), HANG)
        except BaseException as exc:
            # (The action's own exception may be a TimeoutError too.)
            assert not isinstance(exc, asyncio.TimeoutError) or exc is payload, "execute hung"
            assert kind == "raise" and exc is payload, repr(exc)
        again = await asyncio.wait_for(store.execute(k, "fp", lambda: "second"), HANG)
        assert again.value == ("second" if kind == "raise" else payload)

    asyncio.run(main())


REDIS_URL: Optional[str] = os.environ.get("ONCELY_REDIS_URL")


@pytest.mark.skipif(not REDIS_URL, reason="needs a Redis: run scripts/test-redis")
@settings(max_examples=int(os.environ.get("ONCELY_HYPOTHESIS_REDIS_EXAMPLES", "25")))
@given(actions())
def test_redis_store_execute_never_leaks_a_lease(action: tuple[str, Any]) -> None:
    store = _redis_store()
    check_execute(store, "fp", action)


_REDIS: list[Any] = []


def _redis_store() -> Any:
    if not _REDIS:
        assert REDIS_URL is not None
        _REDIS.append(oncely.RedisStore(REDIS_URL, lease=5.0, prefix="oncely-generated"))
    return _REDIS[0]


@given(texts)
def test_execute_rejects_bad_fingerprints_without_running(fp: str) -> None:
    store = oncely.IdempotencyStore()
    k = oncely.scope("t", "m", oncely.new_key())
    ran: list[int] = []
    out = documented(lambda: bounded(lambda: store.execute_sync(k, fp, lambda: ran.append(1))))
    assert (out is None) == (not ran)
    assume(out is not None)
    assert store.execute_sync(k, fp, lambda: ran.append(2)).replayed and ran == [1]
