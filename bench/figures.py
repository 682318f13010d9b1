"""The transport comparisons: one round of each figure through ``redis://`` or ``emq://``.

Every round runs in a fresh key prefix (kombu's ``global_keyprefix``, under
which ``emq://`` keeps its own keys too), starts its own worker of
``bench/app.py`` and publishes from a child process (``bench/publish.py``).
Its keys are deleted by SCAN afterwards. Each function returns the round's
figures as a dict of floats (or ``None`` for what does not apply).
"""

from __future__ import annotations

import importlib.util
import json
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import redis
from celery import Celery

from bench._common import (
    ROOT,
    accounted,
    bench_worker,
    dataset_bytes,
    round_env,
    scan_delete,
    tree_rss_bytes,
)
from bench.monitor import Monitor
from celery_emq.store.jobstore import JobStore
from celery_emq.store.status import queue_status

STOCK, EMQ = "redis", "emq"
#: The one queue every round publishes to (Celery's default).
QUEUE = "celery"

Round = dict[str, Any]


@dataclass(frozen=True)
class Target:
    """The Redis a round runs on (one database of it)."""

    host: str
    port: int
    db: int

    def env(self, scheme: str, **extra: str) -> dict[str, str]:
        return round_env(scheme, self.host, self.port, self.db, **extra)


def roundtrips_available() -> bool:
    """Whether ``bench/roundtrips.py`` (the round-trip counter) is there."""
    return importlib.util.find_spec("bench.roundtrips") is not None


class Broker:
    """What the broker holds in the round's queue, read the transport's own way."""

    def __init__(self, scheme: str, env: dict[str, str]) -> None:
        self.scheme = scheme
        self.prefix = env["BENCH_PREFIX"]
        self.client = redis.Redis.from_url(env["BENCH_RECORD"])
        self.store = JobStore(self.client, self.prefix + "emq", 30_000)

    def pending(self) -> int:
        """Messages waiting for a worker."""
        if self.scheme == EMQ:
            return self.store.counts(QUEUE)["pending"]
        return int(self.client.llen(self.prefix + QUEUE))

    def held(self) -> int:
        """Messages a worker holds: claimed (emq) or in the unacked hash (stock)."""
        if self.scheme == EMQ:
            return self.store.counts(QUEUE)["active"]
        return int(self.client.hlen(self.prefix + "unacked"))

    def status_delayed(self) -> int | None:
        """``celery emq status``'s delayed count (emq only)."""
        if self.scheme != EMQ:
            return None
        return int(queue_status(self.store, QUEUE)["delayed"])


def wait_until(check: Callable[[], bool], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        if time.monotonic() > deadline:
            raise RuntimeError(f"timed out after {timeout_s:g} s waiting for {what}")
        time.sleep(0.05)


@contextmanager
def round_keys(env: dict[str, str]) -> Iterator[redis.Redis]:
    """Yield a client on the round's database; delete the round's keys afterwards."""
    client = accounted(redis.Redis.from_url(env["BENCH_RECORD"]))
    try:
        yield client
    finally:
        scan_delete(client, env["BENCH_PREFIX"])
        client.close()


def publish(env: dict[str, str], task: str, n: int, *options: str, timeout_s: float) -> float:
    """Publish ``n`` tasks from a child process; return the seconds of the timed part."""
    out = subprocess.run(
        [sys.executable, "-m", "bench.publish", task, str(n), *options],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout_s,
    )
    if out.returncode:
        raise RuntimeError(f"publisher failed ({out.returncode}): {out.stderr[-3000:]}")
    return float(out.stdout.strip().splitlines()[-1])


def send(env: dict[str, str], task: str, *args: Any) -> None:
    """Send one task from this process (a warm-up, not timed)."""
    app = Celery("bench-send", broker=env["BENCH_BROKER"], set_as_current=False)
    app.conf.broker_transport_options = {"global_keyprefix": env["BENCH_PREFIX"]}
    try:
        app.send_task(f"bench.app.{task}", args=args)
    finally:
        app.close()


def worker_ready(env: dict[str, str], client: redis.Redis, timeout_s: float) -> None:
    """Wait until the round's worker has run one ``tick``."""
    send(env, "tick")
    prefix = env["BENCH_PREFIX"]
    wait_until(lambda: int(client.get(prefix + "count") or 0) >= 1, timeout_s, "a worker")


def drain_round(
    target: Target,
    scheme: str,
    pool: str,
    concurrency: int,
    acks_late: bool,
    n: int,
    timeout_s: float,
) -> Round:
    """Publish ``n`` no-op ``drained`` tasks, then drain them with one worker.

    Returns the publish rate (tasks/s, the publisher alone), the Redis memory
    the queued tasks hold (bytes each) and the drain rate: from the first
    task's start to the last one's, as each worker process noted them in
    memory and reported when it stopped.
    """
    env = target.env(scheme, BENCH_ACKS_LATE="1" if acks_late else "0")
    broker = Broker(scheme, env)
    with round_keys(env) as client:
        mem0 = dataset_bytes(client)
        publish_s = publish(env, "drained", n, timeout_s=timeout_s)
        mem1 = dataset_bytes(client)
        with bench_worker(env, concurrency, pool=pool, cleanup=False):
            wait_until(
                lambda: broker.pending() == 0 and broker.held() == 0, timeout_s, f"{n} tasks acked"
            )
        # Stopped warm: every task that started has finished and been noted.
        notes = [json.loads(x) for x in client.lrange(env["BENCH_PREFIX"] + "drained", 0, -1)]
    ran = sum(x["count"] for x in notes)
    if ran != n:
        raise RuntimeError(f"{scheme}: {ran} of {n} drained tasks reported running")
    first = min(x["first"] for x in notes)
    last = max(x["last"] for x in notes)
    return {
        "publish_per_s": (n - 1) / publish_s,
        "bytes_per_queued_task": (mem1 - mem0) / n,
        "drain_per_s": (n - 1) / (last - first),
    }


#: ``max_size`` of the batched publish figure (kombu's default).
BATCH_MAX_SIZE = 1000


def publish_round(target: Target, scheme: str, n: int, timeout_s: float) -> Round:
    """Publish ``n`` ``noop`` tasks one by one, then ``n`` inside ``Producer.batch()``.

    Returns both rates (tasks/s, the publisher alone); no worker runs. A
    batched round ends once the batch's last flush returned.
    """
    env = target.env(scheme)
    with round_keys(env):
        single_s = publish(env, "noop", n, timeout_s=timeout_s)
    env = target.env(scheme)
    with round_keys(env):
        batched_s = publish(env, "noop", n, "--batch", str(BATCH_MAX_SIZE), timeout_s=timeout_s)
    return {
        "publish_single_per_s": (n - 1) / single_s,
        "publish_batched_per_s": (n - 1) / batched_s,
    }


def latency_round(
    target: Target, scheme: str, rate: float, seconds: float, timeout_s: float
) -> Round:
    """Publish ``stamp`` tasks at ``rate`` a second to one prefork ``-c 2`` worker (acks_late).

    Each task records its start time less the publish time it carries; the
    round returns their p50 and p99 (ms).
    """
    n = max(int(rate * seconds), 2)
    env = target.env(scheme, BENCH_ACKS_LATE="1")
    key = env["BENCH_PREFIX"] + "latency"
    with round_keys(env) as client, bench_worker(env, 2):
        worker_ready(env, client, timeout_s)
        publish(env, "stamp", n, "--rate", str(rate), timeout_s=timeout_s + seconds)
        wait_until(lambda: int(client.llen(key)) >= n, timeout_s, f"{n} stamped tasks")
        lat = sorted(float(x) * 1000 for x in client.lrange(key, 0, -1))
    return {"latency_p50_ms": _pct(lat, 50), "latency_p99_ms": _pct(lat, 99), "n": n}


def held_round(target: Target, scheme: str, n: int, timeout_s: float) -> Round:
    """Redis memory per task a worker holds claimed but has not acked.

    One prefork ``-c 2`` worker, acks_late, prefetch multiplier ``n`` (so it
    may reserve all ``n``), is running and idle; then ``n`` ``nap`` tasks are
    published: two run (sleeping), the rest wait reserved in the worker. Once
    the queue is empty and the broker shows all ``n`` held, the growth of
    Redis's memory (less client buffers) over the idle worker's, divided by
    ``n``, is the memory per held task. The worker is killed afterwards.
    """
    env = target.env(scheme, BENCH_ACKS_LATE="1", BENCH_PREFETCH=str(n))
    broker = Broker(scheme, env)
    with round_keys(env) as client, bench_worker(env, 2, kill=True):
        worker_ready(env, client, timeout_s)
        time.sleep(1)
        mem0 = dataset_bytes(client)
        publish(env, "nap", n, "--arg", "600", timeout_s=timeout_s)
        wait_until(
            lambda: broker.pending() == 0 and broker.held() >= n, timeout_s, f"{n} tasks held"
        )
        time.sleep(0.5)
        mem1 = dataset_bytes(client)
    return {"bytes_per_held_task": (mem1 - mem0) / n}


def delayed_round(
    target: Target, scheme: str, n: int, timeout_s: float, settle_s: float = 5
) -> Round:
    """``n`` tasks published with ``countdown=3600`` to a running prefork ``-c 2`` worker.

    Measures, from the idle worker before publishing to the settled state
    (the queue empty, then the worker's RSS steady): the Redis memory per
    delayed task (less client buffers), the RSS growth of the worker's main
    process and its pool children (``/proc``), and what ``celery emq status``
    shows as delayed (emq only).
    """
    env = target.env(scheme)
    broker = Broker(scheme, env)
    with round_keys(env) as client, bench_worker(env, 2, kill=True) as worker:
        worker_ready(env, client, timeout_s)
        time.sleep(2)
        rss0 = tree_rss_bytes(worker.pid)
        mem0 = dataset_bytes(client)
        publish_s = publish(env, "noop", n, "--countdown", "3600", timeout_s=timeout_s)
        wait_until(lambda: broker.pending() == 0, timeout_s, f"{n} delayed tasks taken")
        rss1 = _steady_rss(worker.pid, settle_s, timeout_s)
        mem1 = dataset_bytes(client)
        held = broker.held()
        shown = broker.status_delayed()
    return {
        "bytes_per_delayed_task": (mem1 - mem0) / n,
        "rss_before_mb": rss0 / 2**20,
        "rss_after_mb": rss1 / 2**20,
        "rss_growth_mb": (rss1 - rss0) / 2**20,
        "held_by_worker": held,
        "status_delayed": shown,
        "publish_per_s": (n - 1) / publish_s,
        "n": n,
    }


def roundtrips_round(
    target: Target, scheme: str, n: int, timeout_s: float, idle_s: float = 3
) -> Round:
    """Client round trips per task, end to end: the publisher's and the worker's.

    One prefork ``-c 2`` worker (acks_late) and a publisher process each count
    every redis-py round trip they make (``bench/roundtrips.py``). The worker's
    count over the drain of ``n`` ``noop`` tasks, less its idle rate (measured
    for ``idle_s`` just before) over the same time, plus the publisher's whole
    count, divided by ``n``.
    """
    env = target.env(scheme, BENCH_ACKS_LATE="1")
    prefix = env["BENCH_PREFIX"]
    worker_key, pub_key = prefix + "rt:worker", prefix + "rt:publisher"
    counted = {**env, "BENCH_ROUNDTRIPS_URL": env["BENCH_RECORD"]}
    env_worker = {**counted, "BENCH_ROUNDTRIPS_KEY": worker_key}
    env_pub = {**counted, "BENCH_ROUNDTRIPS_KEY": pub_key}
    broker = Broker(scheme, env)
    with round_keys(env) as client, bench_worker(env_worker, 2):

        def count() -> tuple[float, int]:
            return time.monotonic(), int(client.get(worker_key) or 0)

        worker_ready(env, client, timeout_s)
        time.sleep(2)
        t0, c0 = count()
        time.sleep(idle_s)
        t1, c1 = count()
        idle_rate = (c1 - c0) / (t1 - t0)
        publish(env_pub, "noop", n, timeout_s=timeout_s)
        wait_until(
            lambda: broker.pending() == 0 and broker.held() == 0, timeout_s, f"{n} tasks acked"
        )
        time.sleep(1)  # the last acks' own round trips land
        t2, c2 = count()
        published = int(client.get(pub_key) or 0)
    worker = (c2 - c1) - idle_rate * (t2 - t1)
    return {
        "rt_publisher_per_task": published / n,
        "rt_worker_per_task": worker / n,
        "rt_per_task": (published + worker) / n,
        "rt_worker_idle_per_s": idle_rate,
    }


def idle_round(
    target: Target, scheme: str, seconds: float, settle_s: float, timeout_s: float
) -> Round:
    """Redis commands a second from one idle prefork ``-c 2`` worker.

    Counts, over ``seconds`` once the worker has settled, the commands clients
    send (``MONITOR``, a script call counted once, this function's own left
    out): ``idle_commands_per_s``; and every command the server processes
    (``INFO``, scripts' inner commands too): ``idle_processed_per_s``. On a
    Redis that others use the figures count their commands too.
    """
    env = target.env(scheme)
    with round_keys(env) as client, bench_worker(env, 2, "--without-heartbeat"):
        worker_ready(env, client, timeout_s)
        time.sleep(settle_s)
        own = redis.Redis.from_url(env["BENCH_RECORD"], single_connection_client=True)
        # No socket timeout: an idle worker may send nothing for longer than redis-py's default.
        monitor = Monitor(
            redis.Redis.from_url(env["BENCH_RECORD"], socket_timeout=None),
            {own.client_info()["addr"]},
        )
        monitor.start()
        try:
            t0 = time.monotonic()
            before = int(own.info("stats")["total_commands_processed"])
            monitor.counting = True
            time.sleep(seconds)
            monitor.counting = False
            after = int(own.info("stats")["total_commands_processed"])
            elapsed = time.monotonic() - t0
        finally:
            monitor.close()
            own.close()
    return {
        "idle_commands_per_s": sum(monitor.sent.values()) / elapsed,
        "idle_processed_per_s": (after - before - 1) / elapsed,
    }


def _steady_rss(pid: int, settle_s: float, timeout_s: float) -> int:
    """Wait ``settle_s``, then until two reads a second apart differ by under 1 %."""
    time.sleep(settle_s)
    deadline = time.monotonic() + timeout_s
    last = tree_rss_bytes(pid)
    while time.monotonic() < deadline:
        time.sleep(1)
        now = tree_rss_bytes(pid)
        if abs(now - last) <= 0.01 * last:
            return now
        last = now
    return last


def _pct(sorted_values: list[float], pct: float) -> float:
    """The ``pct`` percentile (nearest rank) of sorted values."""
    if not sorted_values:
        return float("nan")
    rank = max(1, -(-len(sorted_values) * pct // 100))
    return sorted_values[int(rank) - 1]


def median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")
