"""oncely end-to-end tests: Python and Node worker processes sharing one Redis.

    python run.py [fleet] [fencing] [kill] [fleet-cluster]      (default: all)

Needs ONCELY_REDIS_URL (scripts/test-e2e runs this under scripts/with-redis), for
fleet-cluster also ONCELY_REDIS_CLUSTER_URLS (scripts/with-redis-cluster), the oncely
wheel in the running Python (the .venv made by scripts/test-python) and the built Node
addon in bindings-node. Standard library only. Each test prints one summary line; the
last line is "e2e: N passed, M failed" and the exit status is non-zero on any failure.
"""
from __future__ import annotations

import json
import os
import queue
import random
import signal
import socket
import subprocess
import sys
import threading
import time
import traceback
import uuid
from urllib.parse import urlparse

HERE = os.path.dirname(os.path.abspath(__file__))
URL = os.environ.get("ONCELY_REDIS_URL", "")
# Masters first (scripts/with-redis-cluster).
CLUSTER_URLS = os.environ.get("ONCELY_REDIS_CLUSTER_URLS", "").split()
RUN = uuid.uuid4().hex[:10]
PREFIX = f"e2e-{RUN}"


# --- a tiny RESP client (driver side) -------------------------------------------------

class Redis:
    def __init__(self, url: str) -> None:
        u = urlparse(url)
        self.sock = socket.create_connection((u.hostname or "127.0.0.1", u.port or 6379), 5)
        self.f = self.sock.makefile("rb")

    def __call__(self, *args: str | bytes) -> object:
        out = [b"*%d\r\n" % len(args)]
        for a in args:
            b = a if isinstance(a, bytes) else str(a).encode()
            out.append(b"$%d\r\n%s\r\n" % (len(b), b))
        self.sock.sendall(b"".join(out))
        return self._read()

    def _read(self) -> object:
        line = self.f.readline()
        if not line:
            raise ConnectionError("redis closed the connection")
        t, rest = line[:1], line[1:-2]
        if t == b"+":
            return rest.decode()
        if t == b"-":
            raise RuntimeError(rest.decode())
        if t == b":":
            return int(rest)
        if t == b"$":
            n = int(rest)
            if n < 0:
                return None
            data = self.f.read(n + 2)[:-2]
            return data
        if t == b"*":
            n = int(rest)
            return None if n < 0 else [self._read() for _ in range(n)]
        raise RuntimeError(f"bad RESP line {line!r}")


# --- workers ----------------------------------------------------------------------------

class Worker:
    """One worker process (worker.py or worker.js) fed job lines on stdin."""

    def __init__(self, name: str, lang: str, lease: float, prefix: str = PREFIX,
                 cluster: bool = False) -> None:
        """With `cluster`, the worker's store is on the Redis Cluster (its effect
        counters stay on the one Redis at URL)."""
        self.name, self.lang = name, lang
        env = dict(os.environ)
        env.pop("ONCELY_E2E_CLUSTER_URLS", None)
        if cluster:
            env["ONCELY_E2E_CLUSTER_URLS"] = " ".join(CLUSTER_URLS)
        if lang == "py":
            cmd = [sys.executable, os.path.join(HERE, "worker.py")]
        else:
            cmd = ["node", os.path.join(HERE, "worker.js")]
        self.proc = subprocess.Popen(
            cmd + [name, URL, prefix, str(lease)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            env=env,
        )
        self.replies: "queue.Queue[dict]" = queue.Queue()
        self.stderr: list[str] = []
        self.lock = threading.Lock()
        threading.Thread(target=self._read, daemon=True).start()
        threading.Thread(target=self._read_err, daemon=True).start()
        try:
            ready = self.replies.get(timeout=20)
        except queue.Empty:
            self.stop()
            raise AssertionError(f"worker {name} ({lang}) did not start: {''.join(self.stderr[-20:])}") from None
        if ready.get("ready") != name:
            raise AssertionError(f"{name}: unexpected first line {ready}")

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.strip():
                try:
                    self.replies.put(json.loads(line))
                except ValueError:
                    self.stderr.append("stdout: " + line)

    def _read_err(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            self.stderr.append(line)

    def send(self, job: dict) -> None:
        assert self.proc.stdin is not None
        with self.lock:
            self.proc.stdin.write(json.dumps(job) + "\n")
            self.proc.stdin.flush()

    def stop(self) -> None:
        try:
            if self.proc.poll() is None and self.proc.stdin is not None:
                self.proc.stdin.close()
                self.proc.wait(10)
        except Exception:
            pass
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)


class Replies:
    """Collects the replies of several workers by job id."""

    def __init__(self, workers: list[Worker]) -> None:
        self.workers = workers

    def collect(self, ids: set[int], timeout: float) -> dict[int, dict]:
        got: dict[int, dict] = {}
        end = time.monotonic() + timeout
        while len(got) < len(ids):
            progressed = False
            for w in self.workers:
                try:
                    while True:
                        r = w.replies.get_nowait()
                        if r.get("id") in ids:
                            got[r["id"]] = r
                        progressed = True
                except queue.Empty:
                    pass
            if time.monotonic() > end:
                missing = sorted(ids - got.keys())
                raise AssertionError(f"{len(missing)} replies missing after {timeout}s (e.g. ids {missing[:5]})"
                                     + "".join(f"\n  {w.name} stderr: {''.join(w.stderr[-5:])}" for w in self.workers if w.stderr))
            if not progressed:
                time.sleep(0.005)
        return got


def kind(reply: dict) -> str:
    """'ok', 'in_progress', 'lease_lost' or the error as reported."""
    if reply.get("ok"):
        return "ok"
    e = reply.get("error")
    return {"InProgressError": "in_progress", "LeaseLostError": "lease_lost"}.get(e, e or "?")


def effect_key(key: str) -> str:
    return f"effects:{PREFIX}:{key}"


def wait_until(cond, timeout: float, what: str) -> None:
    end = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > end:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(0.01)


# --- 1. fleet ---------------------------------------------------------------------------

def test_fleet(cluster: bool = False) -> str:
    r = Redis(URL)
    keys = [f"fleet-{RUN}{'-c' if cluster else ''}-{i:04d}" for i in range(300)]
    workers = [Worker(f"{lang}{i}", lang, 5.0, cluster=cluster)
               for lang in ("py", "node") for i in (1, 2)]
    try:
        replies = Replies(workers)
        rng = random.Random(RUN)
        jobs: list[tuple[Worker, dict]] = []
        next_id = 0
        sent_to: dict[str, set[str]] = {}
        for k in keys:
            # each key: 6 sends spread over 2-3 distinct workers, one of them no-wait
            chosen = rng.sample(workers, rng.choice((2, 3)))
            sent_to[k] = {w.name for w in chosen}
            for j in range(6):
                w = chosen[j % len(chosen)]
                job = {"id": next_id, "key": k, "payload": {"key": k, "qty": 1, "note": "é"},
                       "wait": j != 5, "effect": effect_key(k), "attempt": 1,
                       "hold_ms": rng.choice((0, 0, 5, 20))}
                jobs.append((w, job))
                next_id += 1
        rng.shuffle(jobs)
        t0 = time.monotonic()
        senders = []
        for w in workers:  # one feeding thread per worker: the workers see bursts concurrently
            mine = [j for (x, j) in jobs if x is w]
            t = threading.Thread(target=lambda w=w, mine=mine: [w.send(j) for j in mine])
            t.start()
            senders.append(t)
        for t in senders:
            t.join(30)
        got = replies.collect({j["id"] for _, j in jobs}, 60)
        # retries: every key again, attempt 2, to a random worker (may be one never asked)
        retries = []
        for k in keys:
            for a in (2, 3):
                job = {"id": next_id, "key": k, "payload": {"key": k, "qty": 1, "note": "é"},
                       "wait": a == 2, "effect": effect_key(k), "attempt": a, "hold_ms": 0}
                retries.append((rng.choice(workers), job))
                next_id += 1
        for w, j in retries:
            w.send(j)
        got.update(replies.collect({j["id"] for _, j in retries}, 60))
        elapsed = time.monotonic() - t0
        all_jobs = jobs + retries
        by_key: dict[str, list[dict]] = {k: [] for k in keys}
        for w, j in all_jobs:
            by_key[j["key"]].append({**got[j["id"]], "wait": j["wait"], "attempt": j["attempt"]})

        problems: list[str] = []
        sources: dict[str, int] = {}
        for g in got.values():
            if g["ok"]:
                sources[g["source"]] = sources.get(g["source"], 0) + 1
        in_progress = 0
        cross = 0
        for k in keys:
            n = r("GET", effect_key(k))
            if n != b"1":
                problems.append(f"{k}: effect counter {n!r}, expected 1")
            oks = [x for x in by_key[k] if x["ok"]]
            values = {json.dumps(x["value"], sort_keys=True) for x in oks}
            if len(values) != 1:
                problems.append(f"{k}: {len(values)} different values: {sorted(values)[:3]}")
            else:
                v = oks[0]["value"]
                if v.get("key") != k or v.get("n") != 1:
                    problems.append(f"{k}: bad stored value {v}")
            led = [x for x in oks if x["source"] == "led"]
            if len(led) != 1:
                problems.append(f"{k}: {len(led)} callers led, expected 1")
            elif oks and led[0]["value"]["by"] != led[0]["worker"]:
                problems.append(f"{k}: leader {led[0]['worker']} returned a value by {led[0]['value']['by']}")
            langs = {x["worker"].rstrip("0123456789") for x in oks}
            if len(langs) == 2:
                cross += 1
            for x in by_key[k]:
                kd = kind(x)
                if kd == "ok":
                    continue
                if kd == "in_progress" and not x["wait"]:
                    in_progress += 1
                else:
                    problems.append(f"{k}: unexpected error from {x['worker']} (wait={x['wait']}): {x}")
            if any(x["attempt"] > 1 and x["ok"] and x["source"] == "led" for x in by_key[k]):
                problems.append(f"{k}: a retry led (ran the action again)")
        spread = ""
        if cluster:
            per_master = [done_records(u) for u in CLUSTER_URLS[:3]]
            if sum(per_master) != len(keys) or 0 in per_master:
                problems.append(f"done records per master {per_master}: expected {len(keys)} "
                                f"spread over all 3")
            spread = f", records on the 3 masters {'/'.join(map(str, per_master))}"
        if problems:
            raise AssertionError(f"{len(problems)} problems, e.g.:\n  " + "\n  ".join(problems[:10]))
        return (f"{'on a 3-master Redis Cluster: ' if cluster else ''}"
                f"{len(all_jobs)} requests over {len(keys)} keys to 4 workers (2 Python, 2 Node){spread}, "
                f"every effect exactly once, one value per key, {cross} keys served to both languages, "
                f"{in_progress} no-wait in-progress refusals, "
                f"sources {', '.join(f'{n} {s}' for s, n in sorted(sources.items()))}, {elapsed:.1f}s")
    finally:
        for w in workers:
            w.stop()


def done_records(url: str) -> int:
    """The completed records of this run that one Cluster node holds (the node's own
    keys: SCAN and HGET need no redirection)."""
    r = Redis(url)
    n, cursor = 0, b"0"
    while True:
        reply = r("SCAN", cursor, "MATCH", f"{{{PREFIX}:*", "COUNT", "1000")
        assert isinstance(reply, list), reply
        cursor, keys = reply
        n += sum(1 for k in keys if r("HGET", k, "state") == b"done")
        if cursor == b"0":
            return n


def test_fleet_cluster() -> str:
    if not CLUSTER_URLS:
        raise AssertionError("ONCELY_REDIS_CLUSTER_URLS is not set (run under scripts/with-redis-cluster)")
    return test_fleet(cluster=True)


# --- 2. fencing: SIGSTOP the leader past its lease, SIGCONT after a takeover -------------

def fencing_case(leader_lang: str, taker_lang: str) -> str:
    r = Redis(URL)
    k = f"fence-{leader_lang}-{RUN}"
    a = Worker(f"{leader_lang}A", leader_lang, 1.0)
    b = Worker(f"{taker_lang}B", taker_lang, 1.0)
    c = Worker("pyC" if taker_lang == "node" else "nodeC", "py" if taker_lang == "node" else "node", 1.0)
    try:
        replies = Replies([a, b, c])
        payload = {"key": k}
        a.send({"id": 1, "key": k, "payload": payload, "effect": effect_key(k), "hold_ms": 2500})
        wait_until(lambda: r("GET", effect_key(k)) == b"1", 10, "the leader's action to start")
        os.kill(a.proc.pid, signal.SIGSTOP)
        stopped = time.monotonic()
        try:
            b.send({"id": 2, "key": k, "payload": payload, "effect": effect_key(k), "hold_ms": 0})
            got_b = replies.collect({2}, 15)[2]
            took = time.monotonic() - stopped
            assert got_b["ok"] and got_b["source"] == "led", f"taker: {got_b}"
            assert got_b["value"] == {"key": k, "by": b.name, "n": 2}, f"taker value {got_b['value']}"
            assert took > 0.5, f"taken over {took:.2f}s after the stop, before the 1 s lease ran out"
        finally:
            os.kill(a.proc.pid, signal.SIGCONT)
        got_a = replies.collect({1}, 15)[1]
        assert kind(got_a) == "lease_lost", f"the stopped leader's late completion was not fenced: {got_a}"
        code = str(got_a.get("code"))
        assert code.endswith("ABORTED"), f"lease lost with code {code}"
        # the stored value is the taker's, for every language
        record = f"{{{PREFIX}:v1:e2e:Fleet:{k}}}"
        c.send({"id": 3, "key": k, "payload": payload, "effect": effect_key(k), "hold_ms": 0})
        a.send({"id": 4, "key": k, "payload": payload, "effect": effect_key(k), "hold_ms": 0})
        got = replies.collect({3, 4}, 15)
        for i in (3, 4):
            assert got[i]["ok"] and got[i]["source"] == "replayed", f"replay {got[i]}"
            assert got[i]["value"] == got_b["value"], f"replay {got[i]['value']} != {got_b['value']}"
        assert r("GET", effect_key(k)) == b"2", "effects: the stopped leader's and the taker's, no more"
        state = r("HGET", record, "state")
        assert state == b"done", f"record {record} state {state!r}"
        stored = r("HGET", record, "result")
        assert isinstance(stored, bytes) and json.loads(stored[1:]) == got_b["value"], f"stored {stored!r}"
        return (f"{leader_lang} leader SIGSTOPped past its 1 s lease, {taker_lang} took over after {took:.1f}s, "
                f"the resumed leader got {got_a['error']} ({code}), stored value is the taker's, replayed by both languages")
    finally:
        for w in (a, b, c):
            w.stop()


def test_fencing() -> str:
    return " | ".join([fencing_case("py", "node"), fencing_case("node", "py")])


# --- 3. SIGKILL the leader mid-action: exactly one other worker takes over ----------------

def kill_case(leader_lang: str) -> str:
    r = Redis(URL)
    k = f"kill-{leader_lang}-{RUN}"
    a = Worker(f"{leader_lang}A", leader_lang, 1.0)
    others = [Worker("pyB", "py", 1.0), Worker("pyC", "py", 1.0),
              Worker("nodeB", "node", 1.0), Worker("nodeC", "node", 1.0)]
    try:
        replies = Replies(others)
        payload = {"key": k, "kill": True}
        a.send({"id": 1, "key": k, "payload": payload, "effect": effect_key(k), "hold_ms": 30000})
        wait_until(lambda: r("GET", effect_key(k)) == b"1", 10, "the leader's action to start")
        a.proc.kill()
        a.proc.wait(10)
        killed = time.monotonic()
        ids = set()
        for i, w in enumerate(others):  # two concurrent callers per worker
            for j in range(2):
                jid = 10 + 2 * i + j
                ids.add(jid)
                w.send({"id": jid, "key": k, "payload": payload, "effect": effect_key(k), "hold_ms": 100})
        got = replies.collect(ids, 20)
        took = time.monotonic() - killed
        bad = [g for g in got.values() if not g["ok"]]
        assert not bad, f"errors: {bad}"
        led = [g for g in got.values() if g["source"] == "led"]
        assert len(led) == 1, f"{len(led)} callers led after the kill: {led}"
        values = {json.dumps(g["value"], sort_keys=True) for g in got.values()}
        assert len(values) == 1, f"different values: {values}"
        assert led[0]["value"] == {"key": k, "by": led[0]["worker"], "n": 2}, f"value {led[0]['value']}"
        assert r("GET", effect_key(k)) == b"2", f"effects {r('GET', effect_key(k))!r}, expected 2 (killed + one taker)"
        return (f"{leader_lang} leader SIGKILLed mid-action, 8 callers on 4 workers: exactly one "
                f"({led[0]['worker']}) took over, all got its value, {took:.1f}s")
    finally:
        a.stop()
        for w in others:
            w.stop()


def test_kill() -> str:
    return " | ".join([kill_case("node"), kill_case("py")])


TESTS = {"fleet": test_fleet, "fencing": test_fencing, "kill": test_kill,
         "fleet-cluster": test_fleet_cluster}


def main() -> int:
    if not URL:
        print("e2e: ONCELY_REDIS_URL is not set (run under scripts/with-redis)", file=sys.stderr)
        return 2
    names = sys.argv[1:] or list(TESTS)
    passed = failed = 0
    for name in names:
        t0 = time.monotonic()
        try:
            summary = TESTS[name]()
            passed += 1
            print(f"ok   {name}: {summary} ({time.monotonic() - t0:.1f}s)", flush=True)
        except Exception as exc:
            failed += 1
            print(f"FAIL {name}: {exc} ({time.monotonic() - t0:.1f}s)", flush=True)
            if not isinstance(exc, AssertionError):
                traceback.print_exc()
    print(f"e2e: {passed} passed, {failed} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
