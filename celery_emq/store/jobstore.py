"""The job store: every queue transition, over Redis only (no kombu here).

Each transition is one atomic Lua script (see ``lua/``). Time is the Redis
server's clock (the scripts read ``TIME``), so workers on hosts whose clocks
disagree still agree on every deadline; a caller that passes ``now_ms`` sets
the time instead, which is how tests move it. The reads are
:class:`~celery_emq.store.reads.Reads`, the queue registries
:class:`~celery_emq.store.registry.Registry`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from celery_emq.errors import ReplicasUnconfirmedError
from celery_emq.store.base import METRICS, PURGE_BATCH, SOON_TTL_MS
from celery_emq.store.batch import Batch
from celery_emq.store.codec import pack
from celery_emq.store.nodes import each_queue
from celery_emq.store.outcomes import (
    UNSET,
    Claims,
    Looked,
    NewJob,
    Outcome,
    Scan,
    Swept,
    SweptJobs,
    SweptOutcome,
    Unset,
    Verdict,
)
from celery_emq.store.reads import ACTIVE_PAGE, LANE_PAGE, OLDEST_LANE_PAGE, Reads
from celery_emq.store.registry import Registry

# The page and batch sizes are read with the store by its callers.
__all__ = [
    "ACTIVE_PAGE",
    "LANE_PAGE",
    "METRICS",
    "OLDEST_LANE_PAGE",
    "PROMOTE_BATCH",
    "PURGE_BATCH",
    "JobStore",
]

#: Most due delayed jobs one ``promote`` script call moves.
PROMOTE_BATCH = 1000


class JobStore(Reads, Registry):
    """Leased job queues on one Redis database.

    Args:
        client: a redis-py client (bytes replies, no key prefixing).
        prefix: the key prefix (``EmqOptions.key_prefix``).
        lease_ms: how long a claim holds a job.
        wait_replicas: how many replicas must confirm each publish and settle
            (0: none asked; see :meth:`confirm_replicas`).
        wait_timeout_ms: how long one confirmation may wait.
    """

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
        that makes it smaller (:mod:`celery_emq.store.codec`). ``max_stalled`` gives
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
        (:mod:`celery_emq.transport.batch`).
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
        take_suspect: bool = True,
        runs_here: bool = True,
    ) -> Claims:
        """Claim up to ``count`` jobs in priority/FIFO order under a lease.

        Each :class:`Claimed` carries its fencing token, the claim id
        (``token``: the delivery count and a nonce no rollback can reissue),
        which every later settle of that claim names. A job that lapsed before
        its task started (a suspect) is taken one per call, and only if
        ``take_suspect``; one it may not take keeps its place while the jobs
        behind it are taken (:attr:`Claims.passed_suspect`). A consumer
        records a suspect received (:meth:`receive`) once it decoded it.
        ``runs_here``: the caller's tasks run in the claiming process (see
        sweep.lua's blame).
        """
        return self.scripts.claim(
            self.keys(queue),
            now_ms,
            self.lease_ms,
            owner,
            count,
            held,
            ttl_ms,
            take_suspect,
            runs_here,
        )

    def start(self, queue: str, job_id: str, token: str) -> Outcome:
        """Record that a claim's task started: a lapse of that claim is then a stall."""
        return self.scripts.start(self.keys(queue), job_id, token)

    def receive(self, queue: str, job_id: str, token: str) -> Outcome:
        """Record that a claim's message was received whole: it is no suspect any more.

        A job that lapsed before its task started (a suspect) may be a message
        that kills its worker as it is received; once its consumer received it,
        it is not, and its count of such lapses is cleared (``start.lua``).
        """
        return self.scripts.start(self.keys(queue), job_id, token, received=True)

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
        registry: bool = False,
        verdict: Verdict | None = None,
        since: str = "0",
    ) -> SweptJobs:
        """Examine up to ``limit`` lapsed claims: count a stall on each that started.

        A started job is recovered (to the front of its queue) while its stall
        count is at most its budget, and dead-lettered past it. A job whose task
        never started under the lapsed claim is requeued without a stall, but
        such lapses are counted: past ``max_lapsed`` of them (``None``: no
        bound) it is dead-lettered as ``never_started``.
        A job past its budget is first asked of ``verdict`` (see
        :data:`~celery_emq.store.outcomes.Verdict`; ``None``: no one can tell):
        one whose task succeeded after all is deleted as completed (outcome
        ``completed``), never dead-lettered nor counted failed or stalled.
        A job settled meanwhile is left out.
        ``max_stalled`` is the budget of jobs that carry none of their own;
        ``None`` never dead-letters. Then up to ``limit`` dead jobs past the
        morgue's retention (``dead_max_age_ms``, ``dead_max_size``; 0 disables
        a bound) are deleted, each reported with the outcome ``trimmed``.
        Due delayed jobs are promoted first (outcome ``promoted``). With
        ``registry``, on one server, the pass ends with ``Swept("", "expiring",
        n)`` when ``n`` > 0 ``x-expires`` queues are registered (the expiry pass
        has work); on a Cluster the registry lies on another slot and is not read.
        ``since`` is the caller's evidence of an outage (see
        :meth:`Scripts.sweep <celery_emq.store.scripts.Scripts.sweep>`); the
        reply's ``now_ms`` is the server's clock at the pass.
        """
        swept = self.scripts.sweep(
            self.keys(queue),
            now_ms,
            limit,
            max_stalled,
            reason,
            self.lease_ms,
            max_lapsed=max_lapsed,
            dead_max_age_ms=dead_max_age_ms,
            dead_max_size=dead_max_size,
            expiring=self.expiring_key if registry and self.one_server else "",
            since=since,
        )
        return self._retire_doomed(queue, swept, verdict, now_ms)

    def look(
        self,
        queues: Sequence[str],
        since: Sequence[str],
        now_ms: int | None = None,
        dead_max_age_ms: int = 0,
        dead_max_size: int = 0,
    ) -> Looked:
        """One call over ``queues`` (one server only): which need a sweep pass now.

        ``since`` is, per queue, the caller's evidence (as :meth:`sweep` takes
        it). A queue with nothing to do is recorded swept, as its pass would
        have been (see ``look.lua``).
        """
        return self.scripts.look(
            [self.keys(q) for q in queues],
            since,
            now_ms,
            self.lease_ms,
            dead_max_age_ms,
            dead_max_size,
            self.expiring_key,
        )

    def charge(
        self,
        queue: str,
        job_id: str,
        token: str,
        max_stalled: int | None,
        reason: str,
        now_ms: int | None = None,
        verdict: Verdict | None = None,
    ) -> Swept | None:
        """Count one stall on a live claim whose worker process was lost.

        Returns what the sweep did with it (past its budget, as :meth:`sweep`
        with ``verdict``), or ``None`` when the claim is no longer the job's
        live claim (fenced, or settled meanwhile: nothing changes).
        """
        swept = self.scripts.sweep(
            self.keys(queue), now_ms, 1, max_stalled, reason, self.lease_ms, [(job_id, token)]
        )
        swept = self._retire_doomed(queue, swept, verdict, now_ms)
        return swept[0] if swept else None

    def retire(
        self, queue: str, job_id: str, succeeded: bool, now_ms: int | None = None
    ) -> Outcome:
        """Settle a job a sweep doomed (see ``retire.lua``).

        Returns ``OK`` (dead-lettered, counted failed, and stalled unless it
        never started), ``COMPLETED`` (``succeeded``, or an older claim
        completed it: deleted) or ``NOT_FOUND`` (settled meanwhile).
        """
        return self.scripts.retire(self.keys(queue), job_id, succeeded, now_ms)

    def _retire_doomed(
        self, queue: str, swept: SweptJobs, verdict: Verdict | None, now_ms: int | None
    ) -> SweptJobs:
        """Retire the jobs a sweep doomed, each as its ``verdict`` says.

        The script counts nothing for them and leaves them where the next sweep
        finds them again, so a caller that dies on the way leaves none in the
        morgue or counted: its task may have succeeded.
        """
        doomed = [s for s in swept if s.outcome == SweptOutcome.DOOMED]
        if not doomed:
            return swept
        k = self.keys(queue)
        with self.client.pipeline(transaction=False) as pipe:
            for s in doomed:
                pipe.hmget(k.job(s.id), "reason", "enqueued_ms")
            rows = dict(zip((s.id for s in doomed), pipe.execute(), strict=True))
        out = SweptJobs()
        out.now_ms = swept.now_ms
        for s in swept:
            if s.outcome != "doomed":
                out.append(s)
                continue
            reason, published = rows[s.id]
            dies = replace(
                s,
                outcome=SweptOutcome.NEVER_STARTED
                if reason == b"never_started"
                else SweptOutcome.DEAD,
            )
            succeeded = verdict is not None and verdict(dies, int(published) if published else None)
            outcome = self.scripts.retire(k, s.id, succeeded, now_ms)
            if outcome is Outcome.OK:
                out.append(dies)
            elif outcome is Outcome.COMPLETED:
                out.append(replace(s, outcome=SweptOutcome.COMPLETED))
        return out

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
        """Bring dead jobs back to the front of their queue or lane, stalls and lapses reset.

        Returns the ids retried. With ``whole``, if one id of a batch (500) is
        not dead, none of the batch is retried.
        """
        return self.scripts.retry(self.keys(queue), now_ms, job_ids, whole)[0]

    def purge_dead(self, queue: str, job_ids: Sequence[str], whole: bool = False) -> int:
        """Delete dead jobs by id; return how many went (``whole``: as :meth:`retry`)."""
        return self.scripts.purge_dead(self.keys(queue), job_ids, whole)[0]

    def retry_each(self, queue: str, job_ids: Sequence[str]) -> tuple[list[str], list[str]]:
        """Retry every id still dead; return the ids retried and those that were not dead."""
        return self.scripts.retry(self.keys(queue), None, job_ids)

    def purge_each(self, queue: str, job_ids: Sequence[str]) -> list[str]:
        """Delete every id still dead; return the ids that were not dead."""
        return self.scripts.purge_dead(self.keys(queue), job_ids)[1]

    def give_back(self, queue: str) -> bool:
        """Return a wake marker a consumer popped but did not claim for (if still due)."""
        return self.scripts.give_back(self.keys(queue))

    def signal_soon(self, queue: str) -> None:
        """Push ``queue``'s ``soon`` marker again (a consumer popped it and cannot scan).

        It ends as the one an enqueue pushes does: a marker nobody pops does not stay.
        """
        soon = self.keys(queue).soon
        pipe = self.client.pipeline(transaction=False)
        pipe.lpush(soon, 1).pexpire(soon, SOON_TTL_MS)
        pipe.execute()

    def budget(self, queue: str, job_id: str, max_stalled: int) -> bool:
        """Write a task's own stall budget (-1: none) on a job's row, never re-creating it."""
        return self.scripts.budget(self.keys(queue), job_id, max_stalled)

    def purge(self, queue: str) -> int:
        """Delete every waiting job of the queue (pending and delayed); return how many."""
        total = 0
        while True:
            n = self.scripts.purge(self.keys(queue), PURGE_BATCH)
            total += n
            if n < PURGE_BATCH:
                return total

    def waiting(self, queues: Sequence[str]) -> list[str]:
        """Promote due delayed jobs; return those of ``queues`` that have jobs to claim."""
        return self.scan(queues).waiting

    def scan(self, queues: Sequence[str]) -> Scan:
        """Promote due delayed jobs; say which of ``queues`` have jobs to claim, and
        when the earliest job still delayed in them is due.

        On one server, one script call for every queue (an idle consumer's
        look costs one call whatever its queues). On a Cluster, one call per
        queue (its keys share a slot), in one round trip; each queue's reply
        is read on its own (:func:`each_queue`): a queue whose call failed
        (its slot migrating) is named in ``failed``, the others' replies stand.

        Raises:
            redis.RedisError: the round trip failed, or every queue's call did.
        """
        if not queues:
            return Scan([], None)
        if self.one_server:
            found = self.scripts.promote_many([self.keys(q) for q in queues], PROMOTE_BATCH)
            due = [r[2] for r in found if r[2] >= 0]
            waiting = [q for q, r in zip(queues, found, strict=True) if r[1]]
            return Scan(waiting, min(due) if due else None)
        batch = self.scripts.batch()
        handles = {q: batch.promote(self.keys(q), PROMOTE_BATCH) for q in queues}
        batch.execute()
        outcomes = each_queue(queues, lambda q: batch.result(handles[q]))
        failed = {q: o.error for q, o in outcomes.items() if o.error is not None}
        if len(failed) == len(outcomes):
            raise next(iter(failed.values()))
        results = {q: o.value for q, o in outcomes.items() if o.value is not None}
        due = [r[2] for r in results.values() if r[2] >= 0]
        return Scan([q for q, r in results.items() if r[1]], min(due) if due else None, failed)
