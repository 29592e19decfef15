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

The store is one redis-server today; a cluster run would replace `StoreRedis` (and the
proxy's single upstream) with one per node.
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
        proc = await asyncio.create_subprocess_exec(
            *self.cmd(lang), name, self.url(), self.prefix, str(self.lease), ledger,
            stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE, limit=1 << 20,
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
            elif kind == "pause":
                ms = int(r.uniform(0.3, 1.5) * self.lease)
                try:
                    resp(self.redis.port, "CLIENT", "PAUSE", str(ms), "ALL")
                    await asyncio.sleep(ms / 1000)
                    self.log("CLIENT PAUSE", "store", start, now_ms(), f"{ms} ms")
                except (OSError, RuntimeError) as exc:
                    self.log("CLIENT PAUSE", "store", start, now_ms(), f"not sent: {exc}")

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
        self.redis.start()
        self.proxy = Proxy(self.redis.port, self.fault_rng)
        await self.proxy.start()
        for spec in self.a.workers.split(","):
            lang, _, count = spec.partition("=")
            lang = {"py": "python", "js": "node"}.get(lang, lang)
            if lang not in ("rust", "python", "node"):
                raise SystemExit(f"unknown worker kind {lang!r}")
            for i in range(int(count or 1)):
                await self.spawn(f"{lang[:2]}{i + 1}", lang)
        print(f"soak: seed {self.seed}, {self.a.duration:.0f} s, workers {self.a.workers}, "
              f"lease {self.lease} ms, redis 127.0.0.1:{self.redis.port} via proxy "
              f"{self.proxy.port}, dir {self.workdir}", flush=True)
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
        rec = resp(self.redis.port, "HGETALL", f"{{{self.prefix}:v1:soak:Soak:{key}}}")
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
        for f in self.timeline:
            if f["end"] < a["start"] - self.lease or f["start"] > b["start"]:
                continue
            if f["fault"] == "cut pub/sub" or (renewals and
                    f["fault"] != "SIGKILL" and f["end"] - f["start"] < self.lease / 3):
                continue
            if f["target"] in ("store", a["w"]):
                return f"{f['fault']} {f['target']} at {self.rel(f['start']):.1f}s"
        return None

    def check(self) -> int:
        by_key = self.ledger()
        rows: list[tuple[str, int, str]] = []
        reexec, overlaps, unattributed, lost, mismatched, hung = [], [], [], [], [], []
        unavailable_outside, unexpected, unrecorded = [], [], []
        for it in self.intents:
            execs = sorted(by_key.get(it.key, []), key=lambda e: e["start"])
            rec = self.record(it.key)
            stored = None
            if rec.get(b"state") == b"done":
                stored = self.stored_summary(rec.get(b"result", b""))
                done_at = int(rec[b"done_at"])
                for e in execs:
                    if e["start"] > done_at + 1:
                        reexec.append(f"{it.key}: {e['x']} started {e['start'] - done_at:.0f} ms "
                                      f"after completion")
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
                    if b["start"] < a["end"]:
                        cause = self.attribute(a, b)
                        overlaps.append(f"{it.key}: {a['x']} / {b['x']}: {cause}")
                        if cause is None:
                            unattributed.append(f"{it.key}: {a['x']} [{self.rel(a['start']):.2f}, "
                                                f"{self.rel(a['end']):.2f}] / {b['x']} at "
                                                f"{self.rel(b['start']):.2f}")
            if it.kind != "perm" and it.outcome != "ok":
                lost.append(f"{it.key} ({it.kind}): last replies {[j.reply for j in it.jobs][-2:]}")
            for v in it.values:
                if stored is None or v != stored:
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
                if c["leads"] != starts:
                    counter_errs.append(f"{w.name}: leads {c['leads']} != executions {starts}")
                if calls != w.ok_by_src:
                    counter_errs.append(f"{w.name}: own count {calls} != replies {w.ok_by_src}")
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
        print(f"\n{'worker':<10} {'replies':>8} {'rss first MB':>13} {'rss last MB':>12} {'MB/100k ops':>12}")
        for ws in self.slots.values():
            for w in ws:
                # From a quarter into the process's life (after its warm-up) to its end.
                last = w.rss[-1] if w.rss else None
                first = next((s for s in w.rss if last and s[0] - w.born >= max(
                    3000, (last[0] - w.born) / 4)), None)
                if first and last and last[2] > first[2]:
                    per = (last[1] - first[1]) / 1024 / (last[2] - first[2]) * 100000
                    print(f"{w.name:<10} {w.replies:>8} {first[1] / 1024:>13.1f} "
                          f"{last[1] / 1024:>12.1f} {per:>12.1f}")
                else:
                    print(f"{w.name:<10} {w.replies:>8} {'-':>13} {'-':>12} {'-':>12}")
        bad = [reexec, unattributed, lost, mismatched, hung, unavailable_outside, unexpected,
               counter_errs, self.violations]
        if any(bad):
            print(f"\nFAILED: seed {self.seed}")
            for group in bad:
                for line in group[:20]:
                    print("  " + line)
            self.print_timeline()
            print(f"soak: FAILED (seed {self.seed}; ledgers kept in {self.workdir})")
            return 1
        if self.a.timeline:
            self.print_timeline()
        print(f"soak: passed (seed {self.seed})")
        return 0

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
    p.add_argument("--faults", default=",".join(FAULTS),
                   help="the fault kinds to inject (comma-separated; default all: %(default)s)")
    p.add_argument("--rust-bin", default=os.path.join(ROOT, "target", "debug", "oncely-soak-worker"))
    p.add_argument("--timeline", action="store_true", help="print the fault timeline on success too")
    p.add_argument("--keep", action="store_true", help="keep the ledgers and Redis dir")
    a = p.parse_args()
    unknown = set(a.faults.split(",")) - set(FAULTS)
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
