"""Long chaos run: SIGKILLed workers and pool children, Redis restarts, a verdict from a ledger.

Starts its own ``redis-server`` (AOF, ``appendfsync always``) on a free loopback
port and three workers of mixed pools (``bench/chaos_app.py``), publishes short
tasks in batches while it SIGKILLs whole workers (their process groups) and
prefork pool children, restarts Redis (same port, same directory) at chosen
points, restarts it from a snapshot taken a moment before (``--lost-writes``:
what a Redis persisting by RDB snapshots only does after a crash, and what a
failover to a lagging replica does), restarts every killed worker, waits for
the queue to drain, and judges the run from the per-task ledger the tasks
write (``bench/chaos_verdict.py``): tasks lost, tasks duplicated, publishes a
lost write took, and what explains each rerun.

    python bench/chaos.py --tasks 20000 --kills 300 --restarts 2 --json chaos.json

Every loop is bounded in count and time (``--duration-limit-s``); every process
it started is stopped on exit, error or Ctrl-C. Exit status: 0 when nothing was
lost, every rerun is explained and every target (tasks, kills, restarts,
lost writes) was met; 1 when the verdict fails; 2 when the verdict holds but a target was not met.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import redis

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.chaos_app import TASK_NAME, make_conf, parse_max_stalled
from bench.chaos_verdict import Kill, Ledger, LostWrites, Restart, judge
from celery_emq.store.jobstore import JobStore

ROOT = Path(__file__).resolve().parents[1]
QUEUE = "celery"
KEY_PREFIX = "emq"
#: How long one task's publish is retried before the run gives up.
PUBLISH_RETRY_S = 60.0
#: Most worker exits the run did not cause before it gives up.
MAX_UNEXPECTED_EXITS = 20
#: Most findings detailed (runs, job rows, log lines) in the report.
MAX_FINDINGS = 25


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def task_seconds(rng: random.Random, lease_ms: int) -> float:
    """How long one task sleeps: mostly a few ms, some longer, a few longer than a lease."""
    x = rng.random()
    if x < 0.002:
        return round(rng.uniform(1.2, 1.6) * lease_ms / 1000, 3)
    if x < 0.01:
        return round(rng.uniform(0.5, 2.0), 3)
    if x < 0.06:
        return round(rng.uniform(0.05, 0.3), 3)
    return round(rng.uniform(0.001, 0.010), 4)


class RedisServer:
    """A redis-server with AOF (``appendfsync always``) on one port and directory."""

    def __init__(self, port: int, workdir: Path) -> None:
        self.port = port
        self.dir = workdir / "redis"
        self.dir.mkdir(parents=True, exist_ok=True)
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self, timeout_s: float = 30, from_snapshot: bool = False) -> None:
        # From a snapshot: AOF off, so that the server loads dump.rdb.
        aof = ["no"] if from_snapshot else ["yes", "--appendfsync", "always"]
        self.proc = subprocess.Popen(
            [
                "redis-server",
                "--port",
                str(self.port),
                "--bind",
                "127.0.0.1",
                "--dir",
                str(self.dir),
                "--appendonly",
                *aof,
                "--save",
                "",
                "--daemonize",
                "no",
                "--logfile",
                str(self.dir / "redis.log"),
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )
        client = redis.Redis(port=self.port, socket_timeout=2, socket_connect_timeout=2)
        deadline = time.monotonic() + timeout_s
        try:
            while True:
                try:
                    if client.ping():
                        return
                except redis.RedisError:
                    pass  # not listening yet, or still loading the AOF
                if self.proc.poll() is not None:
                    raise RuntimeError(f"redis-server exited with {self.proc.returncode}")
                if time.monotonic() > deadline:
                    raise RuntimeError(f"redis-server not answering within {timeout_s} s")
                time.sleep(0.05)
        finally:
            client.close()

    def start_from_snapshot(self, n: int, timeout_s: float = 30) -> float:
        """Start again from the last ``SAVE``, then turn AOF back on.

        The AOF (which holds every write) is set aside as ``*.before-lost-writes-<n>``
        so the server cannot read it; once the server answers, AOF with
        ``appendfsync always`` is turned on again and its rewrite awaited, so a
        later restart keeps what came after. Returns when the server answered.
        """
        for name in ("appendonlydir", "appendonly.aof"):
            path = self.dir / name
            if path.exists():
                path.rename(self.dir / f"{name}.before-lost-writes-{n}")
        self.start(timeout_s, from_snapshot=True)
        t_up = time.time()
        client = redis.Redis(port=self.port, socket_timeout=5, socket_connect_timeout=2)
        try:
            client.config_set("appendfsync", "always")
            client.config_set("appendonly", "yes")
            deadline = time.monotonic() + timeout_s
            while True:
                info = client.info("persistence")
                if (
                    info.get("aof_enabled") == 1
                    and not info.get("aof_rewrite_in_progress")
                    and not info.get("aof_rewrite_scheduled")
                ):
                    return t_up
                if time.monotonic() > deadline:
                    raise RuntimeError(f"AOF not back on within {timeout_s} s: {info}")
                time.sleep(0.05)
        finally:
            client.close()

    def stop(self, sig: int = signal.SIGTERM, timeout_s: float = 30) -> None:
        proc = self.proc
        if proc is None or proc.poll() is not None:
            return
        proc.send_signal(sig)
        try:
            proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


@dataclass
class Slot:
    """One of the run's workers; each (re)start is a new incarnation with its own node name."""

    name: str
    pool: str
    concurrency: int
    incarnation: int = 0
    proc: subprocess.Popen[bytes] | None = None
    hostname: str = ""
    log: Path | None = None
    ready: bool = False
    killed: bool = False
    old: list[subprocess.Popen[bytes]] = field(default_factory=list)
    _log_offset: int = 0
    _log_tail: bytes = b""

    def start(self, env: dict[str, str], logdir: Path) -> None:
        if self.proc is not None:
            self.old.append(self.proc)
        self.incarnation += 1
        self.hostname = f"{self.name}.{self.incarnation}@chaos"
        self.log = logdir / f"{self.name}.{self.incarnation}.log"
        self.ready = False
        self.killed = False
        self._log_offset = 0
        self._log_tail = b""
        with open(self.log, "wb") as fh:
            self.proc = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "celery",
                    "-A",
                    "bench.chaos_app",
                    "worker",
                    "-n",
                    self.hostname,
                    "-P",
                    self.pool,
                    "-c",
                    str(self.concurrency),
                    "-l",
                    "info",
                    "--without-mingle",
                    "--without-gossip",
                ],
                cwd=ROOT,
                env=env,
                stdout=fh,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def poll_ready(self) -> bool:
        """Read the log on from the last read until the worker says it is ready."""
        if self.ready or self.log is None:
            return self.ready
        with open(self.log, "rb") as fh:
            fh.seek(self._log_offset)
            data = fh.read()
        self._log_offset += len(data)
        # Keep the end of the last read: the word may straddle two reads.
        self._log_tail = (self._log_tail + data)[-64:]
        self.ready = (b" ready." in self._log_tail or b" ready." in data) and self.alive()
        return self.ready

    def children(self) -> list[int]:
        if not self.alive():
            return []
        assert self.proc is not None
        try:
            text = Path(f"/proc/{self.proc.pid}/task/{self.proc.pid}/children").read_text()
        except OSError:
            return []
        return [int(p) for p in text.split()]

    def kill_group(self) -> None:
        """SIGKILL the worker's process group (it and its pool children)."""
        for proc in [*self.old, *([self.proc] if self.proc else [])]:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                pass
        self.old.clear()


class Publisher:
    """Publishes tasks with ids of its choosing, retrying through Redis outages."""

    def __init__(self, conf: dict[str, Any]) -> None:
        from celery import Celery

        self.app = Celery("chaos-publisher", set_as_current=False)
        self.app.conf.update(conf)
        self.conn: Any = None
        self.producer: Any = None
        self.errors = 0
        self.error_samples: list[str] = []

    def publish(self, task_id: str, seconds: float) -> int:
        """Publish one task; return the attempts it took once one was acknowledged."""
        deadline = time.monotonic() + PUBLISH_RETRY_S
        attempts = 0
        while True:
            attempts += 1
            try:
                if self.conn is None:
                    self.conn = self.app.connection_for_write()
                    self.producer = self.conn.Producer()
                self.app.send_task(
                    TASK_NAME, args=[seconds], task_id=task_id, producer=self.producer, retry=False
                )
                return attempts
            except Exception as exc:
                self.errors += 1
                if len(self.error_samples) < 10:
                    self.error_samples.append(f"{type(exc).__name__}: {exc}")
                self.close()
                if time.monotonic() > deadline:
                    raise RuntimeError(
                        f"publishing {task_id} failed for {PUBLISH_RETRY_S} s: {exc!r}"
                    ) from exc
                time.sleep(min(0.05 * attempts, 0.5))

    def close(self) -> None:
        if self.conn is not None:
            try:
                self.conn.release()
            except Exception:
                pass
        self.conn = self.producer = None


class Chaos:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.rng = random.Random(args.seed)
        if args.workdir:
            self.workdir = Path(args.workdir)
            self.workdir.mkdir(parents=True, exist_ok=True)
        else:
            self.workdir = Path(tempfile.mkdtemp(prefix="emq-chaos-"))
        self.logdir = self.workdir / "logs"
        self.logdir.mkdir(exist_ok=True)
        self.redis = RedisServer(free_port(), self.workdir)
        broker = f"emq://127.0.0.1:{self.redis.port}/0"
        self.ledger = Ledger(self.workdir / "ledger.jsonl")
        self.ledger.path.write_bytes(b"")
        self.env = {
            **os.environ,
            "CHAOS_BROKER": broker,
            "CHAOS_LEDGER": str(self.ledger.path),
            "CHAOS_LEASE_MS": str(args.lease_ms),
            "CHAOS_SWEEP_S": str(args.sweep_s),
            "CHAOS_MAX_STALLED": args.max_stalled,
        }
        conf = make_conf(broker, args.lease_ms, args.sweep_s, parse_max_stalled(args.max_stalled))
        conf["broker_transport_options"].update(socket_timeout=5, socket_connect_timeout=5)
        self.publisher = Publisher(conf)
        self.slots = [
            Slot(f"w{i + 1}-{pool}", pool, int(c))
            for i, (pool, c) in enumerate(p.split(":") for p in args.pools.split(","))
        ]
        self.published: dict[str, int] = {}
        #: When each publish was acknowledged (a lost write can take it).
        self.published_at: dict[str, float] = {}
        #: Tasks whose publish a lost write took (they may never run), as of
        #: ``_taken_for`` restarts from a snapshot.
        self.taken: set[str] = set()
        self._taken_for = 0
        self.kills: list[Kill] = []
        self.restarts: list[Restart] = []
        self.lost_writes: list[LostWrites] = []
        self.exits: list[dict[str, Any]] = []
        self.notes: list[str] = []
        self.redis_back: threading.Thread | None = None
        self.redis_error: Exception | None = None
        self.events = open(self.workdir / "events.jsonl", "a")
        self.t0 = time.monotonic()
        self.started_at = time.time()
        self.client = redis.Redis(port=self.redis.port, socket_timeout=5, socket_connect_timeout=2)
        self.store = JobStore(self.client, KEY_PREFIX, args.lease_ms)

    # -- events -------------------------------------------------------------

    def event(self, name: str, **data: Any) -> None:
        self.events.write(json.dumps({"event": name, "t": time.time(), **data}) + "\n")
        self.events.flush()

    def say(self, text: str) -> None:
        print(f"[{time.monotonic() - self.t0:6.1f}s] {text}", flush=True)

    # -- workers ------------------------------------------------------------

    def tend_workers(self) -> None:
        """Restart every worker that exited; note the exits the run did not cause."""
        for slot in self.slots:
            if slot.proc is not None and slot.proc.poll() is not None and not slot.killed:
                tail = slot.log.read_text(errors="replace")[-2000:] if slot.log else ""
                self.exits.append(
                    {"worker": slot.hostname, "code": slot.proc.returncode, "log_tail": tail}
                )
                self.event("exit", worker=slot.hostname, code=slot.proc.returncode)
                self.say(f"worker {slot.hostname} exited by itself ({slot.proc.returncode})")
                if len(self.exits) > MAX_UNEXPECTED_EXITS:
                    raise RuntimeError(f"{len(self.exits)} workers exited by themselves")
                slot.killed = True
            if slot.proc is None or slot.killed:
                slot.start(self.env, self.logdir)
                self.event("start", worker=slot.hostname, pid=slot.proc.pid if slot.proc else 0)
            else:
                slot.poll_ready()

    def wait_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while not all(s.poll_ready() for s in self.slots):
            self.tend_workers()
            if time.monotonic() > deadline:
                raise RuntimeError(f"workers not ready within {timeout_s} s")
            time.sleep(0.1)

    def kill_one(self) -> bool:
        """SIGKILL one worker or one prefork child, preferring one that runs a task."""
        running: dict[tuple[str, int], int] = {}
        for r in self.ledger.open_runs():
            running[(r.worker, r.pid)] = running.get((r.worker, r.pid), 0) + 1
        ready = [s for s in self.slots if s.ready and s.alive()]
        workers = [
            (s, s.proc.pid, sum(n for (w, _), n in running.items() if w == s.hostname))
            for s in ready
            if s.proc is not None
        ]
        children = [
            (s, pid, running.get((s.hostname, pid), 0))
            for s in ready
            if s.pool == "prefork"
            for pid in s.children()
        ]
        kind = "child" if self.rng.random() < self.args.child_kill_share else "worker"
        pool = children if kind == "child" else workers
        if not pool:
            kind, pool = ("worker", workers) if kind == "child" else ("child", children)
        if not pool:
            return False
        busy = [c for c in pool if c[2] > 0]
        slot, pid, open_runs = self.rng.choice(busy if busy and self.rng.random() < 0.8 else pool)
        t_before = time.time()
        try:
            if kind == "worker":
                os.killpg(pid, signal.SIGKILL)
            else:
                os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            return False
        t_after = time.time()
        if kind == "worker":
            slot.killed = True
            try:
                slot.proc.wait(5)  # type: ignore[union-attr]
            except subprocess.TimeoutExpired:
                pass
        kill = Kill(t_before, t_after, kind, slot.hostname, pid, open_runs)
        self.kills.append(kill)
        self.event("kill", **asdict(kill))
        return True

    # -- Redis --------------------------------------------------------------

    def stop_redis(self) -> None:
        """Stop Redis; a timer thread starts it again ``--redis-down-s`` later.

        The run goes on meanwhile: workers lose their connections and
        reconnect, publishes fail and are retried, kills go on.
        """
        sig = signal.SIGKILL if self.args.redis_signal == "kill" else signal.SIGTERM
        t_down = time.time()
        self.redis.stop(sig)
        self.say(f"redis stopped ({self.args.redis_signal}); down for {self.args.redis_down_s} s")
        self.redis_back = threading.Thread(target=self._bring_back, args=(t_down,), daemon=True)
        self.redis_back.start()

    def _bring_back(self, t_down: float) -> None:
        time.sleep(self.args.redis_down_s)
        try:
            self.redis.start()
        except Exception as exc:
            self.redis_error = exc
            return
        t_up = time.time()
        self.restarts.append(Restart(t_down, t_up))
        self.event("redis_restart", t_down=t_down, t_up=t_up)
        self.say(f"redis back after {t_up - t_down:.1f} s")

    def lose_writes(self) -> None:
        """Snapshot Redis now; a thread SIGKILLs it ``--snapshot-lag-s`` later and
        starts it again from the snapshot, losing every write in between.

        The run goes on meanwhile, as for a restart.
        """
        t_snap = time.time()  # before SAVE: a publish acknowledged earlier is in the snapshot
        self.client.save()
        self.say(f"redis snapshot taken; crash in {self.args.snapshot_lag_s} s")
        self.redis_back = threading.Thread(target=self._crash_to_snapshot, args=(t_snap,))
        self.redis_back.daemon = True
        self.redis_back.start()

    def _crash_to_snapshot(self, t_snap: float) -> None:
        time.sleep(self.args.snapshot_lag_s)
        self.redis.stop(signal.SIGKILL)
        t_down = time.time()
        try:
            t_up = self.redis.start_from_snapshot(len(self.lost_writes) + 1)
        except Exception as exc:
            self.redis_error = exc
            return
        self.lost_writes.append(LostWrites(t_snap, t_down, t_up))
        self.event("lost_writes", t_snap=t_snap, t_down=t_down, t_up=t_up)
        self.say(
            f"redis back from the snapshot after {t_up - t_down:.1f} s "
            f"({t_down - t_snap:.1f} s of writes lost)"
        )

    def update_taken(self) -> None:
        """Note the publishes the restarts from a snapshot so far took."""
        faults = self.lost_writes[: len(self.lost_writes)]
        if len(faults) == self._taken_for:
            return
        self._taken_for = len(faults)
        self.taken = {
            t
            for t, at in self.published_at.items()
            if any(w.t_snap < at < w.t_up for w in faults)  # see LostWrites
        }

    def done(self) -> int:
        """Tasks completed, or taken by a lost write (those may never complete)."""
        self.update_taken()
        return len(self.ledger.completed | self.taken)

    def redis_down(self) -> bool:
        """Whether a restart is under way; raises if Redis failed to come back."""
        if self.redis_error is not None:
            raise RuntimeError(f"redis-server did not come back: {self.redis_error!r}")
        return self.redis_back is not None and self.redis_back.is_alive()

    def wait_redis_back(self) -> None:
        if self.redis_back is not None:
            self.redis_back.join(self.args.redis_down_s + 60)
        self.redis_down()

    def queue_counts(self) -> dict[str, int] | None:
        try:
            return self.store.counts(QUEUE)
        except redis.RedisError:
            return None

    # -- the run ------------------------------------------------------------

    def status(self) -> None:
        ready = sum(1 for s in self.slots if s.ready and s.alive())
        child = sum(1 for k in self.kills if k.kind == "child")
        self.say(
            f"published {len(self.published)}/{self.args.tasks}, "
            f"completed {len(self.ledger.completed)}, runs {len(self.ledger.runs)}, "
            f"kills {len(self.kills)} ({child} children), restarts {len(self.restarts)}, "
            f"lost writes {len(self.lost_writes)}, "
            f"workers ready {ready}/{len(self.slots)}"
        )

    def chaos_phase(self, chaos_end: float) -> None:
        a = self.args
        kill_at = [(i + 1) * 0.95 * a.tasks / max(a.kills, 1) for i in range(a.kills)]
        restart_at = [(j + 1) * a.tasks / (a.restarts + 1) for j in range(a.restarts)]
        # Between the restarts: at 1/4 of the tasks for one, 1/6 and 1/2 for two, ...
        lose_at = [(2 * j + 1) * a.tasks / (2 * a.lost_writes + 2) for j in range(a.lost_writes)]
        last_kill = 0.0
        next_status = time.monotonic() + 15
        next_id = 0
        while True:
            now = time.monotonic()
            if now > chaos_end:
                self.notes.append("chaos phase stopped at the duration limit")
                self.say(self.notes[-1])
                return
            if now > next_status:
                self.status()
                next_status = now + 15
            self.ledger.poll()
            self.tend_workers()
            done = self.done()
            if (
                not self.redis_down()
                and len(self.restarts) < a.restarts
                and done >= restart_at[len(self.restarts)]
            ):
                self.stop_redis()
            if (
                not self.redis_down()
                and len(self.lost_writes) < a.lost_writes
                and done >= lose_at[len(self.lost_writes)]
            ):
                self.lose_writes()
            kills = len(self.kills)
            if (
                kills < a.kills
                and done >= kill_at[kills]
                and now - last_kill >= a.kill_gap_s
                and self.kill_one()
            ):
                last_kill = now
            # Publish no further ahead of the next kill than a backlog, so that
            # every kill lands while tasks are still queued and running.
            kills = len(self.kills)
            cap = a.tasks if kills >= a.kills else min(a.tasks, int(kill_at[kills]) + a.backlog)
            if next_id < cap and next_id - done < a.backlog:
                for _ in range(min(a.batch, cap - next_id)):
                    task_id = f"chaos-{a.seed}-{next_id:07d}"
                    seconds = task_seconds(self.rng, a.lease_ms)
                    self.published[task_id] = self.publisher.publish(task_id, seconds)
                    self.published_at[task_id] = time.time()
                    next_id += 1
            if (
                next_id >= a.tasks
                and len(self.kills) >= a.kills
                and len(self.restarts) >= a.restarts
                and len(self.lost_writes) >= a.lost_writes
            ):
                return
            time.sleep(0.05)

    def drain(self, deadline: float) -> bool:
        """Wait until every published task completed and the queue holds nothing.

        A task whose publish a lost write took need not complete.
        """
        next_status = time.monotonic() + 15
        while time.monotonic() < deadline:
            self.ledger.poll()
            self.tend_workers()
            if time.monotonic() > next_status:
                self.status()
                next_status = time.monotonic() + 15
            self.update_taken()
            if all(t in self.ledger.completed or t in self.taken for t in self.published):
                counts = self.queue_counts()
                if counts is not None and counts["pending"] == 0 and counts["active"] == 0:
                    return True
            time.sleep(0.2)
        return False

    def run(self) -> dict[str, Any]:
        a = self.args
        deadline = self.t0 + a.duration_limit_s
        reserve = max(30.0, 0.2 * a.duration_limit_s)
        self.say(f"workdir {self.workdir}; redis on port {self.redis.port}")
        self.redis.start()
        self.tend_workers()
        self.wait_ready(min(120.0, a.duration_limit_s / 2))
        self.say("workers ready: " + ", ".join(s.hostname for s in self.slots))
        t_chaos = time.monotonic()
        self.chaos_phase(deadline - reserve)
        self.wait_redis_back()
        t_drain = time.monotonic()
        self.say("chaos done; draining")
        drained = self.drain(deadline)
        t_end = time.monotonic()
        if not drained:
            self.notes.append(f"not drained within the duration limit ({a.duration_limit_s} s)")
            self.say(self.notes[-1])
        self.ledger.poll()
        verdict = judge(
            self.published,
            self.ledger.runs.values(),
            self.kills,
            self.restarts,
            self.lost_writes,
            self.published_at,
        )
        counts = self.queue_counts() or {}
        try:
            metrics = self.store.metrics(QUEUE)
            fenced = self.store.fenced(QUEUE)
        except redis.RedisError:
            metrics, fenced = {}, {}
        findings = self.findings(verdict)
        child_kills = sum(1 for k in self.kills if k.kind == "child")
        targets_met = (
            len(self.published) >= a.tasks
            and len(self.kills) >= a.kills
            and len(self.restarts) >= a.restarts
            and len(self.lost_writes) >= a.lost_writes
        )
        ok = drained and verdict["lost"] == 0 and verdict["unexplained_reruns"] == 0
        return {
            "ok": ok,
            "targets_met": targets_met,
            "drained": drained,
            "args": vars(a),
            "workdir": str(self.workdir),
            "seconds": {
                "startup": round(t_chaos - self.t0, 1),
                "chaos": round(t_drain - t_chaos, 1),
                "drain": round(t_end - t_drain, 1),
                "total": round(t_end - self.t0, 1),
            },
            "kills": len(self.kills),
            "kills_of_workers": len(self.kills) - child_kills,
            "kills_of_children": child_kills,
            "kills_that_hit_running_tasks": sum(1 for k in self.kills if k.open_runs > 0),
            "redis_restarts": len(self.restarts),
            "lost_writes": len(self.lost_writes),
            "worker_starts": sum(s.incarnation for s in self.slots),
            "unexpected_worker_exits": len(self.exits),
            "publish_errors": self.publisher.errors,
            "publish_error_samples": self.publisher.error_samples,
            "queue_at_end": counts,
            "queue_counters": metrics,
            "settles_fenced": fenced,
            "ledger_bad_lines": self.ledger.bad_lines,
            "notes": self.notes,
            "verdict": verdict,
            "findings": findings,
            "kill_log": [asdict(k) for k in self.kills],
            "restart_log": [asdict(r) for r in self.restarts],
            "lost_writes_log": [asdict(w) for w in self.lost_writes],
            "exit_log": self.exits,
        }

    # -- findings -----------------------------------------------------------

    def findings(self, verdict: dict[str, Any]) -> list[dict[str, Any]]:
        """Detail each lost task and unexplained rerun: runs, job rows, log lines."""
        items: list[tuple[str, str]] = [("lost", t) for t in verdict["lost_tasks"]]
        items += [
            ("unexplained_rerun", d["task"])
            for d in verdict["rerun_details"]
            if d["explanation"] == "unexplained"
        ]
        out = []
        rows = self.job_rows({t for _, t in items[:MAX_FINDINGS]})
        for what, task in items[:MAX_FINDINGS]:
            runs = sorted(
                (r for r in self.ledger.runs.values() if r.task == task), key=lambda r: r.start
            )
            jobs = {r.job for r in runs if r.job} | set(rows.get(task, {}))
            out.append(
                {
                    "finding": what,
                    "task": task,
                    "publish_attempts": self.published.get(task),
                    "runs": [asdict(r) for r in runs],
                    "job_rows": rows.get(task, {}),
                    "log_lines": self.log_lines({task, *jobs}),
                }
            )
        return out

    def job_rows(self, tasks: set[str]) -> dict[str, dict[str, dict[str, str]]]:
        """The job rows still in Redis whose message carries one of ``tasks`` (bounded scan)."""
        found: dict[str, dict[str, dict[str, str]]] = {}
        if not tasks:
            return found
        k = self.store.keys(QUEUE)
        try:
            for n, key in enumerate(self.client.scan_iter(match=k.job_prefix + "*", count=1000)):
                if n >= 100_000:
                    break
                job_id = bytes(key).decode()[len(k.job_prefix) :]
                row = self.store.job(QUEUE, job_id)
                try:
                    task_id = json.loads(row.get("payload", "{}"))["headers"]["id"]
                except (ValueError, KeyError, TypeError):
                    continue
                if task_id in tasks:
                    row["payload"] = row["payload"][:300]
                    found.setdefault(task_id, {})[job_id] = row
        except redis.RedisError as exc:
            self.notes.append(f"job rows not read: {exc!r}")
        return found

    def log_lines(self, needles: set[str], most: int = 40) -> list[str]:
        lines: list[str] = []
        for log in sorted(self.logdir.glob("*.log")):
            with open(log, errors="replace") as fh:
                for line in fh:
                    if any(n in line for n in needles):
                        lines.append(f"{log.name}: {line.rstrip()[:400]}")
                        if len(lines) >= most:
                            return lines
        return lines

    def cleanup(self) -> None:
        if self.redis_back is not None:
            self.redis_back.join(self.args.redis_down_s + 60)
        for slot in self.slots:
            slot.kill_group()
        self.publisher.close()
        self.client.close()
        self.redis.stop()
        self.events.close()


def report(result: dict[str, Any]) -> str:
    v = result["verdict"]
    a = result["args"]
    why = v["reruns_by_explanation"]
    rows = [
        ("tasks published", f"{v['published']} (publish retried: {v['publish_retried']})"),
        (
            "kills",
            f"{result['kills']} ({result['kills_of_workers']} workers, "
            f"{result['kills_of_children']} prefork children; "
            f"{result['kills_that_hit_running_tasks']} hit a running task)",
        ),
        ("redis restarts", f"{result['redis_restarts']} (AOF, appendfsync always)"),
        (
            "restarts from a snapshot",
            f"{result['lost_writes']} (writes lost for "
            + ", ".join(f"{w['t_down'] - w['t_snap']:.1f} s" for w in result["lost_writes_log"])
            + ")",
        ),
        (
            "worker starts",
            f"{result['worker_starts']}, exits not caused: {result['unexpected_worker_exits']}",
        ),
        ("runs", f"{v['runs']} ({v['runs_interrupted']} interrupted)"),
        (
            "recovery after a worker kill",
            f"median {v['recovery_s']['median']} s, max {v['recovery_s']['max']} s "
            f"(over {v['recovery_s']['kills']} kills that interrupted a task)",
        ),
        ("completed", str(v["completed"])),
        ("LOST", str(v["lost"])),
        (
            "publishes a lost write took",
            f"{v['publishes_taken_by_lost_writes']} (never run: {len(v['taken_and_never_run'])})",
        ),
        (
            "duplicated tasks",
            f"{v['duplicated_tasks']} (extra completions: {v['extra_completions']})",
        ),
        ("reruns of a completed job", str(v["reruns"])),
        ("  kill while running", str(why["kill_while_running"])),
        ("  kill before ack", str(why["kill_before_ack"])),
        (
            "  redis restart",
            f"{why['redis_restart']} (among the causes of "
            f"{v['reruns_a_redis_restart_may_explain']})",
        ),
        ("  publish retry", str(why["publish_retry"])),
        (
            "  lost write",
            f"{why['lost_write']} (among the causes of {v['reruns_a_lost_write_may_explain']})",
        ),
        ("  UNEXPLAINED", str(why["unexplained"])),
        ("reruns on an older claim", str(v["reruns_on_an_older_claim"])),
        ("concurrent runs of a job", str(v["concurrent_runs"])),
        (
            "most runs per task",
            f"{v['most_runs_per_task']} (most completed: {v['most_completed_runs_per_task']})",
        ),
        ("queue at end", json.dumps(result["queue_at_end"])),
        ("queue counters", json.dumps(result["queue_counters"])),
        ("settles fenced", json.dumps(result["settles_fenced"])),
        ("seconds", json.dumps(result["seconds"])),
    ]
    width = max(len(k) for k, _ in rows)
    head = (
        f"chaos: {a['tasks']} tasks, {a['kills']} kills, {a['restarts']} restarts, "
        f"{a['lost_writes']} lost writes, "
        f"pools {a['pools']}, lease {a['lease_ms']} ms, seed {a['seed']}"
    )
    lines = [head, *(f"  {k:<{width}}  {val}" for k, val in rows)]
    lines += [f"  note: {n}" for n in result["notes"]]
    verdict = "PASS" if result["ok"] else "FAIL"
    if result["ok"] and not result["targets_met"]:
        verdict = "PASS (targets not met)"
    lines.append(f"verdict: {verdict}")
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tasks", type=int, default=20_000)
    ap.add_argument("--kills", type=int, default=300, help="SIGKILLs of workers and children")
    ap.add_argument("--restarts", type=int, default=2, help="Redis restarts")
    ap.add_argument(
        "--lost-writes", type=int, default=0, help="Redis restarts from a snapshot (SIGKILL)"
    )
    ap.add_argument(
        "--snapshot-lag-s", type=float, default=1.0, help="writes lost: snapshot to crash"
    )
    ap.add_argument("--duration-limit-s", type=float, default=1200)
    ap.add_argument("--lease-ms", type=int, default=3000)
    ap.add_argument("--sweep-s", type=float, default=0.5, help="sweep_interval_s")
    ap.add_argument("--max-stalled", default="none", help="a number, or none (never dead-letter)")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--json", type=Path, help="write the result here")
    ap.add_argument(
        "--pools", default="prefork:2,threads:4,solo:1", help="one worker per pool:concurrency"
    )
    ap.add_argument("--child-kill-share", type=float, default=0.5)
    ap.add_argument("--kill-gap-s", type=float, default=0.3, help="least time between kills")
    ap.add_argument("--backlog", type=int, default=300, help="most tasks published ahead")
    ap.add_argument("--batch", type=int, default=50, help="tasks per publish batch")
    ap.add_argument("--redis-down-s", type=float, default=2.0)
    ap.add_argument("--redis-signal", choices=("term", "kill"), default="term")
    ap.add_argument("--workdir", help="logs, ledger and Redis data (default: a new temp dir)")
    args = ap.parse_args(argv)
    for name in ("tasks", "kills", "restarts", "lost_writes", "lease_ms", "backlog", "batch"):
        if getattr(args, name) < (1 if name in ("tasks", "lease_ms", "backlog", "batch") else 0):
            ap.error(f"--{name.replace('_', '-')} is out of range")
    return args


def _interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    # Set both: a shell starts a background job with SIGINT ignored.
    signal.signal(signal.SIGINT, _interrupt)
    signal.signal(signal.SIGTERM, _interrupt)
    chaos = Chaos(args)
    result: dict[str, Any]
    try:
        result = chaos.run()
    except (Exception, KeyboardInterrupt) as exc:
        chaos.say(f"aborted: {exc!r}")
        result = {"ok": False, "aborted": repr(exc), "workdir": str(chaos.workdir)}
        if args.json:
            args.json.write_text(json.dumps(result, indent=1, default=str))
        return 130 if isinstance(exc, KeyboardInterrupt) else 1
    finally:
        # A second Ctrl-C must not cut the cleanup short.
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        chaos.cleanup()
    if args.json:
        args.json.write_text(json.dumps(result, indent=1, default=str))
    print(report(result), flush=True)
    if not result["ok"]:
        for f in result["findings"][:5]:
            print(json.dumps(f, indent=1, default=str)[:4000])
        return 1
    return 0 if result["targets_met"] else 2


if __name__ == "__main__":
    sys.exit(main())
