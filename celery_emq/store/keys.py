"""The one place key names are built.

Key schema (every key of a queue shares the hash tag ``{q}``, so each script
touches a single cluster slot). Every key has an end: it goes with its job,
with the queue's last job, or it expires (the last column).

==============================  ======  ================================  ==========================
key                             type    content                           ends
==============================  ======  ================================  ==========================
``<p>:{q}:pending``             ZSET    job ids ready to claim; score =   with its last job
                                        priority band + sequence (lower
                                        first, FIFO within a band,
                                        recovered jobs ahead of it)
``<p>:{q}:active``              ZSET    claimed job ids; score = lease    with its last job
                                        deadline (ms)
``<p>:{q}:dead``                ZSET    the morgue; score = time of       with its last job;
                                        death (ms)                        retention on every sweep
``<p>:{q}:job:<id>``            HASH    the job's row: small fields       with the job
                                        only, so Redis keeps it a
                                        compact listpack (see
                                        :data:`JOB_FIELDS`)
``<p>:{q}:msg:<id>``            STRING  the job's message, as stored by   with the job
                                        :mod:`celery_emq.store.codec`
``<p>:{q}:delayed``             ZSET    jobs whose ETA is still ahead;    with its last job
                                        score = ETA (ms); promoted to
                                        pending once due
``<p>:{q}:etas``                HASH    Celery task id -> the space-      with its last delayed job
                                        separated ids of its delayed      (each job's id leaves its
                                        jobs (a revoke promotes them at   field when it is promoted
                                        once; a caller may give one       or purged; the field goes
                                        task id to several)               with its last id)
``<p>:{q}:wake``                LIST    one marker per job made           deleted when nothing is
                                        claimable; consumers block on it  pending (claim, sweep)
                                        with BRPOP, then claim
``<p>:{q}:soon``                LIST    one marker at most: a delayed     popped by a consumer
                                        job due before every other was    (BRPOP); expires 60 s
                                        enqueued; waiting consumers,      after its push; a purge
                                        whose wait ends when the          leaving nothing delayed
                                        earliest known job is due, scan   deletes it
                                        again
``<p>:{q}:suspects``            HASH    each owner's last suspect         PX 1 day, renewed by each
                                        handed out (``<id> <claim id>``): suspect claimed; a stale
                                        the sweep blames it alone when    entry is dropped by the
                                        its owner dies before receiving   sweep that reads it
                                        it whole
``<p>:{q}:seq``                 STRING  tail sequence (INCR) for FIFO     deleted when nothing is
                                        order                             pending (claim, sweep)
``<p>:{q}:head``                STRING  head sequence (INCR) for          deleted when nothing is
                                        front-of-queue inserts            pending (claim, sweep)
``<p>:{q}:g:<group>:pending``   ZSET    a fair lane: pending jobs of one  with its last job
                                        group
``<p>:{q}:lanes``               ZSET    groups that have a lane (score    with the last lane
                                        0, by name)
``<p>:{q}:cursor``              STRING  the lane a claim served last      deleted when nothing is
                                        (rotation)                        pending (claim, sweep)
``<p>:{q}:expires``             STRING  present while an ``x-expires``    PX its TTL
                                        queue is in use (renewed by
                                        publish, claim and declare);
                                        once gone, the sweep purges the
                                        queue's pending jobs
``<p>:{q}:swept``               HASH    when sweeps ran (``at``) and the  PX 1 day, renewed by each
                                        last outage seen (``from``,       sweep, and by a look that
                                        ``to``)                           finds nothing to sweep
``<p>:{q}:metrics:<name>``      HASH    counters (field ``count``):       PX 30 days, renewed by a
                                        ``completed``, ``recovered``,     count; deleted when an
                                        ``stalled``, ``failed``,          ``x-expires`` queue
                                        ``retried``; ``recovered``,       expires
                                        ``stalled`` and ``failed`` also
                                        count by reason (field
                                        ``reason:<reason>``); ``fenced``
                                        (settles that named another
                                        claim) by verb
``<p>:{q}:migrated``            ZSET    source delivery tags ``emq        PX 7 days
                                        migrate`` moved into the queue;
                                        score = when (ms)
``<p>:{q}:bindings``            SET     on a Redis Cluster, the kombu     deleted when the queue
                                        bindings (table, member) of an    expires
                                        ``x-expires`` queue
``<p>:queues``                  SET     registry of task queues: queues   members pruned by the
                                        that hold leased work (no hash    sweep task once a queue
                                        tag: read by the sweep and the    holds no job, no counter
                                        CLI, never by a script)
``<p>:expiring``                SET     registry of ``x-expires``         members pruned by the
                                        queues, for the sweep's expiry    expiry pass
                                        pass (no hash tag)
==============================  ======  ================================  ==========================

``<p>`` is the key prefix (transport option ``key_prefix``, default ``emq``,
itself prefixed by kombu's ``global_keyprefix`` when one is set).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

from celery_emq.errors import InvalidQueueNameError

__all__ = ["JOB_FIELDS", "QueueKeys"]

#: Fields of a job row (``<p>:{q}:job:<id>``).
#: Fields appear on first use: a job never claimed has no ``deliveries``, one
#: that never stalled no ``stalled``, a priority of 0 is not written. The queue
#: is in the key and the message in its own key (``msg:<id>``). Rows written by
#: 0.1.x hold the message as ``payload`` (and every counter); they are read as is.
JOB_FIELDS: tuple[str, ...] = (
    "state",  # delayed | pending | active | dead
    "priority",  # 1..9 when not 0; lower is consumed first (as the stock Redis transport)
    "stalled",  # stall count (HINCRBY), travels with the job
    "deliveries",  # how many times the job was claimed
    "claim",  # the latest claim's id, <deliveries>.<nonce>: its fencing token
    "eta_ms",  # a delayed job's ETA
    "task",  # a delayed job's Celery task id (for a revoke)
    "started",  # the delivery count of the latest claim whose task started (0.2.0 reads it)
    "completed",  # set when an older claim completed the job while a newer one holds it
    "graced",  # the lease deadline the outage rule granted (once per deadline)
    "doomed",  # the claim id a sweep found past its budget, until retire.lua settles it
    "lapsed",  # lapses before its task started (a suspect: claimed alone; capped by max_lapsed)
    "owner",  # worker identity holding the lease while active
    "enqueued_ms",  # publish time (a retry from the morgue resets it to the retry's)
    "claimed_ms",  # time of the latest claim
    "group",  # fair-lane group, when the job was published with one
    "max_stalled",  # the job's own stall budget, when it has one (-1: never)
    "last_error",  # why the job died: stalled | malformed | rejected
    "reason",  # the latest stall's or death's reason: lease_expired | worker_lost | ...
    "error",  # human-readable detail of the death
    "history",  # JSON list of the job's stalls: at, reason, owner, stalled
    "died_ms",  # time of death (dead jobs)
)


@dataclass(frozen=True)
class QueueKeys:
    """Every key of one queue, built from the key prefix and the queue name."""

    prefix: str
    queue: str

    def __post_init__(self) -> None:
        if not self.queue:
            raise InvalidQueueNameError("queue name must not be empty")
        if "{" in self.queue or "}" in self.queue:
            # The name is the keys' hash tag: a brace in it would split a
            # queue's keys over several Redis Cluster slots.
            raise InvalidQueueNameError(
                f"queue name {self.queue!r} must not contain '{{' or '}}' "
                "(it is the hash tag of the queue's keys)"
            )

    @cached_property
    def base(self) -> str:
        """The shared prefix ``<p>:{q}:`` from which scripts derive job keys."""
        return f"{self.prefix}:{{{self.queue}}}:"

    @property
    def pending(self) -> str:
        return self.base + "pending"

    @property
    def active(self) -> str:
        return self.base + "active"

    @property
    def dead(self) -> str:
        return self.base + "dead"

    @property
    def migrated(self) -> str:
        return self.base + "migrated"

    @property
    def wake(self) -> str:
        return self.base + "wake"

    @property
    def suspects(self) -> str:
        return self.base + "suspects"

    @property
    def seq(self) -> str:
        return self.base + "seq"

    @property
    def head(self) -> str:
        return self.base + "head"

    @property
    def lanes(self) -> str:
        return self.base + "lanes"

    @property
    def cursor(self) -> str:
        return self.base + "cursor"

    def lane(self, group: str) -> str:
        """Return the key of one group's fair lane."""
        return self.base + "g:" + group + ":pending"

    @property
    def expires(self) -> str:
        return self.base + "expires"

    @property
    def bindings(self) -> str:
        return self.base + "bindings"

    @property
    def delayed(self) -> str:
        return self.base + "delayed"

    @property
    def soon(self) -> str:
        return self.base + "soon"

    @property
    def etas(self) -> str:
        return self.base + "etas"

    def msg(self, job_id: str) -> str:
        """Return the key of one job's stored message."""
        return self.base + "msg:" + job_id

    @property
    def job_prefix(self) -> str:
        return self.base + "job:"

    def metrics(self, name: str) -> str:
        """Return the key of one counter hash (field ``count``)."""
        return self.base + "metrics:" + name

    def job(self, job_id: str) -> str:
        """Return the key of one job's row."""
        return self.job_prefix + job_id
