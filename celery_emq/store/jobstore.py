"""The job store: every queue transition, over Redis only (no kombu here).

Each method is one atomic Lua transition (see ``lua/``). Time is the Redis
server's clock (the scripts read ``TIME``), so workers on hosts whose clocks
disagree still agree on every deadline; a caller that passes ``now_ms`` sets
the time instead, which is how tests move it.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from celery_emq.errors import ReplicasUnconfirmedError
from celery_emq.store.codec import pack, unpack
from celery_emq.store.keys import QueueKeys
from celery_emq.store.scripts import UNSET, Batch, Claimed, NewJob, Outcome, Scripts, Swept, Unset

__all__ = ["JobStore"]

#: Jobs one ``purge`` script call deletes before the store calls it again.
PURGE_BATCH = 1000
#: Most lanes one ``tally`` script call reads.
LANE_PAGE = 10_000
#: Most fair lanes one ``oldest`` script call reads (a call per priority band in use each).
OLDEST_LANE_PAGE = 1000
#: Most active jobs one ``oldest`` script call reads.
ACTIVE_PAGE = 5000
#: Most due delayed jobs one ``promote`` script call moves.
PROMOTE_BATCH = 1000
#: The counters every queue keeps (``<p>:{q}:metrics:<name>``, field ``count``).
METRICS: tuple[str, ...] = ("completed", "recovered", "stalled", "failed", "retried")


class JobStore:
    """Leased job queues on one Redis database.

    Args:
        client: a redis-py client (bytes replies, no key prefixing).
        prefix: the key prefix (``EmqOptions.key_prefix``).
        lease_ms: how long a claim holds a job.
        wait_replicas: how many replicas must confirm each publish and settle
            (0: none asked; see :meth:`confirm_replicas`).
        wait_timeout_ms: how long one confirmation may wait.
    """

    def __init__(
        self,
        client: Any,
        prefix: str,
        lease_ms: int,
        wait_replicas: int = 0,
        wait_timeout_ms: int = 1000,
    ) -> None:
        self.client = client
        self.prefix = prefix
        self.lease_ms = lease_ms
        self.wait_replicas = wait_replicas
        self.wait_timeout_ms = wait_timeout_ms
        self.scripts = Scripts(client)
        self._keys: dict[str, QueueKeys] = {}

    def keys(self, queue: str) -> QueueKeys:
        """Return (and cache) the keys of one queue."""
        k = self._keys.get(queue)
        if k is None:
            k = self._keys[queue] = QueueKeys(self.prefix, queue)
        return k

    def node_of(self, queue: str) -> str:
        """Name the server holding ``queue``'s keys (``host:port``): what a fault takes down.

        On a Cluster, the master serving the queue's slot as the client last
        learnt it (``?`` if no node is known to serve it); else the one server.
        """
        locate = getattr(self.client, "get_node_from_key", None)
        if locate is not None:
            try:
                return str(locate(self.keys(queue).active).name)
            except Exception:
                return "?"
        pool = getattr(self.client, "connection_pool", None)
        kwargs = getattr(pool, "connection_kwargs", {})
        if kwargs.get("host"):
            return f"{kwargs['host']}:{kwargs.get('port', 6379)}"
        return str(getattr(pool, "service_name", None) or kwargs.get("path") or "redis")

    def enqueue(
        self,
        queue: str,
        job_id: str,
        payload: str | bytes,
        priority: int = 0,
        ttl_ms: int = 0,
        now_ms: int | None = None,
        max_stalled: int | Unset | None = UNSET,
        group: str = "",
        eta_ms: int | None = None,
        task_id: str = "",
    ) -> Outcome:
        """Add a job to the queue; ``DUPLICATE`` when the id already exists.

        ``payload`` is the message's JSON text; it is stored compressed when
        that makes it smaller (:mod:`celery_emq.codec`). ``max_stalled`` gives
        this job its own stall budget (``None``: never dead-letter); left
        unset, the sweep's default applies. A ``group`` puts the job in that
        group's fair lane. ``ttl_ms`` marks the queue as an ``x-expires`` queue
        in use. A job whose ``eta_ms`` is still ahead (on the Redis server's
        clock) waits in the queue's delayed set until :meth:`promote` finds it
        due; ``task_id`` lets a revoke find it (:meth:`promote_tasks`).

        Raises:
            ReplicasUnconfirmedError: with ``wait_replicas``, fewer replicas
                confirmed the write in time (it stands on the master).
        """
        args = (
            self.keys(queue),
            job_id,
            pack(payload),
            priority,
            now_ms,
            ttl_ms,
            max_stalled,
            group,
            eta_ms,
            task_id,
        )
        if not self.wait_replicas:
            return self.scripts.enqueue(*args)
        batch = self.scripts.batch()
        handle = batch.enqueue(*args)
        batch.execute(confirm=lambda pipe: self.confirm_replicas(pipe, queue))
        outcome: Outcome = batch.result(handle)
        if (batch.confirmed or 0) < self.wait_replicas:
            raise ReplicasUnconfirmedError(
                queue, job_id, batch.confirmed or 0, self.wait_replicas, self.wait_timeout_ms
            )
        return outcome

    def enqueue_many(
        self, queue: str, jobs: Sequence[NewJob], ttl_ms: int = 0, now_ms: int | None = None
    ) -> list[Outcome]:
        """Add jobs as :meth:`enqueue` would, in order, in one round trip; an outcome per job.

        Each job's ``payload`` is the message's JSON text. Without
        ``wait_replicas`` only; a publish batch confirms its whole flush at once
        (:mod:`celery_emq.batch`).
        """
        batch = self.scripts.batch()
        handle = self.queue_enqueue_many(batch, queue, jobs, ttl_ms, now_ms)
        batch.execute()
        outcomes: list[Outcome] = batch.result(handle)
        return outcomes

    def queue_enqueue_many(
        self,
        batch: Batch,
        queue: str,
        jobs: Sequence[NewJob],
        ttl_ms: int = 0,
        now_ms: int | None = None,
    ) -> int:
        """Queue :meth:`enqueue_many` on ``batch``; its result is an outcome per job."""
        # Built directly: dataclasses.replace costs several times as much.
        packed = [
            NewJob(j.id, pack(j.payload), j.priority, j.max_stalled, j.group, j.eta_ms, j.task_id)
            for j in jobs
        ]
        return batch.enqueue_many(self.keys(queue), packed, now_ms, ttl_ms)

    def confirm_replicas(self, client: Any, queue: str | None = None) -> None:
        """Queue ``WAIT wait_replicas wait_timeout_ms`` on ``client``.

        ``client`` is the pipeline (or connection) that carried the writes to
        confirm: ``WAIT`` counts the replicas holding the writes of its own
        connection. A store over Redis Cluster routes it to the node owning
        ``queue``'s slot.
        """
        client.execute_command("WAIT", self.wait_replicas, self.wait_timeout_ms)

    def promote(self, queue: str, limit: int = PROMOTE_BATCH, now_ms: int | None = None) -> int:
        """Move up to ``limit`` delayed jobs that are due into their queue or lane."""
        return self.scripts.promote(self.keys(queue), now_ms, limit)[0]

    def promote_tasks(self, queue: str, task_ids: Sequence[str]) -> int:
        """Move the delayed jobs of these Celery task ids into their queue now, due or not."""
        if not task_ids:
            return 0
        return self.scripts.promote(self.keys(queue), None, 0, task_ids)[0]

    def claim(
        self,
        queue: str,
        owner: str,
        count: int = 1,
        held: int = 0,
        ttl_ms: int = 0,
        now_ms: int | None = None,
        alone: bool = True,
    ) -> list[Claimed]:
        """Claim up to ``count`` jobs in priority/FIFO order under a lease.

        Each :class:`Claimed` carries its fencing token, the claim id
        (``token``: the delivery count and a nonce no rollback can reissue),
        which every later settle of that claim names. A job that lapsed before
        its task started is taken only ``alone`` (the caller holds no other
        claim, as a caller that does not say is taken to), in a batch of its
        own; the batch stops before it otherwise.
        """
        return self.scripts.claim(
            self.keys(queue), now_ms, self.lease_ms, owner, count, held, ttl_ms, alone
        )

    def start(self, queue: str, job_id: str, token: str) -> Outcome:
        """Record that a claim's task started: a lapse of that claim is then a stall."""
        return self.scripts.start(self.keys(queue), job_id, token)

    def ack(self, queue: str, job_id: str, token: str) -> Outcome:
        """Delete a finished job (see :meth:`ack_many` for the outcomes)."""
        return self.scripts.ack(self.keys(queue), [(job_id, token)])[0]

    def ack_many(self, queue: str, claims: Sequence[tuple[str, str]]) -> list[Outcome]:
        """Delete finished jobs, each named by its claim ``(id, token)``.

        ``OK`` for a live claim; ``LEASE_LOST`` or ``DEAD`` when the claim had
        lapsed and the job was pending again or dead-lettered (it completed, so
        it is deleted either way); ``FENCED`` when another claim holds the job
        (left to that claim); ``NOT_FOUND`` when it is gone.
        """
        if not claims:
            return []
        return self.scripts.ack(self.keys(queue), claims)

    def release(self, queue: str, job_id: str, token: str, unless_started: bool = False) -> Outcome:
        """Put a claimed job back at the front of its queue, uncounted.

        With ``unless_started``, a claim whose task has started (as recorded by
        :meth:`start`) is left as it is: ``STARTED``.
        """
        return self.scripts.release(self.keys(queue), job_id, token, unless_started)

    def extend(
        self, queue: str, claims: Sequence[tuple[str, str]], now_ms: int | None = None
    ) -> list[tuple[str, str]]:
        """Renew the leases of ``claims`` ``(id, token)``; return those that are lost."""
        if not claims:
            return []
        return self.scripts.extend(self.keys(queue), self.lease_ms, now_ms, claims)

    def bury(
        self,
        queue: str,
        job_id: str,
        token: str,
        reason: str,
        error: str = "",
        now_ms: int | None = None,
    ) -> Outcome:
        """Dead-letter a job into the queue's morgue with a reason (fenced by ``token``)."""
        return self.scripts.bury(self.keys(queue), job_id, token, reason, error, now_ms)

    def sweep(
        self,
        queue: str,
        max_stalled: int | None,
        reason: str = "lease_expired",
        limit: int = 500,
        now_ms: int | None = None,
        max_lapsed: int | None = None,
        dead_max_age_ms: int = 0,
        dead_max_size: int = 0,
    ) -> list[Swept]:
        """Examine up to ``limit`` lapsed claims: count a stall on each that started.

        A started job is recovered (to the front of its queue) while its stall
        count is at most its budget, and dead-lettered past it. A job whose task
        never started under the lapsed claim is requeued without a stall, but
        such lapses are counted: past ``max_lapsed`` of them (``None``: no
        bound) it is dead-lettered as ``never_started``.
        ``max_stalled`` is the budget of jobs that carry none of their own;
        ``None`` never dead-letters. Then up to ``limit`` dead jobs past the
        morgue's retention (``dead_max_age_ms``, ``dead_max_size``; 0 disables
        a bound) are deleted, each reported with the outcome ``trimmed``.
        """
        return self.scripts.sweep(
            self.keys(queue),
            now_ms,
            limit,
            max_stalled,
            reason,
            self.lease_ms,
            max_lapsed=max_lapsed,
            dead_max_age_ms=dead_max_age_ms,
            dead_max_size=dead_max_size,
        )

    def charge(
        self,
        queue: str,
        job_id: str,
        token: str,
        max_stalled: int | None,
        reason: str,
        now_ms: int | None = None,
    ) -> Swept | None:
        """Count one stall on a live claim whose worker process was lost.

        Returns what the sweep did with it, or ``None`` when the claim is no
        longer the job's live claim (fenced: nothing changes).
        """
        swept = self.scripts.sweep(
            self.keys(queue), now_ms, 1, max_stalled, reason, self.lease_ms, [(job_id, token)]
        )
        return swept[0] if swept else None

    def reap(self, queue: str, limit: int = 500, now_ms: int | None = None) -> list[str]:
        """Return up to ``limit`` lapsed jobs to the front of their queue, uncounted."""
        return self.scripts.reap(self.keys(queue), now_ms, limit)

    def retry(
        self,
        queue: str,
        job_ids: Sequence[str],
        now_ms: int | None = None,
        whole: bool = False,
    ) -> list[str]:
        """Bring dead jobs back to the front of their queue or lane, stall count reset.

        Returns the ids retried. With ``whole``, if one id of a batch (500) is
        not dead, none of the batch is retried.
        """
        return self.scripts.retry(self.keys(queue), now_ms, job_ids, whole)[0]

    def purge_dead(self, queue: str, job_ids: Sequence[str], whole: bool = False) -> int:
        """Delete dead jobs by id; return how many went (``whole``: as :meth:`retry`)."""
        return self.scripts.purge_dead(self.keys(queue), job_ids, whole)[0]

    def give_back(self, queue: str) -> bool:
        """Return a wake marker a consumer popped but did not claim for (if still due)."""
        return self.scripts.give_back(self.keys(queue))

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
                metrics = (k.metrics(n) for n in METRICS)
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
        for queue in sorted(_text(q) for q in self.client.smembers(self.expiring_key)):
            k = self.keys(queue)
            total = 0
            while True:
                n = self.scripts.purge(k, limit, expired=True, counters=METRICS)
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
        return sorted(_text(q) for q in self.client.smembers(self.registry_key))

    @property
    def registry_key(self) -> str:
        """``<p>:queues``: the SET of queue names (outside any hash tag)."""
        return f"{self.prefix}:queues"

    def metrics(self, queue: str) -> dict[str, int]:
        """Return the queue's counters: completed, recovered, stalled, failed, retried."""
        k = self.keys(queue)
        with self.client.pipeline(transaction=False) as pipe:
            for name in METRICS:
                pipe.hget(k.metrics(name), "count")
            values = pipe.execute()
        return {name: int(v or 0) for name, v in zip(METRICS, values, strict=True)}

    def fenced(self, queue: str) -> dict[str, int]:
        """Return how many settles named a claim that was not the live one, by verb.

        Verbs: ``ack``, ``extend``, ``release``, ``bury``, ``charge``, ``start``.
        Such a settle changes nothing of the live claim (a fenced ack only marks
        the job completed); each one means two runs of a job overlapped, most
        often after the server lost its last writes.
        """
        counts = self.client.hgetall(self.keys(queue).metrics("fenced"))
        return {
            _text(f).removeprefix("reason:"): int(v)
            for f, v in counts.items()
            if _text(f).startswith("reason:")
        }

    def purge(self, queue: str) -> int:
        """Delete every waiting job of the queue (pending and delayed); return how many."""
        total = 0
        while True:
            n = self.scripts.purge(self.keys(queue), PURGE_BATCH)
            total += n
            if n < PURGE_BATCH:
                return total

    def size(self, queue: str) -> int:
        """Return how many jobs are pending, lanes included (kombu's queue size)."""
        return self.counts(queue)["pending"]

    def lanes(self, queue: str) -> dict[str, int]:
        """Return each fair lane's pending count, by group."""
        return self.tally(queue)[1]

    def counts(self, queue: str) -> dict[str, int]:
        """Return the number of pending (lanes included), active, delayed and dead jobs."""
        counts = self.tally(queue)[0]
        del counts["lanes"]
        return counts

    def tally(
        self, queue: str, heads: bool = False
    ) -> tuple[dict[str, int], dict[str, int], list[int]]:
        """Return a queue's counts, its lanes' sizes and (with ``heads``) their heads' ages.

        One script call per :data:`LANE_PAGE` lanes (one for most queues): the
        counts are ``pending`` (lanes included), ``active``, ``delayed``, ``dead``
        and ``lanes`` (how many); the lanes map each group with pending jobs to
        their number; the heads are the ``enqueued_ms`` of each lane's next job.
        """
        counts, page = self.scripts.tally(self.keys(queue), 0, LANE_PAGE, heads)
        return self._lanes_read(queue, counts, page, heads)

    def tallies(
        self, queues: Sequence[str], heads: bool = False
    ) -> list[tuple[dict[str, int], dict[str, int], list[int]]]:
        """Return :meth:`tally` of each of ``queues``, in one round trip for them all.

        One more round trip per queue for each further :data:`LANE_PAGE` lanes
        it has (none for most queues).
        """
        if not queues:
            return []
        batch = self.scripts.batch()
        handles = [batch.tally(self.keys(q), 0, LANE_PAGE, heads) for q in queues]
        batch.execute()
        out = []
        for queue, handle in zip(queues, handles, strict=True):
            counts, page = batch.result(handle)
            out.append(self._lanes_read(queue, counts, page, heads))
        return out

    def gauges(
        self, queues: Sequence[str]
    ) -> list[tuple[dict[str, int], dict[str, int], int | None, int | None]]:
        """Return each queue's counts and lanes (as :meth:`tally`) and its two oldest times.

        The times are the least ``enqueued_ms`` of its pending jobs (read at the
        head of each priority band of each lane, see ``oldest.lua``) and the
        least ``claimed_ms`` of its active jobs (``None`` when there are none).
        One round trip for every queue, and one more for every queue past the
        first :data:`OLDEST_LANE_PAGE` lanes or :data:`ACTIVE_PAGE` active jobs
        (a script call for each further page of either).
        """
        if not queues:
            return []
        batch = self.scripts.batch()
        handles = [
            (
                batch.tally(self.keys(q), 0, LANE_PAGE),
                batch.oldest(self.keys(q), 0, OLDEST_LANE_PAGE, 0, ACTIVE_PAGE),
            )
            for q in queues
        ]
        batch.execute()
        # The pages past the first, of every queue, in one more round trip.
        more = self.scripts.batch()
        rows = []
        for queue, (tally, oldest) in zip(queues, handles, strict=True):
            counts, page = batch.result(tally)
            counts, lanes, _ = self._lanes_read(queue, counts, page, False)
            pages = []
            lanes_at, active_at = OLDEST_LANE_PAGE, ACTIVE_PAGE
            while lanes_at < counts["lanes"] or active_at < counts["active"]:
                lane_limit = OLDEST_LANE_PAGE if lanes_at < counts["lanes"] else 0
                active_limit = ACTIVE_PAGE if active_at < counts["active"] else 0
                k = self.keys(queue)
                pages.append(more.oldest(k, lanes_at, lane_limit, active_at, active_limit))
                lanes_at += OLDEST_LANE_PAGE
                active_at += ACTIVE_PAGE
            rows.append((counts, lanes, batch.result(oldest), pages))
        more.execute()
        out = []
        for counts, lanes, (enqueued, claimed), pages in rows:
            for handle in pages:
                page_enqueued, page_claimed = more.result(handle)
                enqueued, claimed = _least(enqueued, page_enqueued), _least(claimed, page_claimed)
            out.append((counts, lanes, enqueued, claimed))
        return out

    def _lanes_read(
        self,
        queue: str,
        counts: dict[str, int],
        page: list[tuple[str, int, int | None]],
        heads: bool,
    ) -> tuple[dict[str, int], dict[str, int], list[int]]:
        """Finish a tally from its first page: read the further lane pages, add the lanes up."""
        rows = list(page)
        while len(rows) < counts["lanes"] and len(page) == LANE_PAGE:
            page = self.scripts.tally(self.keys(queue), len(rows), LANE_PAGE, heads)[1]
            rows += page
        lanes = {g: n for g, n, _ in rows if n}
        counts["pending"] += sum(lanes.values())
        return counts, lanes, [h for _, _, h in rows if h is not None]

    def waiting(self, queues: Sequence[str]) -> list[str]:
        """Promote due delayed jobs; return those of ``queues`` that have jobs to claim.

        One script call per queue (its keys share a slot), in one round trip.
        """
        if not queues:
            return []
        batch = self.scripts.batch()
        handles = [batch.promote(self.keys(q), PROMOTE_BATCH) for q in queues]
        batch.execute()
        return [q for q, h in zip(queues, handles, strict=True) if batch.result(h)[1]]

    def exists(self, queue: str) -> bool:
        """Return whether the queue holds any pending, delayed or active job."""
        k = self.keys(queue)
        return bool(self.client.exists(k.pending, k.active, k.lanes, k.delayed))

    def server_ms(self) -> int:
        """Return the Redis server's clock in ms: the time every deadline is read on."""
        seconds, micros = self.client.time()
        return int(seconds) * 1000 + int(micros) // 1000

    def job(self, queue: str, job_id: str) -> dict[str, str]:
        """Return one job as text: its row, with what the row leaves implied.

        ``payload`` is the message's JSON text, ``queue`` the queue, and
        ``stalled`` and ``deliveries`` are ``"0"`` until first used. Empty when
        there is no such job.
        """
        k = self.keys(queue)
        with self.client.pipeline(transaction=False) as pipe:
            row, stored = pipe.hgetall(k.job(job_id)).get(k.msg(job_id)).execute()
        if not row:
            return {}
        job = {"queue": queue, "stalled": "0", "deliveries": "0", "priority": "0"}
        job.update({_text(f): _text(v) for f, v in row.items()})
        if stored is not None:
            try:
                job["payload"] = _text(unpack(stored))
            except ValueError:
                job["payload"] = ""
        return job


def _least(a: int | None, b: int | None) -> int | None:
    return b if a is None else a if b is None else min(a, b)


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value
