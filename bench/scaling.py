"""emq only: how the store's hot paths scale, on a private ``redis-server``.

Drives :class:`celery_emq.store.JobStore`, :class:`celery_emq.transport.sweeper.Sweeper`,
:func:`celery_emq.store.status.queue_status` and Flower's queue-length client directly
(no worker), on a Redis of its own: a million pending jobs take over a gigabyte.

- claim latency: one ``claim`` of one job, timed from the client, from a queue
  of 1,000 and one of 1,000,000 pending jobs, taking turns (each claim is
  acked and replaced, untimed, so the queues keep their sizes);
- sweep: one :meth:`Sweeper.sweep` pass over a queue holding 100,000 claimed
  jobs whose leases are far from lapsing;
- status: :func:`queue_status`, and the queue length Flower reads, on a queue
  with 10,000 fair lanes (groups) of two jobs each, 1,000 of them claimed.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor
from multiprocessing import get_context
from typing import Any

import redis

from bench._common import accounted, dataset_bytes, private_redis
from bench.figures import _pct
from celery_emq.options import EmqOptions
from celery_emq.store.jobstore import JobStore
from celery_emq.store.status import queue_status
from celery_emq.transport.sweeper import Sweeper

PREFIX = "emqbench"
#: Leases long enough that nothing lapses while the figures are taken.
LEASE_MS = 3_600_000
OWNER = "bench-owner"
#: The most jobs one claim script call takes.
CLAIM_MAX = 1000

#: A payload the size and shape of a Celery task message (~0.9 KB).
PAYLOAD = json.dumps(
    {
        "body": "W1tdLCB7fSwgeyJjYWxsYmFja3MiOiBudWxsLCAiZXJyYmFja3MiOiBudWxsLCAiY2hhaW4iOiBudWxs"
        "LCAiY2hvcmQiOiBudWxsfV0=",
        "content-encoding": "utf-8",
        "content-type": "application/json",
        "headers": {
            "lang": "py",
            "task": "bench.app.noop",
            "id": "00000000-0000-0000-0000-000000000000",
            "shadow": None,
            "eta": None,
            "expires": None,
            "group": None,
            "group_index": None,
            "retries": 0,
            "timelimit": [None, None],
            "root_id": "00000000-0000-0000-0000-000000000000",
            "parent_id": None,
            "argsrepr": "()",
            "kwargsrepr": "{}",
            "origin": "gen1234@bench-host",
            "ignore_result": True,
            "replaced_task_nesting": 0,
            "stamped_headers": None,
            "stamps": {},
        },
        "properties": {
            "correlation_id": "00000000-0000-0000-0000-000000000000",
            "reply_to": "00000000-0000-0000-0000-000000000000",
            "delivery_mode": 2,
            "delivery_info": {"exchange": "", "routing_key": "celery"},
            "priority": 0,
            "body_encoding": "base64",
            "delivery_tag": "00000000-0000-0000-0000-000000000000",
        },
    }
)


def _fill_part(url: str, queue: str, start: int, stop: int, lanes: int) -> int:
    store = JobStore(redis.Redis.from_url(url), PREFIX, LEASE_MS)
    for i in range(start, stop):
        store.enqueue(queue, f"j{i}", PAYLOAD, group=f"g{i % lanes:05d}" if lanes else "")
    return stop - start


def fill(url: str, queue: str, n: int, lanes: int = 0, procs: int = 2) -> None:
    """Enqueue ``n`` jobs through :meth:`JobStore.enqueue` from ``procs`` processes."""
    step = -(-n // procs)
    parts = [(url, queue, i, min(i + step, n), lanes) for i in range(0, n, step)]
    with ProcessPoolExecutor(len(parts), mp_context=get_context("fork")) as ex:
        done = sum(ex.map(_fill_part, *zip(*parts, strict=True)))
    if done != n:
        raise RuntimeError(f"filled {done} of {n} jobs")


def claim_latency(
    store: JobStore, queues: Sequence[str], samples: int, warmup: int = 50
) -> dict[str, dict[str, float]]:
    """Time one-job claims from each of ``queues``, taking turns between them.

    Taking turns puts machine noise on every queue alike, so their ratio
    holds even when the absolute times drift. Each claimed job is acked and
    replaced (untimed), so every queue keeps its size.
    """
    times: dict[str, list[float]] = {q: [] for q in queues}
    for i in range(warmup + samples):
        for queue in queues:
            t0 = time.perf_counter()
            got = store.claim(queue, OWNER, 1)
            dt = time.perf_counter() - t0
            if len(got) != 1:
                raise RuntimeError(f"claim from {queue} returned {len(got)} jobs")
            store.ack(queue, got[0].id, got[0].token)
            store.enqueue(queue, f"r{i}", PAYLOAD)
            if i >= warmup:
                times[queue].append(dt * 1000)
    out = {}
    for queue, ms in times.items():
        ms.sort()
        out[queue] = {"p50_ms": _pct(ms, 50), "p99_ms": _pct(ms, 99), "n": samples}
    return out


def claim_many(store: JobStore, queue: str, n: int) -> None:
    """Claim ``n`` jobs (under the long lease), in calls of at most ``CLAIM_MAX``."""
    taken = 0
    while taken < n:
        got = store.claim(queue, OWNER, min(CLAIM_MAX, n - taken))
        if not got:
            raise RuntimeError(f"{queue} ran out after {taken} claims")
        taken += len(got)


def timed(call: Callable[[], Any], passes: int, budget_s: float) -> dict[str, float]:
    """Time ``call`` ``passes`` times (fewer, at least 3, past ``budget_s``)."""
    times: list[float] = []
    deadline = time.monotonic() + budget_s
    for i in range(passes):
        t0 = time.perf_counter()
        call()
        times.append((time.perf_counter() - t0) * 1000)
        if i >= 2 and time.monotonic() > deadline:
            break
    times.sort()
    return {"p50_ms": _pct(times, 50), "p99_ms": _pct(times, 99), "n": len(times)}


def flower_length(url: str) -> Callable[[], int] | None:
    """A call that reads the queue lengths as Flower does (a new client each, as Flower)."""
    try:
        from flower.utils.broker import Broker
    except ImportError:
        return None
    from celery_emq.ops.flower import register

    register()
    emq_url = url.replace("redis://", "emq://", 1)

    def length(queue: str) -> int:
        broker = Broker(emq_url, http_api=None, broker_options={"key_prefix": PREFIX})
        reply = asyncio.run(broker.queues([queue]))
        return int(reply[0]["messages"])

    return lambda: length("lanes")


def run(
    small: int,
    large: int,
    active: int,
    lanes: int,
    samples: int,
    passes: int,
    log: Callable[[str], None] = print,
) -> dict[str, Any]:
    """Take every scaling figure on a private Redis; return them (ms, with the sizes)."""
    out: dict[str, Any] = {
        "sizes": {"small": small, "large": large, "active": active, "lanes": lanes},
        "payload_bytes": len(PAYLOAD),
    }
    with private_redis() as url:
        client = accounted(redis.Redis.from_url(url))
        store = JobStore(client, PREFIX, LEASE_MS)

        fill(url, "small", small)
        t0 = time.monotonic()
        mem0 = dataset_bytes(client)
        fill(url, "large", large)
        out["bytes_per_pending_job"] = (dataset_bytes(client) - mem0) / large
        log(f"  filled {large:,} jobs in {time.monotonic() - t0:.0f} s")
        claims = claim_latency(store, ("small", "large"), samples)
        out["claim_small"], out["claim_large"] = claims["small"], claims["large"]
        log(
            f"  claim p50: {out['claim_small']['p50_ms']:.3f} ms at {small:,} pending, "
            f"{out['claim_large']['p50_ms']:.3f} ms at {large:,}"
        )

        claim_many(store, "large", active)
        held = store.counts("large")["active"]
        if held < active:
            raise RuntimeError(f"{held} of {active} claims active")
        sweeper = Sweeper(store, EmqOptions.from_transport_options({"lease_ms": LEASE_MS}))

        def sweep() -> None:
            report = sweeper.sweep("large")
            if report.recovered or report.dead or report.requeued or report.graced:
                raise RuntimeError("a sweep found a lapsed lease")

        out["sweep"] = timed(sweep, passes * 10, 20)
        log(f"  sweep, {held:,} active: p50 {out['sweep']['p50_ms']:.3f} ms")

        fill(url, "lanes", 2 * lanes, lanes=lanes)
        claim_many(store, "lanes", min(1000, lanes))
        out["lanes_seen"] = len(store.lanes("lanes"))
        out["status"] = timed(lambda: queue_status(store, "lanes"), passes, 30)
        log(f"  queue_status, {out['lanes_seen']:,} lanes: p50 {out['status']['p50_ms']:.1f} ms")
        flower = flower_length(url)
        if flower is not None:
            if flower() != 2 * lanes:
                raise RuntimeError("Flower's queue length is not the jobs enqueued")
            out["flower"] = timed(flower, passes, 30)
            log(f"  Flower queue length: p50 {out['flower']['p50_ms']:.1f} ms")
        client.close()
    return out
