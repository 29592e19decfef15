"""Bad input from Python gives the documented exception, never a crash."""

from __future__ import annotations

import math
from datetime import timedelta
from typing import Any

import oncely
import pytest
from oncely import Code, RetryPolicy, http

NAN, INF = math.nan, math.inf


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"max_attempts": 0}, "max_attempts"),
        ({"max_attempts": -1}, "max_attempts"),
        ({"max_attempts": 2**40}, "max_attempts"),
        ({"max_attempts": 10**100}, "max_attempts"),
        ({"base_delay": -0.01}, "base_delay"),
        ({"base_delay": NAN}, "base_delay"),
        ({"base_delay": INF}, "base_delay"),
        ({"base_delay": 1e30}, "base_delay"),
        ({"base_delay": timedelta(seconds=-1)}, "base_delay"),
        ({"max_delay": NAN}, "max_delay"),
        ({"base_delay": 2.0, "max_delay": 1.0}, "base_delay"),
        ({"multiplier": 0.5}, "multiplier"),
        ({"multiplier": NAN}, "multiplier"),
        ({"multiplier": INF}, "multiplier"),
        ({"jitter": 1.0}, "jitter"),
        ({"jitter": -0.1}, "jitter"),
        ({"jitter": NAN}, "jitter"),
        ({"seed": -1}, "seed"),
        ({"seed": 2**64}, "seed"),
        ({"min_attempt": -1}, "min_attempt"),
    ],
)
def test_invalid_policy_names_the_field(kwargs: dict[str, Any], field: str) -> None:
    with pytest.raises(oncely.InvalidArgumentError) as info:
        RetryPolicy(**kwargs)
    assert isinstance(info.value, ValueError)
    assert info.value.field == field
    assert info.value.code == Code.INVALID_ARGUMENT
    assert field in str(info.value)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"max_attempts": "3"},
        {"max_attempts": 3.0},
        {"max_attempts": True},
        {"base_delay": "0.1"},
        {"base_delay": True},
        {"jitter": "0.1"},
        {"seed": 1.5},
    ],
)
def test_wrong_types_are_type_errors(kwargs: dict[str, Any]) -> None:
    with pytest.raises(TypeError) as info:
        RetryPolicy(**kwargs)
    assert next(iter(kwargs)) in str(info.value)


def test_timedelta_and_int_seconds_are_accepted() -> None:
    p = RetryPolicy(base_delay=timedelta(milliseconds=50), max_delay=2)
    assert p.base_delay == 0.05 and p.max_delay == 2.0
    assert p == RetryPolicy(base_delay=0.05, max_delay=2.0)
    assert "max_attempts=3" in repr(p)


@pytest.mark.parametrize(
    "key",
    [
        "has spaces in it",
        "short",
        "k" * 65,
        "x" * 1_000_000,
        "ключ-ключ-ключ",
        "abc:defgh",
        "abcdefg\x00h",
    ],
)
def test_bad_keys(key: str) -> None:
    with pytest.raises(oncely.InvalidKeyError) as info:
        oncely.validate_key(key)
    assert isinstance(info.value, ValueError) and info.value.field == "idempotency_key"
    with pytest.raises(oncely.InvalidKeyError):
        oncely.scope("acme", "CreateOrder", key)


def test_missing_key() -> None:
    with pytest.raises(oncely.MissingKeyError) as info:
        oncely.validate_key("")
    assert info.value.code == Code.INVALID_ARGUMENT
    # No protocol is in use here: both names of the key.
    assert "Idempotency-Key header" in str(info.value) and "x-idempotency-key" in str(info.value)


def test_scope_parts() -> None:
    k = oncely.new_key()
    for tenant, method, field in [
        ("", "m", "tenant"),
        ("t", "", "method"),
        ("t" * 1025, "m", "tenant"),
        ("t", "m" * 5000, "method"),
    ]:
        with pytest.raises(oncely.InvalidArgumentError) as info:
            oncely.scope(tenant, method, k)
        assert info.value.field == field
    with pytest.raises(TypeError):
        oncely.scope(1, "m", k)  # type: ignore[arg-type]
    with pytest.raises(oncely.InvalidArgumentError):
        oncely.derive_key("", "op")


@pytest.mark.parametrize(
    "value",
    [NAN, INF, {"a": NAN}, {1: "x"}, object(), {"a": {1, 2}}, b"bytes"],
)
def test_fingerprint_rejects_non_json(value: Any) -> None:
    with pytest.raises(oncely.InvalidArgumentError) as info:
        oncely.fingerprint(value)
    assert info.value.field == "value"


def test_fingerprint_deep_nesting_and_cycles_do_not_crash() -> None:
    deep: Any = []
    for _ in range(100_000):
        deep = [deep]
    with pytest.raises(oncely.InvalidArgumentError):
        oncely.fingerprint(deep)
    cyclic: list[Any] = []
    cyclic.append(cyclic)
    with pytest.raises(oncely.InvalidArgumentError):
        oncely.fingerprint(cyclic)
    assert len(oncely.fingerprint({"big": "x" * 10_000_000})) == 64


def test_fingerprint_big_ints_are_doubles() -> None:
    assert oncely.canonical_json(2**53 + 1) == b"9007199254740992"
    assert oncely.canonical_json(10**400 // 10**390) == b"10000000000"
    with pytest.raises(oncely.InvalidArgumentError):
        oncely.fingerprint(10**400)  # beyond a double


def test_store_settings() -> None:
    for kwargs, field in [
        ({"ttl": 0}, "ttl"),
        ({"ttl": -1.0}, "ttl"),
        ({"ttl": NAN}, "ttl"),
        ({"max_entries": 0}, "max_entries"),
        ({"max_entries": -5}, "max_entries"),
        ({"in_progress_retry_after": INF}, "in_progress_retry_after"),
    ]:
        with pytest.raises(oncely.InvalidArgumentError) as info:
            oncely.IdempotencyStore(**kwargs)
        assert info.value.field == field, kwargs
    with pytest.raises(TypeError):
        oncely.IdempotencyStore(ttl="1h")  # type: ignore[arg-type]
    store = oncely.IdempotencyStore()
    k = oncely.scope("t", "m", oncely.new_key())
    with pytest.raises(oncely.InvalidArgumentError) as info:
        store.execute_sync(k, "", lambda: 1)
    assert info.value.field == "fingerprint"
    with pytest.raises(oncely.InvalidArgumentError):
        store.execute_sync(k, "f" * 5000, lambda: 1)


def test_budget_and_clock_settings() -> None:
    for kwargs, field in [
        ({"ratio": -0.1}, "ratio"),
        ({"ratio": NAN}, "ratio"),
        ({"window": 0.001}, "window"),
        ({"window": -1}, "window"),
        ({"min_per_sec": -1}, "min_per_sec"),
    ]:
        with pytest.raises(oncely.InvalidArgumentError) as info:
            oncely.RetryBudget(**kwargs)
        assert info.value.field == field
    with pytest.raises(oncely.InvalidArgumentError):
        oncely.ManualClock().advance(-1)
    with pytest.raises(oncely.InvalidArgumentError):
        oncely.Deadline(NAN)


def test_codes() -> None:
    assert Code.from_http(429) is Code.RESOURCE_EXHAUSTED
    assert Code.parse("unavailable") is Code.UNAVAILABLE and Code.parse("14") is Code.UNAVAILABLE
    with pytest.raises(oncely.InvalidArgumentError):
        Code.parse("NOPE")
    with pytest.raises(oncely.InvalidArgumentError) as info:
        oncely.classify(17)
    assert info.value.field == "code"
    with pytest.raises(oncely.InvalidArgumentError):
        Code.from_http(70_000)
    with pytest.raises(TypeError):
        oncely.classify("UNAVAILABLE")  # type: ignore[arg-type]
    with pytest.raises(oncely.InvalidArgumentError):
        oncely.Failure(99)


def test_exception_hierarchy() -> None:
    subclasses = [
        oncely.InvalidArgumentError,
        oncely.InvalidKeyError,
        oncely.MissingKeyError,
        oncely.FingerprintMismatchError,
        oncely.InProgressError,
        oncely.LeaseLostError,
        oncely.CapacityError,
        oncely.StoreUnavailableError,
        oncely.LeaderPanickedError,
    ]
    assert all(issubclass(c, oncely.OncelyError) for c in subclasses)
    assert issubclass(oncely.InvalidKeyError, ValueError)
    codes = {c: c("x").code for c in subclasses}
    assert codes[oncely.FingerprintMismatchError] is Code.FAILED_PRECONDITION
    assert codes[oncely.InProgressError] is Code.ABORTED
    assert codes[oncely.CapacityError] is Code.RESOURCE_EXHAUSTED
    assert codes[oncely.StoreUnavailableError] is Code.UNAVAILABLE
    assert codes[oncely.LeaderPanickedError] is Code.INTERNAL


def test_leader_panicked_reaches_waiters() -> None:
    store = oncely.IdempotencyStore()
    k = oncely.scope("t", "m", oncely.new_key())
    lease = store.begin(k, "fp")
    join = store.begin(k, "fp")
    lease.panicked("segfault-like failure")
    exc, tb = join.wait()
    assert isinstance(exc, oncely.LeaderPanickedError) and exc.code == Code.INTERNAL
    assert "segfault-like failure" in str(exc)


def test_ints_beyond_a_double_are_refused_as_too_large() -> None:
    for make, field in [
        (lambda: oncely.RetryBudget(window=10**400), "window"),
        (lambda: oncely.Deadline(10**400), "deadline"),
        (lambda: oncely.RetryPolicy(base_delay=-(10**400)), "base_delay"),
        (lambda: oncely.parse_retry_after("1", 10**400), "now"),
    ]:
        with pytest.raises(oncely.InvalidArgumentError) as info:
            make()
        assert info.value.field == field


def test_a_clock_beyond_the_system_range_is_refused() -> None:
    for now in [1e19, -1e19]:
        with pytest.raises(oncely.InvalidArgumentError) as info:
            oncely.parse_retry_after("1", now)
        assert info.value.field == "now"


def test_a_lone_surrogate_in_a_header_does_not_hide_the_code() -> None:
    exc: Any = Exception("x")
    exc.code = 14
    exc.headers = {"retry-after": "\ud800", "grpc-retry-pushback-ms": "12\udfff"}
    assert oncely.code_of(exc) is Code.UNAVAILABLE
    f = oncely.failure_of(exc)
    assert not isinstance(f, int) and f.do_not_retry  # an unreadable pushback: do not retry


def _store_call(store: oncely.IdempotencyStore, scoped: Any, fp: Any) -> Any:
    return store.execute_sync(scoped, fp, lambda: 1)


_K = "order-0001"


@pytest.mark.parametrize(
    ("call", "field"),
    [
        (lambda: oncely.scope("acme", "Charge", None), "key"),
        (lambda: oncely.scope(None, "Charge", _K), "tenant"),
        (lambda: oncely.scope("acme", 7, _K), "method"),
        (lambda: oncely.validate_key(b"order-0001"), "key"),
        (lambda: oncely.derive_key(None, "charge"), "business_id"),
        (lambda: oncely.derive_key("order-42", 1.5), "operation"),
        (lambda: RetryPolicy(max_attempts="3"), "max_attempts"),
        (lambda: RetryPolicy(base_delay="0.1"), "base_delay"),
        (lambda: oncely.RetryBudget(window="10"), "window"),
        (lambda: oncely.IdempotencyStore(ttl="1d"), "ttl"),
        (lambda: oncely.IdempotencyStore(max_entries=1.5), "max_entries"),
        (lambda: _store_call(oncely.IdempotencyStore(), "acme/Charge/order-0001", "fp"), "scoped"),
        (
            lambda: _store_call(oncely.IdempotencyStore(), oncely.scope("a", "b", _K), None),
            "fingerprint",
        ),
        (lambda: oncely.classify(Code.UNAVAILABLE, safe="yes"), "safe"),
        (lambda: oncely.retry_sync(lambda: 1, budget=3), "budget"),
        (lambda: oncely.retry_sync(lambda: 1, policy=3, deadline=1.0), "policy"),
        (
            lambda: oncely.IdempotencyStore().execute_sync(
                oncely.scope("a", "b", _K), "fp", lambda: 1, wait="no"
            ),
            "wait",
        ),
        (
            lambda: oncely.IdempotencyStore(cache_permanent_failures="yes"),
            "cache_permanent_failures",
        ),
        (lambda: oncely.parse_retry_after(None), "value"),
        (lambda: oncely.parse_pushback_ms(250), "value"),
        (lambda: oncely.ReasonCodes().register(None, "UNAVAILABLE"), "reason"),
        (lambda: oncely.ReasonCodes().resolve(7), "reason"),
        (lambda: oncely.RedisStore(None), "url"),  # type: ignore[arg-type]
        (lambda: oncely.RedisStore("redis://127.0.0.1:1/0", prefix=3), "prefix"),
        (lambda: http.ServerConfig(methods=5), "methods"),  # type: ignore[arg-type]
        (lambda: http.ServerConfig(methods="POST"), "methods"),  # type: ignore[arg-type]
        (lambda: http.ServerConfig(methods=["POST", 1]), "methods"),  # type: ignore[list-item]
        (lambda: http.ServerConfig(stored_headers=("etag", None)), "stored_headers"),  # type: ignore[arg-type]
        (lambda: http.ServerConfig(grpc_methods={"/a/B"}), "grpc_methods"),  # type: ignore[arg-type]
        (lambda: http.ServerConfig(required=1), "required"),  # type: ignore[arg-type]
        (lambda: http.ServerConfig(wait="no"), "wait"),  # type: ignore[arg-type]
        (lambda: http.ServerConfig(body_cap="1MiB"), "body_cap"),  # type: ignore[arg-type]
        (lambda: http.ServerConfig(body_cap=True), "body_cap"),  # type: ignore[arg-type]
    ],
)
def test_a_wrong_type_is_an_oncely_type_error_naming_the_argument(call: Any, field: str) -> None:
    with pytest.raises(oncely.ArgumentTypeError) as info:
        call()
    e = info.value
    assert (
        isinstance(e, TypeError) and isinstance(e, ValueError) and isinstance(e, oncely.OncelyError)
    )
    assert (e.field, e.code, e.kind, e.http_status) == (
        field,
        Code.INVALID_ARGUMENT,
        "invalid_argument",
        400,
    )
    assert str(e).startswith(f"{field} must be "), str(e)


def test_an_async_action_for_execute_sync_names_fn() -> None:
    async def action() -> int:
        return 1

    with pytest.raises(oncely.ArgumentTypeError) as info:
        oncely.IdempotencyStore().execute_sync(oncely.scope("a", "b", _K), "fp", action)
    assert isinstance(info.value, TypeError) and info.value.field == "fn"


@pytest.mark.parametrize(
    ("make", "field", "message"),
    [
        (
            lambda: RetryPolicy(base_delay=2.0, max_delay=1.0),
            "base_delay",
            "invalid base_delay: must not exceed max_delay (1 (seconds)), got 2",
        ),
        (
            lambda: RetryPolicy(max_attempts=0),
            "max_attempts",
            "invalid max_attempts: must be at least 1 (it counts the first attempt), e.g. 3, got 0",
        ),
        (
            lambda: oncely.RetryBudget(window=0.001),
            "window",
            "invalid window: must be at least 0.01 (seconds), e.g. 10, got 0.001",
        ),
        (
            lambda: oncely.IdempotencyStore(ttl=0),
            "ttl",
            "invalid ttl: must be greater than 0 (seconds), e.g. 86400 (a day), got 0",
        ),
        (
            lambda: oncely.RedisStore("redis://127.0.0.1:1/0", lease=0),
            "lease",
            "invalid lease: must be at least 0.03 (seconds), e.g. 30, got 0",
        ),
        (
            lambda: oncely.RedisStore("redis://127.0.0.1:1/0", lease=0.05, io_timeout=1.0),
            "lease",
            "invalid lease: must be at least 3 × io_timeout (1 (seconds)), got 0.05",
        ),
    ],
)
def test_messages_use_the_option_name_and_unit_with_an_example(
    make: Any, field: str, message: str
) -> None:
    with pytest.raises(oncely.InvalidArgumentError) as info:
        make()
    assert info.value.field == field
    assert str(info.value).startswith(message), str(info.value)


def test_a_redis_url_that_does_not_parse_shows_the_expected_form() -> None:
    with pytest.raises(oncely.InvalidArgumentError) as info:
        oncely.RedisStore("localhost:6379")
    assert info.value.field == "url"
    assert "expected redis://host:6379/0" in str(info.value)


def test_server_config_reads_sequences_and_names_bad_values() -> None:
    c = http.ServerConfig(methods=("POST", "PATCH"), stored_headers=["ETag"], required=None)
    assert c.covers("POST") and c.covers("PATCH") and not c.covers("PUT") and c.required
    with pytest.raises(oncely.InvalidArgumentError) as info:
        http.ServerConfig(body_cap=-1)
    assert info.value.field == "body_cap"
    with pytest.raises(oncely.InvalidArgumentError) as info:
        http.ServerConfig(body_cap=1 << 70)
    assert info.value.field == "body_cap"


def _asgi_app(scope: Any, receive: Any, send: Any) -> None:
    raise AssertionError("not called")


def _adapters() -> list[tuple[str, Any]]:
    from oncely.asgi import IdempotencyMiddleware as Asgi
    from oncely.wsgi import IdempotencyMiddleware as Wsgi

    out: list[tuple[str, Any]] = [
        ("asgi", lambda **kw: Asgi(_asgi_app, **kw)),
        ("wsgi", lambda **kw: Wsgi(_asgi_app, **kw)),
    ]
    try:
        from oncely.grpc import IdempotencyInterceptor
        from oncely.grpc.aio import IdempotencyInterceptor as AioInterceptor
    except ImportError:  # grpcio is an optional extra
        return out
    out.append(("grpc", IdempotencyInterceptor))
    out.append(("grpc.aio", AioInterceptor))
    return out


@pytest.mark.parametrize(("name", "make"), _adapters())
@pytest.mark.parametrize(
    ("options", "field"),
    [
        ({"store": None}, "store"),
        ({"store": "redis://127.0.0.1:6379"}, "store"),
        ({"tenant": 5}, "tenant"),
        ({"on_replay": "log"}, "on_replay"),
        ({"counters": {}}, "counters"),
        ({"methods": "POST"}, "methods"),
        ({"methods": ["POST", None]}, "methods"),
        ({"required": "yes"}, "required"),
        ({"wait": 0}, "wait"),
    ],
)
def test_an_adapter_refuses_bad_options_when_built(
    name: str, make: Any, options: dict[str, Any], field: str
) -> None:
    kw: dict[str, Any] = {"store": oncely.IdempotencyStore()}
    kw.update(options)
    if name.startswith("grpc") and field == "methods" and options["methods"] == "POST":
        kw["methods"] = "/pkg.Svc/Call"
    with pytest.raises(oncely.ArgumentTypeError) as info:
        make(**kw)
    assert info.value.field == field


@pytest.mark.parametrize(
    ("options", "field"),
    [
        ({"fingerprint": b"fp"}, "fingerprint"),
        ({"route": 3}, "route"),
        ({"request_cap": "1MiB"}, "request_cap"),
        ({"body_cap": "1MiB"}, "body_cap"),
        ({"stored_headers": "etag"}, "stored_headers"),
    ],
)
def test_an_http_adapter_refuses_bad_options_when_built(
    options: dict[str, Any], field: str
) -> None:
    from oncely.asgi import IdempotencyMiddleware as Asgi
    from oncely.wsgi import IdempotencyMiddleware as Wsgi

    for make in (Asgi, Wsgi):
        with pytest.raises(oncely.ArgumentTypeError) as info:
            make(_asgi_app, store=oncely.IdempotencyStore(), **options)
        assert info.value.field == field
