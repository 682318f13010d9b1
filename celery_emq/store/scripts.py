"""The Lua transitions: one typed method per script (the scripts are in ``lua/``).

Expected outcomes (not found, lease lost, duplicate, dead) come back as an
:class:`~celery_emq.store.outcomes.Outcome` (read in :mod:`.calls`); calls sent
together in one round trip are a :class:`~celery_emq.store.batch.Batch`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from celery_emq.errors import ScriptContractError
from celery_emq.store.batch import Batch
from celery_emq.store.calls import (
    ACK_BATCH,
    ENQUEUE_BATCH,
    EXTEND_BATCH,
    MORGUE_BATCH,
    ack_call,
    ack_outcomes,
    enqueue_call,
    enqueue_many_calls,
    enqueue_many_outcomes,
    oldest_call,
    outcome_of,
    promote_keys,
    read_oldest,
    read_tally,
    start_call,
    tally_keys,
    text,
    time_arg,
)
from celery_emq.store.keys import QueueKeys
from celery_emq.store.loader import SCRIPT_NAMES, Loaded, script_source
from celery_emq.store.outcomes import (
    UNSET,
    Claimed,
    Claims,
    Looked,
    NewJob,
    Outcome,
    Swept,
    SweptJobs,
    SweptOutcome,
    Unset,
    live_token,
    new_nonce,
)

# What the scripts' callers import with them: the results' types, the batch and
# its sizes, and the loader's names.
__all__ = [
    "ACK_BATCH",
    "ENQUEUE_BATCH",
    "EXTEND_BATCH",
    "MORGUE_BATCH",
    "SCRIPT_NAMES",
    "UNSET",
    "Batch",
    "Claimed",
    "Claims",
    "NewJob",
    "Outcome",
    "Scripts",
    "Swept",
    "Unset",
    "live_token",
    "new_nonce",
    "read_tally",
    "script_source",
]


class Scripts(Loaded):
    """The Lua transitions, registered on one redis-py client: one typed method per script."""

    def enqueue(
        self,
        k: QueueKeys,
        job_id: str,
        payload: str | bytes,
        priority: int,
        now_ms: int | None,
        ttl_ms: int = 0,
        max_stalled: int | Unset | None = UNSET,
        group: str = "",
        eta_ms: int | None = None,
        task_id: str = "",
        client: Any = None,
    ) -> Outcome:
        """Add a job to ``pending`` (or its group's lane); ``DUPLICATE`` if the id is taken.

        ``payload`` is the message as stored (:func:`celery_emq.store.codec.pack`).
        ``max_stalled`` gives the job a stall budget of its own (``None``: never
        dead-letter); left unset, the sweep's default applies. A job whose
        ``eta_ms`` is still ahead waits in ``delayed`` until it is due. Given a
        pipeline as ``client``, the call is queued on it (and ``OK`` returned).
        """
        keys, args = enqueue_call(
            k, job_id, payload, priority, now_ms, ttl_ms, max_stalled, group, eta_ms, task_id
        )
        if client is not None:
            self.registered["enqueue"](keys=keys, args=args, client=client)
            return Outcome.OK
        return outcome_of(self.run("enqueue", keys, args), "enqueue")

    def enqueue_many(
        self, k: QueueKeys, jobs: Sequence[NewJob], now_ms: int | None, ttl_ms: int = 0
    ) -> list[Outcome]:
        """Add jobs as :meth:`enqueue` would, in order; one :class:`Outcome` per job.

        One call per :data:`ENQUEUE_BATCH` jobs.
        """
        out: list[Outcome] = []
        for keys, args, n in enqueue_many_calls(k, jobs, now_ms, ttl_ms):
            out.extend(enqueue_many_outcomes(self.run("enqueue_many", keys, args), n))
        return out

    def promote(
        self, k: QueueKeys, now_ms: int | None, limit: int, task_ids: Sequence[str] = ()
    ) -> tuple[int, bool]:
        """Move due delayed jobs (and those of ``task_ids``, due or not) to their queue.

        Returns how many were promoted, and whether the queue has jobs to claim.
        """
        reply = self.run(
            "promote",
            promote_keys(k),
            [time_arg(now_ms), limit, *task_ids],
        )
        return int(reply[0]), bool(reply[1])

    def promote_many(self, queues: Sequence[QueueKeys], limit: int) -> list[tuple[int, bool, int]]:
        """Promote due delayed jobs of several queues of one server, in one call.

        Returns, per queue: how many were promoted, whether it has jobs to
        claim, and in how many ms its earliest delayed job is due (-1: none).
        """
        reply = self.run("promote", [key for k in queues for key in promote_keys(k)], ["", limit])
        if len(reply) != 3 * len(queues):
            raise ScriptContractError(f"promote.lua answered {len(reply)} items")
        return [
            (int(reply[i]), bool(reply[i + 1]), int(reply[i + 2])) for i in range(0, len(reply), 3)
        ]

    def look(
        self,
        queues: Sequence[QueueKeys],
        since: Sequence[str],
        now_ms: int | None,
        lease_ms: int,
        dead_max_age_ms: int,
        dead_max_size: int,
        expiring: str,
    ) -> Looked:
        """Ask which of several queues of one server need a sweep pass (``look.lua``)."""
        keys = [
            key
            for k in queues
            for key in (k.active, k.pending, k.wake, k.head, k.dead, k.lanes, k.base)
        ]
        reply = self.run(
            "look",
            [expiring, *keys],
            [time_arg(now_ms), lease_ms, dead_max_age_ms, dead_max_size, *since],
        )
        if len(reply) != 2 + len(queues):
            raise ScriptContractError(f"look.lua answered {len(reply)} items")
        return Looked(int(reply[0]), int(reply[1]), [bool(x) for x in reply[2:]])

    def tally(
        self, k: QueueKeys, offset: int, limit: int, heads: bool = False
    ) -> tuple[dict[str, int], list[tuple[str, int, int | None]]]:
        """Return a queue's counts and one page of its lanes: (group, size, head's enqueued_ms).

        The counts are ``pending`` (the default lane only), ``active``,
        ``delayed``, ``dead`` and ``lanes`` (how many there are).
        """
        reply = self.run("tally", tally_keys(k), [offset, limit, 1 if heads else 0])
        return read_tally(reply)

    def oldest(
        self, k: QueueKeys, lane_offset: int, lane_limit: int, active_offset: int, active_limit: int
    ) -> tuple[int | None, int | None]:
        """Return the least ``enqueued_ms`` of a page of lanes and ``claimed_ms`` of active jobs.

        The default lane is read with the first page of lanes (``lane_offset`` 0);
        each lane is read at the head of every priority band in use.
        """
        keys, args = oldest_call(k, lane_offset, lane_limit, active_offset, active_limit)
        return read_oldest(self.run("oldest", keys, args))

    def claim(
        self,
        k: QueueKeys,
        now_ms: int | None,
        lease_ms: int,
        owner: str,
        count: int,
        held: int = 0,
        ttl_ms: int = 0,
        take_suspect: bool = True,
        runs_here: bool = True,
    ) -> Claims:
        """Claim up to ``count`` jobs, leasing each to ``owner`` under a fresh claim id.

        A job that lapsed before its task started (a suspect, its
        :class:`Claimed` marked ``suspect``) is taken only if ``take_suspect``,
        one per call; one it may not take keeps its place, the jobs behind it
        are taken, and the reply says so (``passed_suspect``).
        """
        nonce = new_nonce()
        reply = self.run(
            "claim",
            [k.pending, k.active, k.wake, k.seq, k.head, k.lanes, k.cursor, k.expires, k.base],
            [
                time_arg(now_ms),
                lease_ms,
                owner,
                count,
                held,
                ttl_ms,
                nonce,
                int(take_suspect),
                int(runs_here),
            ],
        )
        passed = len(reply) % 6 == 1 and text(reply[-1]) == "suspect"
        if passed:
            reply = reply[:-1]
        if len(reply) % 6:
            raise ScriptContractError(f"claim.lua answered {len(reply)} items")
        out = Claims(
            Claimed(
                text(reply[i]),
                reply[i + 1],
                int(reply[i + 2]),
                int(reply[i + 3]),
                f"{int(reply[i + 3])}.{nonce}",
                bool(int(reply[i + 4])),
                bool(int(reply[i + 5])),
            )
            for i in range(0, len(reply), 6)
        )
        out.passed_suspect = passed
        return out

    def start(self, k: QueueKeys, job_id: str, token: str, received: bool = False) -> Outcome:
        """Record that the claim ``token`` of a job started its task (or, ``received``,
        that its message was received whole)."""
        return outcome_of(self.run("start", *start_call(k, job_id, token, received)), "start")

    def ack(self, k: QueueKeys, claims: Sequence[tuple[str, str]]) -> list[Outcome]:
        """Delete finished jobs, each named by its claim (id, token); one outcome each."""
        outcomes: list[Outcome] = []
        for start in range(0, len(claims), ACK_BATCH):
            chunk = claims[start : start + ACK_BATCH]
            outcomes.extend(ack_outcomes(self.run("ack", *ack_call(k, chunk)), len(chunk)))
        return outcomes

    def batch(self) -> Batch:
        """Return an empty :class:`Batch` of script calls on this client."""
        return Batch(self)

    def release(
        self, k: QueueKeys, job_id: str, token: str, unless_started: bool = False
    ) -> Outcome:
        """Return a claimed job to the front of ``pending`` without counting a stall."""
        return outcome_of(
            self.run(
                "release",
                [k.active, k.pending, k.wake, k.head, k.job(job_id), k.lanes, k.base],
                [job_id, token, 1 if unless_started else 0],
            ),
            "release",
        )

    def extend(
        self,
        k: QueueKeys,
        lease_ms: int,
        now_ms: int | None,
        claims: Sequence[tuple[str, str]],
    ) -> list[tuple[str, str]]:
        """Renew the leases of live claims; return the claims that are lost."""
        lost: list[tuple[str, str]] = []
        for start in range(0, len(claims), EXTEND_BATCH):
            chunk = claims[start : start + EXTEND_BATCH]
            reply = self.run(
                "extend",
                [k.active, k.job_prefix, k.metrics("fenced")],
                [lease_ms, time_arg(now_ms), *(x for claim in chunk for x in claim)],
            )
            lost.extend((text(reply[i]), text(reply[i + 1])) for i in range(0, len(reply), 2))
        return lost

    def bury(
        self,
        k: QueueKeys,
        job_id: str,
        token: str,
        reason: str,
        error: str,
        now_ms: int | None,
    ) -> Outcome:
        """Dead-letter one job into the morgue with a reason."""
        return outcome_of(
            self.run(
                "bury",
                [
                    k.active,
                    k.pending,
                    k.wake,
                    k.dead,
                    k.job(job_id),
                    k.metrics("failed"),
                    k.base,
                ],
                [job_id, token, reason, error, time_arg(now_ms)],
            ),
            "bury",
        )

    def purge(
        self, k: QueueKeys, limit: int, expired: bool = False, counters: Sequence[str] = ()
    ) -> int:
        """Delete up to ``limit`` pending and delayed jobs; return how many went.

        With ``expired``, only when the x-expires queue is unused: -1 while in
        use; and once the queue holds no job at all, its other keys (the
        ``counters`` named among them) are deleted as well.
        """
        return int(
            self.run(
                "purge",
                [
                    k.pending,
                    k.wake,
                    k.seq,
                    k.head,
                    k.lanes,
                    k.cursor,
                    k.expires,
                    k.base,
                    k.delayed,
                    k.etas,
                ],
                [limit, 1 if expired else 0, *(counters if expired else ())],
            )
        )

    def sweep(
        self,
        k: QueueKeys,
        now_ms: int | None,
        limit: int,
        max_stalled: int | None,
        reason: str,
        lease_ms: int,
        claims: Sequence[tuple[str, str]] = (),
        max_lapsed: int | None = None,
        dead_max_age_ms: int = 0,
        dead_max_size: int = 0,
        expiring: str = "",
        since: str = "0",
    ) -> SweptJobs:
        """Count a stall on lapsed (or the named) claims; recover or dead-letter each.

        A lapsed claim whose task never started is requeued uncounted; one that
        lapsed in an outage (no sweep for over half ``lease_ms``) is granted
        one more lease, once. Past ``max_lapsed`` lapses before a start
        (``None``: no bound), a job is dead-lettered as ``never_started``.
        A pass over lapsed claims (no ``claims``) then applies the morgue's
        retention (0 disables a bound): each dead job it deletes is reported
        with the outcome ``trimmed``. Given the ``expiring`` registry's key (on
        one server), such a pass ends with ``Swept("", "expiring", n)`` when the
        registry holds ``n`` > 0 queues.
        ``since`` is the caller's evidence of an outage (sweep.lua's outage
        rule): the server time of its last pass on this node, ``""`` for a
        caller that has none and met no failure, ``"0"`` for one that knows
        nothing (the gap since any sweep is taken as the outage).
        """
        reply = self.run(
            "sweep",
            [k.active, k.pending, k.wake, k.head, k.dead, k.lanes, k.base]
            + ([expiring] if expiring else []),
            [
                time_arg(now_ms),
                limit,
                -1 if max_stalled is None else max_stalled,
                reason,
                lease_ms,
                -1 if max_lapsed is None else max_lapsed,
                dead_max_age_ms,
                dead_max_size,
                since,
                *(x for claim in claims for x in claim),
            ],
        )
        if len(reply) % 4:
            raise ScriptContractError(f"sweep.lua answered {len(reply)} items")
        try:
            out = SweptJobs(
                Swept(
                    text(reply[i]),
                    SweptOutcome(text(reply[i + 1])),
                    int(reply[i + 2]),
                    reply[i + 3] or b"",
                )
                for i in range(0, len(reply), 4)
            )
        except ValueError as exc:
            raise ScriptContractError(f"sweep.lua answered {exc}") from exc
        if out and out[-1].outcome == SweptOutcome.CLOCK:
            out.now_ms = out.pop().stalled
        return out

    def retire(self, k: QueueKeys, job_id: str, succeeded: bool, now_ms: int | None) -> Outcome:
        """Settle a job the sweep doomed: dead-lettered, or deleted when it ``succeeded``."""
        return outcome_of(
            self.run(
                "retire",
                [k.active, k.dead, k.job(job_id), k.base],
                [job_id, int(succeeded), time_arg(now_ms)],
            ),
            "retire",
        )

    def reap(self, k: QueueKeys, now_ms: int | None, limit: int) -> list[str]:
        """Return lapsed jobs to the front of ``pending``, uncounted; return their ids."""
        reply = self.run(
            "reap",
            [k.active, k.pending, k.wake, k.head, k.lanes, k.base],
            [time_arg(now_ms), limit],
        )
        return [text(x) for x in reply]

    def retry(
        self, k: QueueKeys, now_ms: int | None, job_ids: Sequence[str], whole: bool = False
    ) -> tuple[list[str], list[str]]:
        """Move dead jobs back to the front of their queue or lane.

        Returns the ids moved and the ids that were not dead. With ``whole``,
        a batch (:data:`MORGUE_BATCH` ids) holding an id that is not dead moves
        nothing.
        """
        moved: list[str] = []
        missing: list[str] = []
        for start in range(0, len(job_ids), MORGUE_BATCH):
            chunk = job_ids[start : start + MORGUE_BATCH]
            done, absent = self.run(
                "retry",
                [k.dead, k.pending, k.wake, k.head, k.lanes, k.base],
                [time_arg(now_ms), int(whole), *chunk],
            )
            moved.extend(text(x) for x in done)
            missing.extend(text(x) for x in absent)
        return moved, missing

    def give_back(self, k: QueueKeys) -> bool:
        """Return a popped wake marker while the queue has claimable jobs."""
        return bool(self.run("give_back", [k.wake, k.pending, k.lanes], []))

    def budget(self, k: QueueKeys, job_id: str, max_stalled: int) -> bool:
        """Write a task's own stall budget on an existing job row; False when it is gone."""
        return bool(self.run("budget", [k.job(job_id)], [max_stalled]))

    def purge_dead(
        self, k: QueueKeys, job_ids: Sequence[str], whole: bool = False
    ) -> tuple[int, list[str]]:
        """Delete dead jobs by id.

        Returns how many were deleted and the ids that were not dead. With
        ``whole``, a batch holding an id that is not dead deletes nothing.
        """
        n = 0
        missing: list[str] = []
        for start in range(0, len(job_ids), MORGUE_BATCH):
            chunk = job_ids[start : start + MORGUE_BATCH]
            deleted, absent = self.run("purge_dead", [k.dead, k.base], [int(whole), *chunk])
            n += int(deleted)
            missing.extend(text(x) for x in absent)
        return n, missing
