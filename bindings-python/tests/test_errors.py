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
