"""The celery_emq demo: real workers on an ``emq://`` broker, narrated.

Run it with ``scripts/demo`` (which sets up the venv and a Redis). It shows tasks
flowing, a SIGKILLed worker's task recovered by the sweep, a poison task
dead-lettered after its budget with the failure handler firing, the morgue
listed and one job replayed with ``celery emq``, and a task running four times
longer than its lease exactly once. It ends with a summary table and exits
non-zero if any of it did not happen.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import redis

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("EMQ_DEMO_REDIS_URL", "redis://127.0.0.1:6379/13")

from celery_emq import StalledJobError  # noqa: E402
from celery_emq.store.jobstore import JobStore  # noqa: E402
from examples._support import clean, running, wait_for, worker  # noqa: E402
from examples.demo_app import LEASE_MS, PREFIX, REDIS_URL, app  # noqa: E402

results: list[tuple[str, bool, str]] = []

#: Step 4's narration. The poison task kills its process unless a flag is set in
#: Redis: setting it stands for deploying the fix, which is what to do before a retry.
RETRY_STEP = (
    "4. the morgue: `celery -A examples.demo_app emq dead ls`; then the demo sets "
    f"`{PREFIX}cured:poison` (the task stops crashing, as after a fix is deployed) and "
    "replays the job with `emq dead retry`"
)


def last_step() -> str:
    """Step 6's narration: where the job it dead-letters is left."""
    if os.environ.get("EMQ_PRIVATE_REDIS_STARTED") == "1":
        return (
            "6. one more poison task, dead-lettered into the morgue; the private Redis "
            "stops with the demo, and the job with it (run without EMQ_PRIVATE_REDIS=1 "
            "to keep it and retry it by hand)"
        )
    return "6. one more poison task, left in the morgue for you to look at"


client = redis.Redis.from_url(REDIS_URL)
store = JobStore(client, PREFIX + "emq", LEASE_MS)


def say(text: str) -> None:
    print(f"[demo] {text}", flush=True)


def check(name: str, ok: bool, detail: str) -> None:
    results.append((name, ok, detail))
    say(f"  {'ok  ' if ok else 'FAIL'} {name}: {detail}")


def runs(tag: str) -> list[tuple[float, str]]:
    out = []
    for raw in client.lrange(f"{PREFIX}runs:{tag}", 0, -1):
        at, host = raw.decode().split(" ", 1)
        out.append((float(at), host))
    return out


def cli(*args: str) -> str:
    done = subprocess.run(
        [sys.executable, "-m", "celery", "-A", "examples.demo_app", "emq", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    print("\n".join(f"    | {line}" for line in done.stdout.rstrip().splitlines()), flush=True)
    if done.returncode:
        raise SystemExit(f"celery emq {' '.join(args)} failed: {done.stderr.strip()}")
    return done.stdout


def main() -> None:
    clean(PREFIX, REDIS_URL)
    t_start = time.monotonic()
    say(
        f"broker {app.conf.broker_url} (key prefix {PREFIX!r}), lease {LEASE_MS} ms, "
        "max_stalled 1, sweep every 1 s"
    )
    w1 = worker("examples.demo_app", "demo1", "-c", "2")
    w2 = worker("examples.demo_app", "demo2", "-c", "2")
    workers = {"demo1": w1, "demo2": w2}
    with running(w1, w2):
        say("1. tasks flow: 300 additions across two prefork workers")
        t = time.perf_counter()
        res = [app.send_task("examples.demo_app.add", args=(i, i)) for i in range(300)]
        total = sum(r.get(timeout=60) for r in res)
        took = time.perf_counter() - t
        check(
            "tasks flow",
            total == 2 * sum(range(300)),
            f"300 results in {took:.2f} s ({300 / took:.0f}/s)",
        )

        say("2. a worker is SIGKILLed mid-task; the sweep recovers its task")
        victim = app.send_task("examples.demo_app.slow", args=(2, "victim"))
        first = wait_for(lambda: runs("victim"), 15)
        host = first[0][1].split("@")[0] if first else "demo1"
        killed_at = time.time()
        workers[host].kill()
        say(f"   SIGKILL {host} at its task's first second")
        again = wait_for(lambda: len(runs("victim")) >= 2 and runs("victim"), 30)
        took_s = again[1][0] - killed_at if again else float("nan")
        done = victim.get(timeout=30) == 2 if again else False
        check(
            "killed worker's task recovered",
            bool(again) and done,
            f"restarted on {again[1][1] if again else '-'} {took_s:.1f} s after the kill"
            f" (lease {LEASE_MS / 1000:g} s + sweep)",
        )

        # The long task starts now, on the surviving worker, and is checked in step 5.
        long_task = app.send_task("examples.demo_app.slow", args=(LEASE_MS * 4 / 1000, "long"))
        say("3. a poison task kills its process every run: max_stalled=1 allows one recovery")
        poison = app.send_task("examples.demo_app.crash", args=("poison",))
        try:
            poison.get(timeout=60)
            raised = ""
        except StalledJobError as exc:
            raised = type(exc).__name__
        alerts = wait_for(lambda: client.lrange(f"{PREFIX}alerts", 0, -1), 10) or []
        check(
            "poison dead-lettered",
            raised == "StalledJobError" and len(runs("poison")) == 2,
            f"ran {len(runs('poison'))} times, AsyncResult.get() raised {raised or 'nothing'}",
        )
        check(
            "failure handler fired once",
            len(alerts) == 1,
            alerts[0].decode() if alerts else "no alert",
        )

        say(RETRY_STEP)
        listing = cli("dead", "ls")
        [job] = [j for j in store.client.zrange(store.keys("celery").dead, 0, -1)]
        check(
            "morgue lists it",
            job.decode() in listing and "worker_lost" in listing,
            f"job {job.decode()[:8]}... reason worker_lost",
        )
        client.set(f"{PREFIX}cured:poison", 1)
        cli("dead", "retry", job.decode())
        replayed = wait_for(lambda: len(runs("poison")) == 3, 30)
        check(
            "replayed job runs",
            bool(replayed) and store.counts("celery")["dead"] == 0,
            f"run {len(runs('poison'))} succeeded; morgue now empty",
        )

        say(f"5. a task {LEASE_MS * 4 / 1000:g} s long under a {LEASE_MS / 1000:g} s lease")
        value = long_task.get(timeout=60)
        check(
            "long task ran once",
            value > 0 and len(runs("long")) == 1,
            f"runs={len(runs('long'))}, its lease renewed by its worker",
        )

        say(last_step())
        left = app.send_task("examples.demo_app.crash", args=("left",))
        try:
            left.get(timeout=60)
        except StalledJobError:
            pass
        check(
            "morgue holds it",
            store.counts("celery")["dead"] == 1,
            f"task {left.id[:8]}... dead after {len(runs('left'))} runs",
        )
        # Cured (its fix "deployed") so that retrying it by hand succeeds.
        client.set(f"{PREFIX}cured:left", 1)
        cli("status")

    print()
    print(f"{'step':32} {'result':6}  detail")
    for name, ok, detail in results:
        print(f"{name:32} {'ok' if ok else 'FAIL':6}  {detail}")
    print(f"\ndemo took {time.monotonic() - t_start:.0f} s")
    if os.environ.get("EMQ_PRIVATE_REDIS_STARTED") != "1":
        env = f"EMQ_DEMO_REDIS_URL={REDIS_URL}"
        print(
            f"\nOne dead job is left in the morgue, cured ({PREFIX}cured:left is set, as if"
            " its fix were deployed), so a retry by hand succeeds"
        )
        print("(the demo's keys are deleted when it runs next):")
        print(f"  {env} .venv/bin/celery -A examples.demo_app emq dead ls")
        print(f"  {env} .venv/bin/celery -A examples.demo_app emq dead retry --all")
        print(f"  {env} .venv/bin/celery -A examples.demo_app worker   # runs what you retried")
    sys.exit(0 if results and all(ok for _, ok, _ in results) else 1)


if __name__ == "__main__":
    main()
