"""The queue registries: the task queues the sweep and the CLI iterate, and ``x-expires`` queues.

Each is a SET outside any hash tag (``<p>:queues``, ``<p>:expiring``); the
expiry pass purges an ``x-expires`` queue left unused past its TTL.
"""

from __future__ import annotations

import json
from collections.abc import Sequence

from celery_emq.store.base import COUNTERS, PURGE_BATCH, StoreBase
from celery_emq.store.calls import text

__all__ = ["Registry"]


class Registry(StoreBase):
    """The job store's queue registries (see :class:`~celery_emq.store.jobstore.JobStore`)."""

    def register(self, queue: str) -> None:
        """Record a task queue in the registry the sweep and the CLI iterate."""
        self.client.sadd(self.registry_key, queue)

    def unregister_unused(self, queues: Sequence[str]) -> list[str]:
        """Drop from the registry those of ``queues`` that hold no key at all.

        A task queue that ever completed a job keeps its counters, so only
        queues that never held leased work (a reply queue registered by an
        older version, a queue purged before any job ran) go. Returns them.
        """
        unused = [q for q, n in zip(queues, self._key_counts(queues), strict=True) if not n]
        if unused:
            self.client.srem(self.registry_key, *unused)
        return unused

    def _key_counts(self, queues: Sequence[str]) -> list[int]:
        with self.client.pipeline(transaction=False) as pipe:
            for q in queues:
                k = self.keys(q)
                metrics = (k.metrics(n) for n in COUNTERS)
                pipe.exists(k.pending, k.active, k.dead, k.lanes, k.delayed, *metrics)
            return [int(n) for n in pipe.execute()]

    def declare_expiring(self, queue: str, ttl_ms: int) -> None:
        """Record an ``x-expires`` queue and mark it in use for ``ttl_ms``."""
        with self.client.pipeline(transaction=False) as pipe:
            pipe.set(self.keys(queue).expires, 1, px=ttl_ms)
            pipe.sadd(self.expiring_key, queue)
            pipe.execute()

    def note_binding(self, queue: str, table: str, member: str) -> None:
        """Record that ``member`` of the binding table ``table`` binds an ``x-expires`` queue.

        The expiry pass removes it from the table once the queue is gone (a
        table that nothing else prunes: kombu's on a Redis Cluster).
        """
        self.client.sadd(self.keys(queue).bindings, json.dumps([table, member]))

    def _unbind(self, queue: str) -> None:
        """Remove a gone queue's recorded bindings from their tables."""
        k = self.keys(queue)
        for raw in self.client.smembers(k.bindings):
            table, member = json.loads(raw)
            self.client.srem(table, member)
        self.client.delete(k.bindings)

    def note_expiring(self, queue: str) -> None:
        """Record an ``x-expires`` queue in the registry the expiry pass reads."""
        self.client.sadd(self.expiring_key, queue)

    def expire(self, limit: int = PURGE_BATCH) -> dict[str, int]:
        """Purge the pending jobs of every ``x-expires`` queue left unused past its TTL.

        Leased jobs finish (their acks still land); a queue with nothing left
        loses its remaining keys (counters included) and leaves the registry.
        Returns the number of jobs purged per queue.
        """
        purged: dict[str, int] = {}
        for queue in sorted(text(q) for q in self.client.smembers(self.expiring_key)):
            k = self.keys(queue)
            total = 0
            while True:
                n = self.scripts.purge(k, limit, expired=True, counters=COUNTERS)
                if n < limit:
                    break
                total += n
            if n < 0:
                continue  # still in use
            total += n
            if total:
                purged[queue] = total
            if not self.client.exists(k.pending, k.active, k.dead, k.lanes, k.delayed):
                self.client.srem(self.expiring_key, queue)
                # A publish may have used the queue since: keep it registered then.
                if self.client.exists(k.expires):
                    self.client.sadd(self.expiring_key, queue)
                else:
                    self._unbind(queue)
        return purged

    @property
    def expiring_key(self) -> str:
        """``<p>:expiring``: the SET of ``x-expires`` queue names (outside any hash tag)."""
        return f"{self.prefix}:expiring"

    def queues(self) -> list[str]:
        """Return the registered queue names, sorted."""
        return sorted(text(q) for q in self.client.smembers(self.registry_key))

    @property
    def registry_key(self) -> str:
        """``<p>:queues``: the SET of queue names (outside any hash tag)."""
        return f"{self.prefix}:queues"
