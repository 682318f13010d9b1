"""Prometheus metrics: queue depths, ages and counters, read from the job store on each scrape.

:class:`EmqCollector` is a ``prometheus_client`` collector: each scrape reads
every registered queue in three round trips however many queues (the registry;
two script calls per queue; the counters; one more only for a queue past a page
of 1,000 fair lanes or 5,000 active jobs) and yields

==========================================  =======  ===========================
metric                                      type     labels
==========================================  =======  ===========================
``emq_queue_jobs``                          gauge    queue, state (``pending``
                                                     (lanes included),
                                                     ``active``, ``delayed``,
                                                     ``dead``)
``emq_lane_pending_jobs``                   gauge    queue, group
``emq_oldest_pending_age_seconds``          gauge    queue (0 when none)
``emq_oldest_lease_age_seconds``            gauge    queue (0 when none)
``emq_jobs_completed_total``                counter  queue
``emq_jobs_recovered_total``                counter  queue, reason
``emq_jobs_stalled_total``                  counter  queue, reason
``emq_jobs_dead_lettered_total``            counter  queue, reason
``emq_jobs_retried_total``                  counter  queue
``emq_settles_fenced_total``                counter  queue, reason (the verb: ``ack``,
                                                     ``extend``, ``release``, ``bury``,
                                                     ``start``, ``charge``)
``emq_up``                                  gauge    (1: the scrape read the broker)
==========================================  =======  ===========================

Flower serves them at ``/emq/metrics`` once celery_emq registers with Flower
(and on its own ``/metrics`` when Flower has no authentication; see
:mod:`celery_emq.ops.flower`); ``celery -A app emq exporter --port N`` serves them
without Flower. Needs the ``prometheus_client`` package (the ``metrics``
extra); nothing else in celery_emq imports this module.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from celery_emq.ops.appstore import AppStore
from celery_emq.store.jobstore import JobStore
from celery_emq.store.status import queue_statuses

__all__ = ["AppStore", "EmqCollector"]

logger = logging.getLogger(__name__)

STATES: tuple[str, ...] = ("pending", "active", "delayed", "dead")

#: Reasons every by-reason counter shows from 0, so that its first increase is seen
#: (a series that appears at 1 shows no ``increase()``); others appear when counted.
STALL_REASONS: tuple[str, ...] = ("lease_expired", "worker_lost")

#: Counter metric (without ``_total``) -> (store counter, whether split by reason).
COUNTERS: dict[str, tuple[str, bool, str]] = {
    "emq_jobs_completed": ("completed", False, "Jobs completed (acknowledged)."),
    "emq_jobs_recovered": ("recovered", True, "Stalled jobs recovered to their queue."),
    "emq_jobs_stalled": ("stalled", True, "Stalls counted (lease lapsed or worker lost)."),
    "emq_jobs_dead_lettered": ("failed", True, "Jobs dead-lettered into the morgue."),
    "emq_jobs_retried": ("retried", False, "Dead jobs retried from the morgue."),
}


class EmqCollector(Collector):
    """Yield the emq metrics of every registered queue (or ``queues``) on each scrape.

    Args:
        store: the job store to read, or an :class:`AppStore` (a Celery app's).
        queues: only these queues (default: every registered queue).
        now_ms: read ages at this time instead of the Redis server's clock (tests).
    """

    def __init__(
        self,
        store: JobStore | AppStore,
        queues: Sequence[str] | None = None,
        now_ms: int | None = None,
    ) -> None:
        self.source = store
        self.queues = list(queues) if queues else None
        self.now_ms = now_ms

    def describe(self) -> Iterable[Metric]:
        """The families this collector yields, without samples (read on registration)."""
        return list(_families([], up=True))

    def collect(self) -> Iterator[Metric]:
        """Read the queues and yield the families; only ``emq_up 0`` if the broker fails."""
        try:
            store = self.source.get() if isinstance(self.source, AppStore) else self.source
            queues = self.queues or store.queues()
            rows = queue_statuses(store, queues, self.now_ms)
        except Exception:
            logger.warning("emq metrics: cannot read the broker", exc_info=True)
            if isinstance(self.source, AppStore):
                self.source.reset()
            up = GaugeMetricFamily("emq_up", "1 when the scrape read the broker.")
            up.add_metric([], 0)
            yield up
            return
        yield from _families(rows, up=True)


def _families(rows: list[dict[str, Any]], up: bool) -> Iterator[Metric]:
    jobs = GaugeMetricFamily(
        "emq_queue_jobs",
        "Jobs in a queue by state: pending (lanes included), active, delayed, dead.",
        labels=["queue", "state"],
    )
    lanes = GaugeMetricFamily(
        "emq_lane_pending_jobs", "Pending jobs in a fair lane.", labels=["queue", "group"]
    )
    pending_age = GaugeMetricFamily(
        "emq_oldest_pending_age_seconds",
        "Age of the oldest pending job (0 when none).",
        labels=["queue"],
    )
    lease_age = GaugeMetricFamily(
        "emq_oldest_lease_age_seconds",
        "Time since the oldest active job was claimed (0 when none).",
        labels=["queue"],
    )
    counters = {
        name: CounterMetricFamily(name, help_, labels=["queue", "reason"] if split else ["queue"])
        for name, (_, split, help_) in COUNTERS.items()
    }
    for row in rows:
        q = row["queue"]
        for state in STATES:
            jobs.add_metric([q, state], row[state])
        for group, n in sorted(row["lanes"].items()):
            lanes.add_metric([q, group], n)
        pending_age.add_metric([q], (row["oldest_pending_age_ms"] or 0) / 1000)
        lease_age.add_metric([q], (row["oldest_lease_age_ms"] or 0) / 1000)
        for name, (counter, split, _) in COUNTERS.items():
            if split:
                by_reason = {**dict.fromkeys(STALL_REASONS, 0), **row["reasons"][counter]}
                for reason, n in sorted(by_reason.items()):
                    counters[name].add_metric([q, reason], n)
            else:
                counters[name].add_metric([q], row["counters"][counter])
    yield jobs
    yield lanes
    yield pending_age
    yield lease_age
    yield from counters.values()
    fenced = CounterMetricFamily(
        "emq_settles_fenced",
        "Settles that named a claim other than the job's live one (changed nothing).",
        labels=["queue", "reason"],
    )
    for row in rows:
        for verb, n in sorted(row["fenced"].items()):
            fenced.add_metric([row["queue"], verb], n)
    yield fenced
    if up:
        gauge = GaugeMetricFamily("emq_up", "1 when the scrape read the broker.")
        gauge.add_metric([], 1)
        yield gauge
