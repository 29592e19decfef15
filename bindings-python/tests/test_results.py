"""Results that are "no value" in the in-process store: ``None`` is a result like any
other (run once, replayed as ``None``)."""

from __future__ import annotations

import asyncio

import oncely

FP = oncely.fingerprint({"op": "notify"})


async def test_none_is_a_result_in_the_memory_store() -> None:
    store = oncely.IdempotencyStore()
    k = oncely.scope("acme", "Notify", oncely.new_key())
    runs = []

    async def action() -> None:
        runs.append(1)
        await asyncio.sleep(0.02)

    done = await asyncio.gather(*(store.execute(k, FP, action) for _ in range(3)))
    assert [d.value for d in done] == [None, None, None]
    again = await store.execute(k, FP, action)
    assert (again.value, again.source) == (None, "replayed")
    assert store.execute_sync(k, FP, lambda: runs.append(2)).value is None
    assert runs == [1]
