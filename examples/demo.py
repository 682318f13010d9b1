"""The celery_emq demo: real workers on an ``emq://`` broker, narrated.

Run it with ``scripts/demo`` (which sets up Redis and the venv). It ends with a
summary table and exits non-zero if anything it shows did not happen.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import redis

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from celery_emq.store import JobStore  # noqa: E402
from examples.demo_app import LEASE_MS, PREFIX, REDIS_URL, app  # noqa: E402

results: list[tuple[str, bool, str]] = []


def say(text: str) -> None:
    print(f"[demo] {text}", flush=True)


def check(name: str, ok: bool, detail: str) -> None:
    results.append((name, ok, detail))
    say(f"{'ok  ' if ok else 'FAIL'} {name}: {detail}")


def wait_for(cond: Callable[[], bool], timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.1)
    return False


def clean(client: redis.Redis) -> None:
    keys = list(client.scan_iter(match=PREFIX + "*", count=1000))
    for i in range(0, len(keys), 500):
        client.delete(*keys[i : i + 500])


def start_worker(name: str, log: Path) -> subprocess.Popen[bytes]:
    fh = open(log, "wb")
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "celery",
            "-A",
            "examples.demo_app",
            "worker",
            "-c",
            "2",
            "-n",
            f"{name}@%h",
            "--without-mingle",
            "--without-gossip",
            "-l",
            "info",
        ],
        cwd=ROOT,
        stdout=fh,
        stderr=subprocess.STDOUT,
        start_new_session=True,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )


def stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)


def main() -> int:
    client = redis.Redis.from_url(REDIS_URL)
    clean(client)
    store = JobStore(client, PREFIX + "emq", LEASE_MS)
    logdir = ROOT / ".emq"
    logdir.mkdir(exist_ok=True)
    say(f"broker {app.conf.broker_url} (key prefix {PREFIX!r}), lease {LEASE_MS} ms")
    worker = start_worker("demo1", logdir / "demo-worker1.log")
    try:
        ready = wait_for(lambda: bool(app.control.ping(timeout=0.5)), 30)
        check("worker starts", ready, "celery@demo1 answers ping" if ready else "no answer")
        if not ready:
            return 1

        say("1. tasks flow: 500 additions through a prefork worker")
        t = time.perf_counter()
        res = [app.send_task("examples.demo_app.add", args=(i, i)) for i in range(500)]
        total = sum(r.get(timeout=60) for r in res)
        took = time.perf_counter() - t
        check(
            "tasks flow",
            total == 2 * sum(range(500)),
            f"500 results in {took:.2f} s ({500 / took:.0f}/s)",
        )

        say(f"2. a 4x-lease task: slow({LEASE_MS * 4 / 1000:g}) under a {LEASE_MS} ms lease")
        slow = app.send_task("examples.demo_app.slow", args=(LEASE_MS * 4 / 1000,))
        k = store.keys("celery")
        deadlines: list[float] = []
        while not slow.ready():
            for _, score in client.zrange(k.active, 0, -1, withscores=True):
                deadlines.append(score)
            time.sleep(1)
        renewed = len(set(deadlines))
        runs = int(client.hget(PREFIX + "runs", "slow") or 0)
        check(
            "lease renewed while running", renewed >= 3, f"lease deadline moved {renewed - 1} times"
        )
        check("long task ran once", runs == 1 and slow.get() > 0, f"runs={runs}")

        say("3. warm shutdown releases unstarted deliveries at once")
        for _ in range(6):
            app.send_task("examples.demo_app.slow", args=(1,))
        wait_for(lambda: store.counts("celery")["active"] >= 4, 10)
        stop(worker)
        counts = store.counts("celery")
        check(
            "released on shutdown",
            counts["active"] == 0 and counts["pending"] > 0,
            f"after exit: {counts}",
        )
        worker = start_worker("demo2", logdir / "demo-worker2.log")
        drained = wait_for(
            lambda: store.counts("celery") == {"pending": 0, "active": 0, "dead": 0}, 30
        )
        check("next worker runs them", drained, f"queue now {store.counts('celery')}")
    finally:
        stop(worker)
        clean(client)

    print()
    print(f"{'step':32} {'result':6}  detail")
    for name, ok, detail in results:
        print(f"{name:32} {'ok' if ok else 'FAIL':6}  {detail}")
    return 0 if all(ok for _, ok, _ in results) else 1


if __name__ == "__main__":
    sys.exit(main())
