"""oncely's seeded chaos soak: Rust, Python and Node workers share one RedisStore
through a TCP fault proxy while faults are injected at seeded random times; a checker
then proves effectively-once from a ledger the faults cannot touch.

    python soak.py --seed N --duration S --workers rust=2,python=2,node=2 [--lease-ms MS]

scripts/soak builds the parts and runs this (see docs/RELIABILITY.md). Standard library
only. Needs redis-server on PATH, the oncely wheel in the running Python, the Node
addon in bindings-node and the Rust worker binary (--rust-bin).

Pieces:
- the store's redis-server (appendonly yes, appendfsync always), restarted by faults;
- the fault proxy (asyncio) between the workers and that server;
- the workers (worker.py, worker.js, oncely-soak-worker): each job is one caller
  (retry around RedisStore.execute); each intent (one key, one fingerprint) is sent to
  2-3 workers at once and sent again, as a client would, while it has no answer;
- the ledger: one append-only file per worker process, a `start` and an `end` line per
  execution of an action;
- the checker, which prints a table and exits non-zero on any violation, with the seed
  and the fault timeline.

With --cluster the store is a Redis Cluster (3 masters, 3 replicas) that
scripts/with-redis-cluster started (ONCELY_REDIS_CLUSTER_URLS, ONCELY_REDIS_CLUSTER_DIR):
the workers connect to its nodes directly (MOVED and ASK name the nodes' own ports, so
no proxy can sit between them), and the store faults are a master SIGKILLed (its replica
is promoted; the node is started again and rejoins as a replica), CLIENT PAUSE of a
master, and slots of keys in use migrated to another master while workers run.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
FAULTS = ["kill", "kill_leader", "kill_completing", "stop", "reset", "delay", "blackhole",
          "cut_pubsub", "restart", "pause"]
CLUSTER_FAULTS = ["kill", "kill_leader", "kill_completing", "stop", "kill_master", "pause_master",
                  "migrate"]
RETRYABLE = {"UNAVAILABLE", "DEADLINE_EXCEEDED", "ABORTED", "RESOURCE_EXHAUSTED"}


def now_ms() -> float:
    return time.time() * 1000


def free_port() -> int:
    while True:
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        port = int(s.getsockname()[1])
        s.close()
        if port != 6379:
            return port


def resp(port: int, *args: str, timeout: float = 5.0) -> Any:
    """One command on a fresh connection (the driver's own, never through the proxy)."""
    with socket.create_connection(("127.0.0.1", port), timeout) as sock:
        out = [b"*%d\r\n" % len(args)]
        for a in args:
            b = a.encode()
            out.append(b"$%d\r\n%s\r\n" % (len(b), b))
        sock.sendall(b"".join(out))
        f = sock.makefile("rb")

        def read() -> Any:
            line = f.readline()
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
                return None if n < 0 else f.read(n + 2)[:-2]
            if t == b"*":
                n = int(rest)
                return None if n < 0 else [read() for _ in range(n)]
            raise RuntimeError(f"bad RESP line {line!r}")

        return read()


# --- redis-server ------------------------------------------------------------------------

class StoreRedis:
    """The store's redis-server: AOF with fsync on every write, so a restart keeps every
    acknowledged write."""

    def __init__(self, workdir: str) -> None:
        self.port = free_port()
        self.dir = os.path.join(workdir, f"redis-{self.port}")
        os.makedirs(self.dir)
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        self.proc = subprocess.Popen(
            ["redis-server", "--bind", "127.0.0.1", "--port", str(self.port), "--save", "",
             "--appendonly", "yes", "--appendfsync", "always", "--dir", self.dir,
             "--daemonize", "no", "--logfile", os.path.join(self.dir, "redis.log")],
        )
        for _ in range(200):
            try:
                if resp(self.port, "PING", timeout=0.5) == "PONG":
                    return
            except (OSError, RuntimeError):
                pass
            if self.proc.poll() is not None:
                break
            time.sleep(0.05)
        raise RuntimeError(f"redis-server did not start on {self.port}")

    def kill(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.kill()


# --- a Redis Cluster ------------------------------------------------------------------------

@dataclass
class Node:
    id: str
    port: int
    master: bool
    failed: bool
    master_id: str
    slots: list[tuple[int, int]]


class StoreCluster:
    """The Redis Cluster of scripts/with-redis-cluster, and the faults the soak injects
    into it. The driver talks to the nodes directly, following MOVED."""

    def __init__(self, urls: list[str], cluster_dir: str) -> None:
        self.ports = [int(u.rsplit(":", 1)[1].split("/")[0]) for u in urls]
        self.dir = cluster_dir

    def any_node(self, *args: str) -> Any:
        err: Exception | None = None
        for port in self.ports:
            try:
                return resp(port, *args, timeout=2.0)
            except (OSError, RuntimeError) as exc:
                err = exc
        raise RuntimeError(f"no cluster node answered {args[:2]}: {err}")

    def diagnose(self, keys: list[str]) -> list[str]:
        """Each live node's role and its view of who serves each key's slot, and the
        key's record where the cluster routes it: for a failure report."""
        out = []
        slots = {k: self.keyslot(k) for k in keys}
        for port in self.ports:
            try:
                role = resp(port, "ROLE", timeout=1.0)[0].decode()
                view = self.nodes(port)
            except (OSError, RuntimeError) as exc:
                out.append(f"node {port}: {exc}")
                continue
            owners = {k: next((n.port for n in view if n.master and not n.failed
                               and any(a <= sl <= b for a, b in n.slots)), None)
                      for k, sl in slots.items()}
            out.append(f"node {port} ({role}): " + ", ".join(
                f"slot {slots[k]} -> {o}" for k, o in owners.items()))
        for k in keys:
            try:
                rec = self.cmd(k, "HGETALL", k)
                out.append(f"{k}: {dict(zip(rec[::2], rec[1::2])) if rec else {}}")
            except (OSError, RuntimeError) as exc:
                out.append(f"{k}: {exc}")
        return out

    def nodes(self, port: int | None = None) -> list[Node]:
        out = []
        reply = resp(port, "CLUSTER", "NODES", timeout=2.0) if port else self.any_node("CLUSTER", "NODES")
        for line in reply.decode().splitlines():
            f = line.split()
            slots = []
            for r in f[8:]:
                if r.startswith("["):
                    continue  # a slot being migrated or imported
                a, _, b = r.partition("-")
                slots.append((int(a), int(b or a)))
            flags = f[2].split(",")
            out.append(Node(f[0], int(f[1].split(":")[1].split("@")[0]), "master" in flags,
                            "fail" in flags or "fail?" in flags, f[3], slots))
        return out

    def masters(self) -> list[Node]:
        return [n for n in self.nodes() if n.master and not n.failed and n.slots]

    def owner(self, slot: int) -> Node:
        for n in self.masters():
            if any(a <= slot <= b for a, b in n.slots):
                return n
        raise RuntimeError(f"no master serves slot {slot}")

    def keyslot(self, key: str) -> int:
        return int(self.any_node("CLUSTER", "KEYSLOT", key))

    def cmd(self, key: str, *args: str) -> Any:
        """A command on the node that holds `key`, following MOVED."""
        port = self.owner(self.keyslot(key)).port
        for _ in range(5):
            try:
                return resp(port, *args)
            except RuntimeError as exc:
                if not str(exc).startswith("MOVED"):
                    raise
                port = int(str(exc).split()[2].rsplit(":", 1)[1])
        raise RuntimeError(f"{args[:2]}: redirected too often")

    def healthy(self) -> bool:
        """Every live node sees every slot served (cluster_state:ok)."""
        for port in self.ports:
            try:
                info = resp(port, "CLUSTER", "INFO", timeout=1.0)
            except (OSError, RuntimeError):
                continue  # a killed node has no say
            if b"cluster_state:ok" not in info:
                return False
        return True

    def in_sync(self, port: int) -> bool:
        """The master's replica has acknowledged everything it wrote (WAIT 1)."""
        try:
            return resp(port, "WAIT", "1", "200") == 1
        except (OSError, RuntimeError):
            return False

    def replica_up(self, port: int) -> bool:
        try:
            info = resp(port, "INFO", "replication", timeout=1.0)
        except (OSError, RuntimeError):
            return False
        return b"role:slave" in info and b"master_link_status:up" in info

    def pid(self, port: int) -> int:
        with open(os.path.join(self.dir, str(port), "redis.pid")) as f:
            return int(f.read().strip())

    def start(self, port: int) -> None:
        subprocess.run(["redis-server", os.path.join(self.dir, str(port), "redis.conf"),
                        "--daemonize", "yes"], check=True, stdout=subprocess.DEVNULL)


def wait_for(cond: Any, timeout: float, what: str) -> None:
    end = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > end:
            raise RuntimeError(f"timed out after {timeout:.0f}s waiting for {what}")
        time.sleep(0.05)


# --- the fault proxy -----------------------------------------------------------------------

class Proxy:
    """A TCP proxy from the workers to the store's Redis that can reset a connection
    after forwarding a command (before relaying its reply), delay replies, black-hole
    all traffic, and cut pub/sub connections."""

    def __init__(self, upstream_port: int, rng: random.Random) -> None:
        self.upstream = upstream_port
        self.port = free_port()
        self.rng = rng
        self.mode: str | None = None
        self.delay_s = 0.0
        self.reset_p = 0.0
        self.conns: set[Conn] = set()
        self.resets = 0

    async def start(self) -> None:
        self.server = await asyncio.start_server(self._accept, "127.0.0.1", self.port)

    async def _accept(self, cr: asyncio.StreamReader, cw: asyncio.StreamWriter) -> None:
        try:
            ur, uw = await asyncio.wait_for(asyncio.open_connection("127.0.0.1", self.upstream), 2)
        except (TimeoutError, OSError):
            abort(cw)
            return
        conn = Conn(cw, uw)
        self.conns.add(conn)
        try:
            await asyncio.gather(self._up(conn, cr), self._down(conn, ur))
        finally:
            self.conns.discard(conn)
            conn.close()

    async def _up(self, conn: Conn, cr: asyncio.StreamReader) -> None:
        try:
            while data := await cr.read(65536):
                if b"SUBSCRIBE" in data.upper():
                    conn.pubsub = True
                if self.mode == "blackhole":
                    conn.tainted = True
                    continue
                conn.uw.write(data)
                await conn.uw.drain()
        except (OSError, asyncio.IncompleteReadError):
            pass
        conn.close()

    async def _down(self, conn: Conn, ur: asyncio.StreamReader) -> None:
        try:
            while data := await ur.read(65536):
                if self.mode == "blackhole":
                    conn.tainted = True
                    continue
                if self.mode == "reset" and not conn.pubsub and self.rng.random() < self.reset_p:
                    self.resets += 1
                    abort(conn.cw)  # the command ran; its reply is lost
                    break
                if self.mode == "delay":
                    await asyncio.sleep(self.delay_s)
                conn.cw.write(data)
                await conn.cw.drain()
        except (OSError, asyncio.IncompleteReadError):
            pass
        conn.close()

    def clear(self) -> None:
        self.mode = None
        for c in list(self.conns):
            if c.tainted:  # part of its stream was dropped: it cannot be resynchronised
                c.close(reset=True)

    def cut_pubsub(self) -> int:
        cut = [c for c in self.conns if c.pubsub]
        for c in cut:
            c.close(reset=True)
        return len(cut)

    def cut_all(self) -> None:
        for c in list(self.conns):
            c.close(reset=True)


def abort(w: asyncio.StreamWriter) -> None:
    """Closes with a TCP RST (SO_LINGER 0), as a crashed peer or middlebox would."""
    sock = w.get_extra_info("socket")
    try:
        if sock is not None:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    except OSError:
        pass
    w.transport.abort()


@dataclass(eq=False)
class Conn:
    cw: asyncio.StreamWriter
    uw: asyncio.StreamWriter
    pubsub: bool = False
    tainted: bool = False

    def close(self, reset: bool = False) -> None:
        if reset:
            abort(self.cw)
            abort(self.uw)
        else:
            self.cw.close()
            self.uw.close()


# --- workers -------------------------------------------------------------------------------

@dataclass(eq=False)
class Worker:
    slot: str  # e.g. "py1"; incarnations are "py1.0", "py1.1", ...
    lang: str
    name: str
    proc: asyncio.subprocess.Process
    ledger: str
    born: float
    jobs: dict[int, Job] = field(default_factory=dict)
    stopped_at: float | None = None
    stops: list[tuple[float, float]] = field(default_factory=list)
    dead: bool = False
    ended: dict[str, Any] | None = None
    replies: int = 0
    ok_by_src: dict[str, int] = field(default_factory=lambda: {"led": 0, "joined": 0, "replayed": 0})
    rss: list[tuple[float, int, int]] = field(default_factory=list)  # (t, kB, replies)
    stderr: list[str] = field(default_factory=list)


@dataclass(eq=False)
class Job:
    id: int
    intent: Intent
    worker: Worker
    sent: float
    reply: dict[str, Any] | None = None
    replied: float | None = None


@dataclass(eq=False)
class Intent:
    key: str
    kind: str
    job: dict[str, Any]
    jobs: list[Job] = field(default_factory=list)
    values: list[str] = field(default_factory=list)
    outcome: str | None = None  # "ok" | "perm"
    rounds: int = 0
    unexpected: list[str] = field(default_factory=list)


class Soak:
    def __init__(self, a: argparse.Namespace) -> None:
        self.a = a
        self.seed = a.seed
        self.rng = random.Random(a.seed)
        self.fault_rng = random.Random(a.seed * 7919 + 1)
        self.lease = a.lease_ms
        self.io_timeout = min(1000, self.lease / 3)
        self.deadline_ms = a.deadline_ms
        self.workdir = tempfile.mkdtemp(prefix="oncely-soak-")
        self.prefix = f"soak{a.seed}"
        self.cluster: StoreCluster | None = None
        self.min_replicas = a.min_replicas
        if a.cluster:
            urls = os.environ.get("ONCELY_REDIS_CLUSTER_URLS", "").split()
            cdir = os.environ.get("ONCELY_REDIS_CLUSTER_DIR", "")
            if not urls or not cdir:
                raise SystemExit("soak --cluster: run under scripts/with-redis-cluster "
                                 "(ONCELY_REDIS_CLUSTER_URLS, ONCELY_REDIS_CLUSTER_DIR)")
            self.cluster = StoreCluster(urls, cdir)
            self.cluster_urls = urls
        self.redis = StoreRedis(self.workdir)
        self.proxy: Proxy
        self.slots: dict[str, list[Worker]] = {}
        self.intents: list[Intent] = []
        self.next_job = 0
        self.timeline: list[dict[str, Any]] = []
        self.t0 = now_ms()
        self.faults_on = True
        self.violations: list[str] = []
        self.pending_resend: set[Intent] = set()

    # -- setup --------------------------------------------------------------------------

    def url(self) -> str:
        if self.cluster:
            return " ".join(self.cluster_urls)
        return f"redis://127.0.0.1:{self.proxy.port}"

    def cmd(self, lang: str) -> list[str]:
        if lang == "python":
            return [sys.executable, os.path.join(HERE, "worker.py")]
        if lang == "node":
            return ["node", os.path.join(HERE, "worker.js")]
        return [self.a.rust_bin]

    async def spawn(self, slot: str, lang: str) -> Worker:
        n = len(self.slots.setdefault(slot, []))
        name = f"{slot}.{n}"
        ledger = os.path.join(self.workdir, f"ledger-{name}.jsonl")
        env = dict(os.environ, ONCELY_SOAK_CLUSTER="1" if self.cluster else "",
                   ONCELY_SOAK_MIN_REPLICAS=str(self.min_replicas))
        proc = await asyncio.create_subprocess_exec(
            *self.cmd(lang), name, self.url(), self.prefix, str(self.lease), ledger,
            stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE, limit=1 << 20, env=env,
        )
        w = Worker(slot, lang, name, proc, ledger, now_ms())
        self.slots[slot].append(w)
        assert proc.stdout is not None
        line = await asyncio.wait_for(proc.stdout.readline(), 60)
        if json.loads(line or b"{}").get("ready") != name:
            err = await proc.stderr.read() if proc.stderr else b""
            raise RuntimeError(f"worker {name} did not start: {line!r} {err.decode()[-2000:]}")
        asyncio.ensure_future(self.read(w))
        asyncio.ensure_future(self.read_err(w))
        return w

    def live(self) -> list[Worker]:
        return [ws[-1] for ws in self.slots.values() if not ws[-1].dead]

    def rel(self, t: float) -> float:
        return (t - self.t0) / 1000

    # -- replies ------------------------------------------------------------------------

    async def read(self, w: Worker) -> None:
        assert w.proc.stdout is not None
        while line := await w.proc.stdout.readline():
            try:
                msg = json.loads(line)
            except ValueError:
                w.stderr.append(line.decode(errors="replace"))
                continue
            if "end" in msg:
                w.ended = msg
                continue
            job = w.jobs.pop(msg["id"], None)
            if job is None:
                continue
            job.reply, job.replied = msg, now_ms()
            w.replies += 1
            self.on_reply(job)
        await w.proc.wait()
        if not w.dead and w.ended is None:
            self.violations.append(f"worker {w.name} exited on its own: "
                                   f"{''.join(w.stderr[-5:])[-1500:]}")
            self.died(w)

    async def read_err(self, w: Worker) -> None:
        assert w.proc.stderr is not None
        while line := await w.proc.stderr.readline():
            w.stderr.append(line.decode(errors="replace"))
            del w.stderr[:-50]

    def on_reply(self, job: Job) -> None:
        it, r = job.intent, job.reply or {}
        if r.get("ok"):
            it.values.append(r["v"])
            job.worker.ok_by_src[r["src"]] += 1
            it.outcome = "ok"
        elif r.get("cancelled"):
            pass
        elif it.kind == "perm" and r.get("code") == "INVALID_ARGUMENT":
            it.outcome = it.outcome or "perm"
        elif r.get("code") not in RETRYABLE:
            it.unexpected.append(f"{job.worker.name}: {r.get('code')} {r.get('err')}")
        self.maybe_resend(it)

    def maybe_resend(self, it: Intent) -> None:
        """A client sends the intent again while it has no answer and nothing in flight."""
        if it.outcome is not None or any(j.reply is None for j in it.jobs):
            return
        self.pending_resend.add(it)

    def died(self, w: Worker) -> None:
        w.dead = True
        for job in list(w.jobs.values()):
            job.reply, job.replied = {"killed": True}, now_ms()
            self.maybe_resend(job.intent)
        w.jobs.clear()

    # -- intents ------------------------------------------------------------------------

    def make_intent(self, n: int) -> Intent:
        r = self.rng
        kind = r.choices(["ok", "none", "big", "flaky", "perm"], [55, 10, 4, 21, 10])[0]
        u = r.random()
        if u < 0.6:
            dur = r.randint(0, 100)
        elif u < 0.9:
            dur = r.randint(100, self.lease)
        else:
            dur = r.randint(self.lease, int(self.lease * 2.5))
        key = f"intent-{n:06d}"
        job = {"key": key, "payload": {"intent": n, "kind": kind}, "kind": kind,
               "dur_ms": dur, "size": (1 << 20) + r.randint(0, 4096), "pfail": 0.5,
               "deadline_ms": self.deadline_ms}
        return Intent(key, kind, job)

    def send(self, it: Intent, w: Worker, cancel: bool) -> None:
        job = dict(it.job, id=self.next_job)
        if cancel:
            job["cancel_ms"] = self.rng.randint(0, it.job["dur_ms"] + 300)
        j = Job(self.next_job, it, w, now_ms())
        self.next_job += 1
        it.jobs.append(j)
        w.jobs[j.id] = j
        assert w.proc.stdin is not None
        try:
            w.proc.stdin.write((json.dumps(job) + "\n").encode())
        except (BrokenPipeError, ConnectionResetError):
            pass

    async def fan_out(self, it: Intent) -> None:
        live = self.live()
        targets = self.rng.sample(live, min(len(live), self.rng.choice([2, 2, 3])))
        for w in targets:
            if not w.dead:
                self.send(it, w, cancel=self.rng.random() < 0.1)
            await asyncio.sleep(self.rng.random() * 0.2)

    async def load(self, until: float) -> None:
        n = 0
        per = self.a.inflight
        next_report = now_ms() + 60000
        while now_ms() < until:
            for it in list(self.pending_resend):
                self.pending_resend.discard(it)
                live = self.live()
                if live and it.rounds < 20:
                    it.rounds += 1
                    self.send(it, self.rng.choice(live), cancel=False)
            inflight = sum(len(w.jobs) for w in self.live())
            if inflight < per * max(1, len(self.live())):
                it = self.make_intent(n)
                n += 1
                self.intents.append(it)
                asyncio.ensure_future(self.fan_out(it))
            if now_ms() >= next_report:
                next_report += 60000
                print(f"  {self.rel(now_ms()):7.0f} s: {len(self.intents)} intents, "
                      f"{self.next_job} jobs, {len(self.timeline)} faults", flush=True)
            await asyncio.sleep(0.01)

    # -- faults ---------------------------------------------------------------------------

    def log(self, fault: str, target: str, start: float, end: float, note: str = "") -> None:
        self.timeline.append({"fault": fault, "target": target, "start": start, "end": end,
                              "note": note})

    async def faults(self, until: float) -> None:
        r = self.fault_rng
        kinds = self.a.faults.split(",")
        await asyncio.sleep(1.0)
        while now_ms() < until - 2000:
            await asyncio.sleep(r.expovariate(1 / self.a.fault_every))
            if now_ms() >= until - 2000:
                break
            kind = r.choice(kinds)
            start = now_ms()
            if kind in ("kill", "kill_leader", "kill_completing", "stop"):
                live = self.live()
                if not live:
                    continue
                w = r.choice(live)
                note = ""
                if kind in ("kill_leader", "kill_completing"):
                    # The next worker whose ledger shows an action starting (a leader
                    # mid-action) or ending well (a leader about to complete).
                    found = await self.watch_ledgers("start" if kind == "kill_leader" else "ok")
                    if found is None:
                        continue
                    w, note = found
                if kind.startswith("kill"):
                    w.dead = True
                    w.proc.send_signal(signal.SIGKILL)
                    self.died(w)
                    self.log("SIGKILL", w.name, start, now_ms(), note)
                    await asyncio.sleep(r.uniform(0.2, 1.0))
                    try:
                        await self.spawn(w.slot, w.lang)
                    except Exception as exc:  # noqa: BLE001 - a worker that cannot start is a violation
                        self.violations.append(f"restart of {w.slot}: {exc}")
                else:
                    hold = r.uniform(0.3, 3.0) * self.lease / 1000
                    w.proc.send_signal(signal.SIGSTOP)
                    await asyncio.sleep(hold)
                    w.proc.send_signal(signal.SIGCONT)
                    w.stops.append((start, now_ms()))
                    self.log("SIGSTOP", w.name, start, now_ms(), f"{hold:.2f}s")
            elif kind in ("reset", "delay", "blackhole"):
                p = self.proxy
                p.mode = kind
                p.reset_p = 0.3
                p.delay_s = 1.5 * self.io_timeout / 1000
                hold = r.uniform(0.3, 2.0) * self.lease / 1000
                before = p.resets
                await asyncio.sleep(hold)
                p.clear()
                note = f"{hold:.2f}s" + (f", {p.resets - before} resets" if kind == "reset" else "")
                self.log(f"proxy {kind}", "store", start, now_ms(), note)
            elif kind == "cut_pubsub":
                cut = self.proxy.cut_pubsub()
                self.log("cut pub/sub", "store", start, now_ms(), f"{cut} connections")
            elif kind == "restart":
                self.redis.kill()
                self.proxy.cut_all()
                await asyncio.sleep(r.uniform(0.1, 1.0))
                await asyncio.get_running_loop().run_in_executor(None, self.redis.start)
                self.log("redis SIGKILL+restart", "store", start, now_ms())
            elif kind == "kill_master":
                loop = asyncio.get_running_loop()
                try:
                    killed, note = await loop.run_in_executor(None, self.kill_master, r.random())
                    self.log("master SIGKILL", "store", killed, now_ms(), note)
                except RuntimeError as exc:
                    self.violations.append(f"master SIGKILL at {self.rel(start):.1f}s: {exc}")
                    return
            elif kind == "pause_master":
                assert self.cluster is not None
                ms = int(r.uniform(0.3, 1.5) * self.lease)
                victim = r.choice(self.cluster.masters())
                try:
                    resp(victim.port, "CLIENT", "PAUSE", str(ms), "ALL")
                    await asyncio.sleep(ms / 1000)
                    self.log("CLIENT PAUSE master", "store", start, now_ms(), f"{victim.port} {ms} ms")
                except (OSError, RuntimeError) as exc:
                    self.log("CLIENT PAUSE master", "store", start, now_ms(), f"not sent: {exc}")
            elif kind == "migrate":
                keys = list({j.intent.key for w in self.live() for j in w.jobs.values()})
                if not keys:
                    continue
                picked = r.sample(keys, min(len(keys), r.choice([1, 2, 3])))
                hold = r.uniform(0.1, 1.0)
                seed = r.random()
                loop = asyncio.get_running_loop()
                try:
                    note = await loop.run_in_executor(None, self.migrate, picked, hold, seed)
                    self.log("slot migration", "store", start, now_ms(), note)
                except RuntimeError as exc:
                    self.violations.append(f"slot migration at {self.rel(start):.1f}s: {exc}")
                    return
            elif kind == "pause":
                ms = int(r.uniform(0.3, 1.5) * self.lease)
                try:
                    resp(self.redis.port, "CLIENT", "PAUSE", str(ms), "ALL")
                    await asyncio.sleep(ms / 1000)
                    self.log("CLIENT PAUSE", "store", start, now_ms(), f"{ms} ms")
                except (OSError, RuntimeError) as exc:
                    self.log("CLIENT PAUSE", "store", start, now_ms(), f"not sent: {exc}")

    def kill_master(self, u: float) -> tuple[float, str]:
        """SIGKILLs a master whose replica is in sync, waits until the replica has taken
        over and every node sees the cluster up, then starts the node again and waits
        until it has rejoined as a replica (so that WAIT can be met again). Returns the
        time of the kill and a note."""
        c = self.cluster
        assert c is not None
        masters = c.masters()
        victim = masters[int(u * len(masters))]
        # A replica that is not in sync would lose more than the writes in flight, or
        # not be elected at all.
        wait_for(lambda: c.in_sync(victim.port), 30, f"{victim.port}'s replica to be in sync")
        first = victim.slots[0][0]
        os.kill(c.pid(victim.port), signal.SIGKILL)
        killed = now_ms()

        def promoted() -> bool:
            try:
                return c.owner(first).port != victim.port
            except RuntimeError:
                return False

        wait_for(promoted, 30, f"a replica of {victim.port} to take over")
        new = c.owner(first).port
        took = now_ms() - killed
        wait_for(c.healthy, 30, "every node to see the cluster up after the failover")
        c.start(victim.port)
        wait_for(lambda: c.replica_up(victim.port), 30, f"{victim.port} to rejoin as a replica")
        return killed, (f"{victim.port} killed, {new} promoted after {took / 1000:.1f}s, "
                        f"{victim.port} back as its replica")

    def migrate(self, keys: list[str], hold: float, u: float) -> str:
        """Moves the slots of `keys` (keys in use) each to another master, as
        `redis-cli --cluster reshard` does: IMPORTING on the target, MIGRATING on the
        source, `hold` seconds in that state (callers meet ASK), MIGRATE of the slot's
        keys, then SETSLOT NODE on every master."""
        c = self.cluster
        assert c is not None
        notes = []
        for key in keys:
            slot = c.keyslot(f"{{{self.prefix}:v1:soak:Soak:{key}}}")
            src = c.owner(slot)
            others = [m for m in c.masters() if m.id != src.id]
            dst = others[int(u * len(others))]
            s = str(slot)
            resp(dst.port, "CLUSTER", "SETSLOT", s, "IMPORTING", src.id)
            resp(src.port, "CLUSTER", "SETSLOT", s, "MIGRATING", dst.id)
            time.sleep(hold)
            moved = 0
            while True:
                got = resp(src.port, "CLUSTER", "GETKEYSINSLOT", s, "100")
                if not got:
                    break
                resp(src.port, "MIGRATE", "127.0.0.1", str(dst.port), "", "0", "5000", "KEYS",
                     *[k.decode() for k in got])
                moved += len(got)
            for n in [dst, src] + [m for m in c.masters() if m.id not in (src.id, dst.id)]:
                resp(n.port, "CLUSTER", "SETSLOT", s, "NODE", dst.id)
            notes.append(f"slot {slot} ({moved} keys) {src.port}->{dst.port}")
        wait_for(c.healthy, 30, "every node to see the cluster up after the migration")
        return ", ".join(notes) + f", {hold:.2f}s migrating"

    async def watch_ledgers(self, what: str) -> tuple[Worker, str] | None:
        """Polls the live workers' ledgers for up to 3 s for a new execution `start`, or
        an `end` with status `ok`; returns that worker and the execution."""
        sizes = {w.name: os.path.getsize(w.ledger) for w in self.live()}
        end = now_ms() + 3000
        while now_ms() < end:
            await asyncio.sleep(0.002)
            for w in self.live():
                size = os.path.getsize(w.ledger)
                if size <= sizes.get(w.name, size):
                    sizes[w.name] = size
                    continue
                with open(w.ledger, "rb") as f:  # noqa: ASYNC230 - a local file, never blocks
                    f.seek(sizes[w.name])
                    new = f.read()
                sizes[w.name] = size
                for line in new.splitlines():
                    try:
                        e = json.loads(line)
                    except ValueError:
                        continue
                    if e.get("ev") == what or e.get("st") == what:
                        return w, f"{'mid-action' if what == 'start' else 'completing'} {e['x']}"
        return None

    async def sample_rss(self) -> None:
        while True:
            for w in self.live():
                try:
                    with open(f"/proc/{w.proc.pid}/status") as f:  # noqa: ASYNC230 - /proc, never blocks
                        kb = next(int(line.split()[1]) for line in f if line.startswith("VmRSS"))
                    w.rss.append((now_ms(), kb, w.replies))
                except (OSError, StopIteration):
                    pass
            await asyncio.sleep(1.0)

    # -- the run --------------------------------------------------------------------------

    async def run(self) -> int:
        if self.cluster:
            where = f"a Redis Cluster ({' '.join(self.cluster_urls)}), min_replicas {self.min_replicas}"
        else:
            self.redis.start()
            self.proxy = Proxy(self.redis.port, self.fault_rng)
            await self.proxy.start()
            where = f"redis 127.0.0.1:{self.redis.port} via proxy {self.proxy.port}"
        for spec in self.a.workers.split(","):
            lang, _, count = spec.partition("=")
            lang = {"py": "python", "js": "node"}.get(lang, lang)
            if lang not in ("rust", "python", "node"):
                raise SystemExit(f"unknown worker kind {lang!r}")
            for i in range(int(count or 1)):
                await self.spawn(f"{lang[:2]}{i + 1}", lang)
        print(f"soak: seed {self.seed}, {self.a.duration:.0f} s, workers {self.a.workers}, "
              f"lease {self.lease} ms, {where}, dir {self.workdir}", flush=True)
        self.t0 = now_ms()
        until = self.t0 + self.a.duration * 1000
        rss = asyncio.ensure_future(self.sample_rss())
        faults = asyncio.ensure_future(self.faults(until)) if self.a.fault_every > 0 else None
        await self.load(until)
        if faults:
            await faults
        self.faults_end = now_ms()
        # Drain: no new intents, no faults; resends continue until every intent settles.
        drain_end = now_ms() + self.deadline_ms + 3 * self.lease + 20000
        while now_ms() < drain_end:
            for it in list(self.pending_resend):
                self.pending_resend.discard(it)
                live = self.live()
                if live and it.rounds < 40:
                    it.rounds += 1
                    self.send(it, self.rng.choice(live), cancel=False)
            if not self.pending_resend and all(not w.jobs for w in self.live()):
                break
            await asyncio.sleep(0.05)
        self.run_end = now_ms()
        rss.cancel()
        for w in self.live():
            assert w.proc.stdin is not None
            w.proc.stdin.close()
        for w in self.live():
            try:
                await asyncio.wait_for(w.proc.wait(), 30)
            except TimeoutError:
                self.violations.append(f"worker {w.name} did not exit at the end of stdin")
                w.proc.kill()
        await asyncio.sleep(0.2)
        return self.check()

    # -- the checker ----------------------------------------------------------------------

    def ledger(self) -> dict[str, list[dict[str, Any]]]:
        """Executions per key: {x, w, start, end, st}; an execution whose process was
        killed ends at the kill."""
        execs: dict[str, dict[str, Any]] = {}
        for ws in self.slots.values():
            for w in ws:
                kill = next((f["start"] for f in self.timeline
                             if f["fault"] == "SIGKILL" and f["target"] == w.name), self.run_end)
                with open(w.ledger) as f:
                    for line in f:
                        try:
                            e = json.loads(line)
                        except ValueError:
                            continue  # a line cut by SIGKILL
                        if e["ev"] == "start":
                            execs[e["x"]] = {"x": e["x"], "w": w.name, "k": e["k"],
                                             "start": e["t"], "end": kill, "st": "killed"}
                        elif e["x"] in execs:
                            execs[e["x"]].update(end=e["t"], st=e["st"])
        by_key: dict[str, list[dict[str, Any]]] = {}
        for e in execs.values():
            by_key.setdefault(e["k"], []).append(e)
        return by_key

    def record(self, key: str) -> dict[bytes, bytes]:
        name = f"{{{self.prefix}:v1:soak:Soak:{key}}}"
        rec = self.cluster.cmd(name, "HGETALL", name) if self.cluster else resp(self.redis.port, "HGETALL", name)
        return dict(zip(rec[::2], rec[1::2])) if rec else {}

    @staticmethod
    def stored_summary(result: bytes) -> str:
        tag, body = result[:1], result[1:]
        if tag == b"n":
            return "none"
        if tag == b"b":
            text = body.decode("utf-8", "replace")
            return f"big:{text.split('|', 1)[0]}:{len(text)}"
        if tag == b"j":
            v = json.loads(body)
            if isinstance(v, str):
                return f"big:{v.split('|', 1)[0]}:{len(v)}"
            if isinstance(v, dict):
                return f"x:{v.get('x')}"
        return f"unexpected:{result[:40]!r}"

    def attribute(self, a: dict[str, Any], b: dict[str, Any], renewals: bool = True) -> str | None:
        """The injected fault that let b's lease claim in while a ran, if any: one that
        hit a's process or the store between a lease before a started and b's start, and
        long enough to fail a renewal (a third of a lease; a lease only lapses after
        renewals failed for that long). Cutting pub/sub never touches renewals."""
        # A fault on a's own process first: a store fault in the window may be a
        # bystander (on a Cluster, often on another shard).
        for target in (a["w"], "store"):
            for f in self.timeline:
                if f["target"] != target or f["end"] < a["start"] - self.lease or f["start"] > b["start"]:
                    continue
                if f["fault"] == "cut pub/sub" or (renewals and
                        f["fault"] != "SIGKILL" and f["end"] - f["start"] < self.lease / 3):
                    continue
                return f"{f['fault']} {f['target']} at {self.rel(f['start']):.1f}s"
        return None

    def failover(self, completed: float, start: float) -> str | None:
        """Without min_replicas a master SIGKILLed after a completion may lose it (its
        replica had not yet received it): the master kill between the completion and
        the execution that ran again, if any. With min_replicas none is allowed."""
        if not self.cluster or self.min_replicas > 0:
            return None
        for f in self.timeline:
            if f["fault"] == "master SIGKILL" and completed - 2 * self.lease <= f["start"] <= start:
                return f"{f['fault']} at {self.rel(f['start']):.1f}s"
        return None

    def check(self) -> int:
        by_key = self.ledger()
        rows: list[tuple[str, int, str]] = []
        reexec, overlaps, unattributed, lost, mismatched, hung = [], [], [], [], [], []
        unavailable_outside, unexpected, unrecorded = [], [], []
        lost_to_failover: list[str] = []
        for it in self.intents:
            execs = sorted(by_key.get(it.key, []), key=lambda e: e["start"])
            rec = self.record(it.key)
            stored = None
            # Completed: the record says so (done_at, Redis time), or a caller got a
            # value (the driver's clock; the same machine) — the second still holds
            # when a failover lost the record.
            served = min((j.replied for j in it.jobs if j.replied is not None and j.reply
                          and j.reply.get("ok")), default=None)
            done_at = int(rec[b"done_at"]) + 1 if rec.get(b"state") == b"done" else None
            completed = min(t for t in (done_at, served) if t is not None) \
                if done_at is not None or served is not None else None
            failover_lost = False
            for e in execs:
                if completed is not None and e["start"] > completed:
                    what = (f"{it.key}: {e['x']} started {e['start'] - completed:.0f} ms after "
                            f"{'completion' if completed == done_at else 'a caller was served'}")
                    cause = self.failover(completed, e["start"])
                    if cause:
                        failover_lost = True
                        lost_to_failover.append(f"{what}: {cause}")
                    else:
                        reexec.append(what)
            if rec.get(b"state") == b"done":
                stored = self.stored_summary(rec.get(b"result", b""))
                if stored.startswith(("x:", "big:")):
                    x = stored.split(":")[1]
                    if not any(e["x"] == x and e["st"] in ("ok", "killed") for e in execs):
                        mismatched.append(f"{it.key}: stored {stored} from no finished execution")
            stored_x = stored.split(":")[1] if stored and stored.startswith(("x:", "big:")) else None
            for e in execs:
                # A success that is not the stored result: its completion failed (the
                # store unreachable, or its lease lost), so a later caller runs it again.
                if e["st"] == "ok" and stored_x is not None and e["x"] != stored_x:
                    cause = self.attribute(e, {"start": e["end"] + 2 * self.lease}, renewals=False)
                    unrecorded.append(f"{it.key}: {e['x']}: {cause}")
                    if cause is None:
                        unattributed.append(f"{it.key}: {e['x']} succeeded at "
                                            f"{self.rel(e['end']):.2f} and was not recorded")
            for i, a in enumerate(execs):
                for b in execs[i + 1:]:
                    # 1 ms of slack: Node's Date.now() is whole milliseconds (floored),
                    # so a run that started just after another ended may read earlier.
                    if b["start"] < a["end"] - 1:
                        cause = self.attribute(a, b)
                        overlaps.append(f"{it.key}: {a['x']} / {b['x']}: {cause}")
                        if cause is None:
                            unattributed.append(f"{it.key}: {a['x']} [{self.rel(a['start']):.2f}, "
                                                f"{self.rel(a['end']):.2f}] / {b['x']} at "
                                                f"{self.rel(b['start']):.2f}")
            if it.kind != "perm" and it.outcome != "ok":
                lost.append(f"{it.key} ({it.kind}): last replies {[j.reply for j in it.jobs][-2:]}")
            if stored is None and served is not None and not failover_lost:
                # Served, and no completed record now: without min_replicas a failover
                # after the completion may have lost it (nobody ran the key again).
                cause = self.failover(served, self.run_end)
                if cause:
                    failover_lost = True
                    lost_to_failover.append(f"{it.key}: served at {self.rel(served):.2f}s, no "
                                            f"completed record at the end: {cause}")
            for v in it.values:
                # A value whose record a failover lost (min_replicas 0) is counted there.
                if (stored is None or v != stored) and not failover_lost:
                    mismatched.append(f"{it.key}: caller got {v}, stored {stored}")
            unexpected += [f"{it.key}: {u}" for u in it.unexpected]
            for j in it.jobs:
                if j.reply is None:
                    hung.append(f"{it.key}: job {j.id} on {j.worker.name} never answered")
                    continue
                assert j.replied is not None
                stopped = sum(e - s for s, e in j.worker.stops if e > j.sent and s < j.replied)
                limit = self.deadline_ms + self.lease + stopped + 3000
                if j.replied - j.sent > limit:
                    hung.append(f"{it.key}: job {j.id} on {j.worker.name} took "
                                f"{j.replied - j.sent:.0f} ms (limit {limit:.0f})")
                if j.reply.get("code") == "UNAVAILABLE" and it.kind != "flaky":
                    near = any(f["start"] - 1000 <= j.replied and
                               f["end"] + self.deadline_ms + 1000 >= j.sent and f["target"] == "store"
                               for f in self.timeline)
                    if not near:
                        unavailable_outside.append(f"{it.key}: {j.worker.name} {j.reply.get('err')}")
        # Counters add up, per worker process that ran to the end.
        counter_errs = []
        total_ok = sum(len(it.values) for it in self.intents)
        total_src = 0
        for ws in self.slots.values():
            for w in ws:
                total_src += sum(w.ok_by_src.values())
                if w.ended is None:
                    continue
                c, calls = w.ended["counters"], w.ended["calls"]
                starts = sum(1 for es in by_key.values() for e in es if e["w"] == w.name)
                # A lead whose caller went away as the claim answered is given up before
                # its action starts (counted in `abandoned`, as is one given up while
                # it ran): every execution was a lead, every lead not abandoned ran.
                gave_up = c.get("abandoned", 0)
                if not c["leads"] - gave_up <= starts <= c["leads"]:
                    counter_errs.append(f"{w.name}: leads {c['leads']} (abandoned {gave_up}) "
                                        f"!= executions {starts}")
                if calls != w.ok_by_src:
                    counter_errs.append(f"{w.name}: own count {calls} != replies {w.ok_by_src}")
        unreplicated = sum(w.ended["counters"].get("completions_unreplicated", 0)
                           for ws in self.slots.values() for w in ws if w.ended is not None)
        if total_src != total_ok:
            counter_errs.append(f"led+joined+replayed {total_src} != successful calls {total_ok}")

        causes: dict[str, int] = {}
        for o in overlaps:
            cause = o.rsplit(": ", 1)[1]
            if cause != "None":
                kind = " ".join(cause.split(" at ")[0].split(" ")[:-1])
                causes[kind] = causes.get(kind, 0) + 1
        execs_total = sum(len(v) for v in by_key.values())
        ok_intents = sum(1 for it in self.intents if it.outcome == "ok")
        perm_intents = sum(1 for it in self.intents if it.outcome == "perm")
        rows = [
            ("intents (ok / permanent failure)", len(self.intents), f"{ok_intents} / {perm_intents}"),
            ("caller jobs sent", self.next_job, ""),
            ("executions (ledger)", execs_total, ""),
            ("faults injected", len(self.timeline), ""),
            ("re-executions after completion", len(reexec), "must be 0"),
            *([("completions a failover lost", len(lost_to_failover),
                "min_replicas 0: not yet on the killed master's replica; run again or no record")]
              if self.cluster and self.min_replicas == 0 else []),
            *([("completions not acknowledged by replicas", unreplicated,
                f"min_replicas {self.min_replicas} (workers that ran to the end)")]
              if self.min_replicas > 0 else []),
            ("overlapping executions", len(overlaps), "each after an injected fault"
             + "".join(f"; {n} after {c}" for c, n in sorted(causes.items()))),
            ("successes not recorded (run again)", len(unrecorded),
             "each after an injected fault (completion failed or lease lost)"),
            ("unattributed overlaps / unrecorded", len(unattributed), "must be 0"),
            ("lost intents", len(lost), "must be 0"),
            ("mismatched values", len(mismatched), "must be 0"),
            ("hung callers (> deadline + lease)", len(hung), "must be 0"),
            ("UNAVAILABLE with no store fault near", len(unavailable_outside), "must be 0"),
            ("unexpected errors", len(unexpected), "must be 0"),
            ("counter mismatches", len(counter_errs), "must be 0"),
            ("harness errors", len(self.violations), "must be 0"),
        ]
        print(f"\n{'check':<40} {'count':>8}  note")
        for name, n, note in rows:
            print(f"{name:<40} {n:>8}  {note}")
        print(f"\n{'worker':<10} {'replies':>8} {'rss first MB':>13} {'rss last MB':>12} {'MB/100k ops':>12}"
              f"  store counters at the end")
        for ws in self.slots.values():
            for w in ws:
                # From a quarter into the process's life (after its warm-up) to its end.
                last = w.rss[-1] if w.rss else None
                first = next((s for s in w.rss if last and s[0] - w.born >= max(
                    3000, (last[0] - w.born) / 4)), None)
                if first and last and last[2] > first[2]:
                    per = (last[1] - first[1]) / 1024 / (last[2] - first[2]) * 100000
                    print(f"{w.name:<10} {w.replies:>8} {first[1] / 1024:>13.1f} "
                          f"{last[1] / 1024:>12.1f} {per:>12.1f}  {self.counters(w)}")
                else:
                    print(f"{w.name:<10} {w.replies:>8} {'-':>13} {'-':>12} {'-':>12}  {self.counters(w)}")
        bad = [reexec, unattributed, lost, mismatched, hung, unavailable_outside, unexpected,
               counter_errs, self.violations]
        if any(bad):
            print(f"\nFAILED: seed {self.seed}")
            for group in bad:
                for line in group[:20]:
                    print("  " + line)
            self.print_timeline()
            if self.cluster:
                bad_keys = sorted({line.split(":")[0] for group in (reexec, unattributed, lost, mismatched)
                                   for line in group})[:10]
                print("\ncluster state now:")
                for line in self.cluster.diagnose([f"{{{self.prefix}:v1:soak:Soak:{k}}}" for k in bad_keys]):
                    print("  " + line[:2000])
            print(f"soak: FAILED (seed {self.seed}; ledgers kept in {self.workdir})")
            return 1
        if self.a.timeline:
            for title, group in (("overlaps", overlaps), ("successes not recorded", unrecorded),
                                 ("completions a failover lost", lost_to_failover)):
                if group:
                    print(f"\n{title} (key: executions: attributed fault):")
                    for line in group[:50]:
                        print("  " + line)
            self.print_timeline()
        print(f"soak: passed (seed {self.seed})")
        return 0

    @staticmethod
    def counters(w: Worker) -> str:
        """The store counters a worker printed at its end (none if it was killed)."""
        if w.ended is None:
            return "-"
        c = w.ended["counters"]
        return " ".join(f"{k}={c[k]}" for k in ("leads", "takeovers", "leases_lost", "abandoned") if k in c)

    def print_timeline(self) -> None:
        print("\nfault timeline (seconds from the start):")
        for f in self.timeline:
            print(f"  {self.rel(f['start']):8.2f} - {self.rel(f['end']):8.2f}  {f['fault']:<22} "
                  f"{f['target']:<8} {f['note']}")

    def cleanup(self, failed: bool) -> None:
        for ws in self.slots.values():
            for w in ws:
                if w.proc.returncode is None:
                    try:
                        w.proc.send_signal(signal.SIGCONT)
                        w.proc.kill()
                    except ProcessLookupError:
                        pass
        self.redis.stop()
        if not failed and not self.a.keep:
            shutil.rmtree(self.workdir, ignore_errors=True)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--duration", type=float, default=60.0, help="seconds of load and faults")
    p.add_argument("--workers", default="rust=2,python=2,node=2")
    p.add_argument("--lease-ms", type=int, default=1500)
    p.add_argument("--deadline-ms", type=int, default=15000, help="each caller's retry deadline")
    p.add_argument("--inflight", type=int, default=6, help="intents in flight per worker")
    p.add_argument("--fault-every", type=float, default=2.5, help="mean seconds between faults (0: none)")
    p.add_argument("--faults", default=None,
                   help="the fault kinds to inject (comma-separated; default all: "
                        f"{','.join(FAULTS)}; with --cluster {','.join(CLUSTER_FAULTS)})")
    p.add_argument("--cluster", action="store_true",
                   help="the store on a Redis Cluster (run under scripts/with-redis-cluster)")
    p.add_argument("--min-replicas", type=int, default=None,
                   help="the store's min_replicas (default 1 with --cluster, else 0)")
    p.add_argument("--rust-bin", default=os.path.join(ROOT, "target", "debug", "oncely-soak-worker"))
    p.add_argument("--timeline", action="store_true",
                   help="print the fault timeline, the overlaps and the unrecorded successes on success too")
    p.add_argument("--keep", action="store_true", help="keep the ledgers and Redis dir")
    a = p.parse_args()
    kinds = CLUSTER_FAULTS if a.cluster else FAULTS
    a.faults = a.faults or ",".join(kinds)
    if a.min_replicas is None:
        a.min_replicas = 1 if a.cluster else 0
    unknown = set(a.faults.split(",")) - set(kinds)
    if unknown:
        p.error(f"unknown fault kinds: {', '.join(sorted(unknown))}")
    soak = Soak(a)
    code = 1
    try:
        code = asyncio.run(soak.run())
    finally:
        soak.cleanup(code != 0)
    return code


if __name__ == "__main__":
    sys.exit(main())
