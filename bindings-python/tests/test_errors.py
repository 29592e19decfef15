"""Every oncely exception names its kind and the HTTP status a server answers with it,
the same names and statuses as the Rust core and the Node package."""

from __future__ import annotations

import asyncio
import threading

import oncely
import pytest
from oncely import IdempotencyStore

FP = oncely.fingerprint({"sku": "A1"})
OTHER_FP = oncely.fingerprint({"sku": "B2"})


def test_bad_keys_are_400() -> None:
    with pytest.raises(oncely.InvalidKeyError) as info:
        oncely.validate_key("short")
    assert (info.value.kind, info.value.http_status) == ("invalid_argument", 400)
    with pytest.raises(oncely.MissingKeyError) as missing:
        oncely.validate_key("")
    assert (missing.value.kind, missing.value.http_status) == ("missing_key", 400)
    with pytest.raises(oncely.InvalidArgumentError) as bad:
        oncely.RetryPolicy(max_attempts=0)
    assert (bad.value.kind, bad.value.http_status) == ("invalid_argument", 400)


async def test_mismatch_is_422_and_in_progress_is_409() -> None:
    store = IdempotencyStore()
    k = oncely.scope("acme", "Charge", oncely.new_key())
    await store.execute(k, FP, lambda: "done")
    with pytest.raises(oncely.FingerprintMismatchError) as mismatch:
        await store.execute(k, OTHER_FP, lambda: "never")
    assert (mismatch.value.kind, mismatch.value.http_status) == ("fingerprint_mismatch", 422)

    k2 = oncely.scope("acme", "Charge", oncely.new_key())
    release = asyncio.Event()

    async def slow() -> str:
        await release.wait()
        return "done"

    running = asyncio.ensure_future(store.execute(k2, FP, slow))
    await asyncio.sleep(0.01)
    with pytest.raises(oncely.InProgressError) as busy:
        await store.execute(k2, FP, slow, wait=False)
    assert (busy.value.kind, busy.value.http_status) == ("in_progress", 409)
    release.set()
    await running


def test_reentrant_call_is_500() -> None:
    store = IdempotencyStore()
    k = oncely.scope("acme", "Charge", oncely.new_key())
    seen: list[BaseException] = []

    def action() -> str:
        try:
            store.execute_sync(k, FP, lambda: "inner")
        except oncely.ReentrantCallError as e:
            seen.append(e)
        return "outer"

    t = threading.Thread(target=lambda: store.execute_sync(k, FP, action))
    t.start()
    t.join(10)
    assert len(seen) == 1
    assert (seen[0].kind, seen[0].http_status) == ("reentrant", 500)  # type: ignore[attr-defined]


def test_class_defaults_match_the_core() -> None:
    # Raised errors carry the core's kind and status; the class attributes (for errors
    # made by hand) say the same.
    assert oncely.InProgressError("x").http_status == 409
    assert oncely.FingerprintMismatchError("x").kind == "fingerprint_mismatch"
    assert oncely.StoreUnavailableError("x").http_status == 503
    assert oncely.CapacityError("x").http_status == 503


def test_http_status_of_every_error_kind() -> None:
    def caught(fn: object) -> BaseException:
        try:
            fn()  # type: ignore[operator]
        except BaseException as e:  # noqa: BLE001 - the error is the value under test
            return e
        raise AssertionError("no error")

    cases = [
        (caught(lambda: oncely.validate_key("short")), 400),
        (caught(lambda: oncely.validate_key("bad key!")), 400),
        (caught(lambda: oncely.validate_key("")), 400),
        (caught(lambda: oncely.scope("acme", "Charge", None)), 400),
        (caught(lambda: oncely.RetryPolicy(jitter=2.0)), 400),
        (oncely.FingerprintMismatchError("x"), 422),
        (oncely.InProgressError("x", retry_after=1.0), 409),
        (oncely.LeaseLostError("x"), 409),
        (oncely.CapacityError("x"), 503),
        (oncely.StoreUnavailableError("x"), 503),
        (oncely.LeaderPanickedError("x"), 500),
        (oncely.ReentrantCallError("x"), 500),
        (oncely.ResultNotStoredError("x"), 500),
    ]
    assert [oncely.http_status_of(e) for e, _ in cases] == [s for _, s in cases]
    assert oncely.http_status_of(ValueError("not ours")) is None
    assert oncely.http_status_of(KeyError("k")) is None


def test_a_store_unavailable_error_from_redis_is_503() -> None:
    store = oncely.RedisStore("redis://127.0.0.1:1/0", connect_timeout=0.2)
    k = oncely.scope("acme", "Charge", oncely.new_key())
    with pytest.raises(oncely.StoreUnavailableError) as info:
        store.execute_sync(k, FP, lambda: "never")
    assert (oncely.http_status_of(info.value), info.value.kind) == (503, "unavailable")
