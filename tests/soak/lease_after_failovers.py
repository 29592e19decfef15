"""A reproduction of an open defect (tests/soak/open-seeds): after master failovers on
a Redis Cluster, a leader's lease is sometimes not renewed, seconds after the faults
ended, and another instance runs the key while the leader's action still runs.

    scripts/with-redis-cluster .venv/bin/python tests/soak/lease_after_failovers.py [MIN_REPLICAS]

Two RedisStores (lease 1.5 s) on the Cluster. For 30 s its masters are SIGKILLed one
after another (each waits for its replica's promotion, then is started again and
rejoins as a replica), then 20 s pass without faults. All the time, 12 keys at once:
store a calls the key with an action that fails (its claim is released), then at once
with a 3 s action; 1.8 s later store b calls the key. b running the key while a's run
goes on means a's lease was not renewed. Exits 1 when that happens after the faults
ended (seen 1-6 times in ~160 keys, with MIN_REPLICAS 0 and 1), 0 otherwise.
"""
from __future__ import annotations

import asyncio
import os
import signal
import sys
import threading
import time

import oncely

from soak import StoreCluster, wait_for

URLS = os.environ["ONCELY_REDIS_CLUSTER_URLS"].split()
CLUSTER = StoreCluster(URLS, os.environ["ONCELY_REDIS_CLUSTER_DIR"])
MIN_REPLICAS = int(sys.argv[1]) if len(sys.argv) > 1 else 0
faults_end: list[float] = []


def failovers(seconds: float) -> None:
    end = time.time() + seconds
    i = 0
    while time.time() < end:
        masters = CLUSTER.masters()
        victim = masters[i % len(masters)]
        i += 1
        wait_for(lambda: CLUSTER.in_sync(victim.port), 30, "the replica in sync")
        os.kill(CLUSTER.pid(victim.port), signal.SIGKILL)
        first = victim.slots[0][0]

        def promoted() -> bool:
            try:
                return CLUSTER.owner(first).port != victim.port
            except RuntimeError:
                return False

        wait_for(promoted, 30, "the replica's promotion")
        wait_for(CLUSTER.healthy, 30, "the cluster up")
        CLUSTER.start(victim.port)
        wait_for(lambda: CLUSTER.replica_up(victim.port), 30, "the node back as a replica")
        time.sleep(0.5)
    faults_end.append(time.time())
    print(f"{i} failovers, the last ended", flush=True)


class Flaky(Exception):
    pass


async def one(a: oncely.RedisStore, b: oncely.RedisStore, n: int, bad: list[str]) -> None:
    key = oncely.scope("t", "Repro", f"key-{n:08d}")
    runs: list[str] = []

    async def fail() -> None:
        runs.append("a-fail")
        await asyncio.sleep(0.1)
        raise Flaky()

    async def long(name: str) -> str:
        runs.append(name)
        await asyncio.sleep(3.0)
        return name

    try:
        await a.execute(key, "fp", fail)
    except Exception:  # noqa: BLE001 - the failure, or UNAVAILABLE during a failover
        pass
    started = time.time()
    ta = asyncio.ensure_future(a.execute(key, "fp", lambda: long("a")))
    await asyncio.sleep(1.8)
    try:
        await asyncio.wait_for(b.execute(key, "fp", lambda: long("b")), 10)
    except Exception:  # noqa: BLE001 - UNAVAILABLE during a failover
        pass
    try:
        await ta
    except Exception:  # noqa: BLE001 - lease lost, UNAVAILABLE
        pass
    if "a" in runs and "b" in runs and faults_end and started > faults_end[0] + 1:
        bad.append(f"{a.record_key(key)}: runs {runs}, a's claim {started - faults_end[0]:.1f} s "
                   f"after the faults ended")


async def main() -> int:
    a = oncely.RedisStore(URLS, lease=1.5, prefix="repro", cluster=True, min_replicas=MIN_REPLICAS)
    b = oncely.RedisStore(URLS, lease=1.5, prefix="repro", cluster=True, min_replicas=MIN_REPLICAS)
    threading.Thread(target=failovers, args=(30,), daemon=True).start()
    bad: list[str] = []
    n = 0
    end = time.time() + 55
    while time.time() < end:
        await asyncio.gather(*[one(a, b, n + i, bad) for i in range(12)])
        n += 12
    print(f"{n} keys, min_replicas {MIN_REPLICAS}: {len(bad)} run twice at once after the faults ended")
    for line in bad[:20]:
        print("  " + line)
    print(f"store a counters: {a.counters()}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
