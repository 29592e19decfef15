"""oncely.RedisStore on a Redis Cluster and on Sentinels.

The cluster tests read ONCELY_REDIS_CLUSTER_URLS and are skipped without it: run them
with scripts/test-redis, which starts a throwaway cluster (scripts/with-redis-cluster).
The checks of the settings need no Redis."""

from __future__ import annotations

import asyncio
import os
import threading

import oncely
import pytest
from oncely import InvalidArgumentError, RedisStore, StoreUnavailableError

URLS = os.environ.get("ONCELY_REDIS_CLUSTER_URLS", "").split()
needs_cluster = pytest.mark.skipif(not URLS, reason="needs a Redis Cluster: run scripts/test-redis")


def key() -> oncely.ScopedKey:
    return oncely.scope("acme", "CreateOrder", oncely.new_key())


def cluster_store(pfx: str, **kw: object) -> RedisStore:
    return RedisStore(URLS[:3], prefix=pfx, cluster=True, **kw)  # type: ignore[arg-type]


@needs_cluster
def test_every_key_runs_once_across_instances_and_slots() -> None:
    pfx = "pytest-" + oncely.new_key()
    stores = [cluster_store(pfx) for _ in range(3)]
    keys = [key() for _ in range(30)]
    runs = [0] * len(keys)
    lock = threading.Lock()

    def worker(t: int) -> None:
        s = stores[t % len(stores)]
        for j in range(len(keys)):
            i = (j * 7 + t * 11) % len(keys)

            def action(i: int = i) -> str:
                with lock:
                    runs[i] += 1
                return f"v{i}"

            done = s.execute_sync(keys[i], "fp", action)
            assert done.value == f"v{i}"

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
        assert not t.is_alive()
    assert runs == [1] * len(keys)
    # Each record is where the cluster says its slot is: reached through any seed.
    single_seed = RedisStore(URLS[1], prefix=pfx, cluster=True)
    for i, k in enumerate(keys):
        done = single_seed.execute_sync(k, "fp", lambda: "again")
        assert (done.value, done.source) == (f"v{i}", "replayed")


@needs_cluster
def test_async_callers_and_min_replicas() -> None:
    pfx = "pytest-" + oncely.new_key()

    async def main() -> None:
        # A generous window: a loaded machine may take a while to acknowledge (the
        # test checks that the acknowledgement comes, not how fast; below the 1 s I/O timeout).
        s = cluster_store(pfx, min_replicas=1, min_replicas_timeout=0.8)
        k = key()
        runs = 0

        async def action() -> dict[str, int]:
            nonlocal runs
            runs += 1
            await asyncio.sleep(0.01)
            return {"n": 1}

        got = await asyncio.gather(*(s.execute(k, "fp", action) for _ in range(10)))
        assert runs == 1
        assert all(g.value == {"n": 1} for g in got)
        assert s.counters()["completions_unreplicated"] == 0
        # Two replicas per master are wanted, the cluster has one: the claim is
        # released and the action does not run.
        two = cluster_store(pfx, min_replicas=2, min_replicas_timeout=0.2)
        with pytest.raises(StoreUnavailableError):
            await two.execute(key(), "fp", action)
        assert runs == 1
        assert two.counters()["claims_unreplicated"] == 1

    asyncio.run(main())


def test_topology_settings_are_checked() -> None:
    with pytest.raises(InvalidArgumentError):
        RedisStore(["redis://127.0.0.1:1", "redis://127.0.0.1:2"])  # seeds need cluster
    with pytest.raises(InvalidArgumentError):
        RedisStore("redis+sentinel://127.0.0.1:1/m", cluster=True)
    with pytest.raises(InvalidArgumentError):
        RedisStore("redis://127.0.0.1:1", min_replicas=1, min_replicas_timeout=5.0)
    with pytest.raises(TypeError):
        RedisStore([])
    RedisStore("redis+sentinel://127.0.0.1:1,127.0.0.1:2/m")
    RedisStore(["redis://127.0.0.1:1", "redis://127.0.0.1:2"], sentinel="m")
    RedisStore(["redis://127.0.0.1:1", "redis://127.0.0.1:2"], cluster=True)
