"""Loads ``lua/*.lua`` once and offers one typed method per script.

Expected outcomes (not found, lease lost, duplicate, dead) come back as an
:class:`Outcome`; the mapping from the scripts' integer codes lives here only.
"""

from __future__ import annotations

import enum
import secrets
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from importlib import resources
from typing import Any

from redis.cluster import RedisCluster
from redis.exceptions import (
    AskError,
    ClusterDownError,
    ConnectionError,
    MovedError,
    NoScriptError,
    RedisClusterException,
    RedisError,
    TimeoutError,
    TryAgainError,
)

from .errors import ScriptContractError
from .keys import QueueKeys

__all__ = [
    "SCRIPT_NAMES",
    "UNSET",
    "Batch",
    "Claimed",
    "NewJob",
    "Outcome",
    "Scripts",
    "Swept",
    "Unset",
    "script_source",
]

SCRIPT_NAMES: tuple[str, ...] = (
    "enqueue",
    "enqueue_many",
    "claim",
    "start",
    "ack",
    "release",
    "extend",
    "bury",
    "purge",
    "reap",
    "sweep",
    "retry",
    "purge_dead",
    "give_back",
    "promote",
    "tally",
    "oldest",
)

#: Most claims one ``extend`` call carries (the rest go in further calls).
EXTEND_BATCH = 512
#: Most jobs one ``enqueue_many`` call adds (the rest go in further calls).
ENQUEUE_BATCH = 500
#: Most claims one ``ack`` call carries.
ACK_BATCH = 500
#: Most ids one ``retry`` or ``purge_dead`` call carries.
MORGUE_BATCH = 500


class Outcome(enum.IntEnum):
    """What a transition did, as the scripts report it."""

    OK = 0
    NOT_FOUND = 1
    LEASE_LOST = 2
    DUPLICATE = 3
    DEAD = 4
    FENCED = 5
    STARTED = 6
    COMPLETED = 7


class Unset(enum.Enum):
    """The type of :data:`UNSET`."""

    UNSET = "unset"


#: Marks an argument left to the default (where ``None`` has a meaning of its own).
UNSET = Unset.UNSET


def _time_arg(now_ms: int | None) -> int | str:
    """``now_ms`` for a script: ``''`` makes the script read the Redis server's clock."""
    return "" if now_ms is None else now_ms


def _budget_arg(max_stalled: int | Unset | None) -> str | int:
    if max_stalled is UNSET:
        return ""
    return -1 if max_stalled is None else max_stalled


@dataclass(frozen=True)
class Swept:
    """One job a sweep examined: what it did and the job's stall count."""

    id: str
    #: "recovered" | "dead" | "requeued" (lapsed before it started: uncounted) |
    #: "completed" (an older claim completed it: deleted) | "graced" (lapsed in an
    #: outage: one more lease, uncounted)
    outcome: str
    stalled: int
    payload: bytes


@dataclass(frozen=True)
class Claimed:
    """One job handed out by ``claim``."""

    id: str
    #: the message as stored (see :mod:`celery_emq.codec`)
    payload: bytes
    stalled: int
    deliveries: int
    #: the claim's id, ``<deliveries>.<nonce>``: its fencing token, which every
    #: settle of the claim names (see :func:`new_nonce`)
    token: str
    #: a delayed job promoted by a revoke of its task
    revoked: bool = False
    #: handed out alone: the job lapsed before its task ever started, so it may be
    #: a message that kills its worker while it is received
    suspect: bool = False


def live_token(claim: str | None, deliveries: str | None) -> str:
    """Return the token of a row's live claim, as the scripts read it.

    The claim id, unless the row was last claimed by an earlier version that
    kept none: then the delivery count (a rolling upgrade).
    """
    if claim and deliveries and claim.split(".", 1)[0] == deliveries:
        return claim
    return deliveries or ""


def new_nonce() -> str:
    """Return a fresh random value for one claim call (64 bits from the OS).

    A claim's id joins the job's delivery count with it. The count alone
    repeats when the server loses its last writes (it rolls back, and the next
    claim counts the same number again); the nonce is made by the caller, not
    by the server, so no rollback can issue it again.
    """
    return secrets.token_hex(8)


@dataclass(frozen=True)
class NewJob:
    """One job for ``enqueue_many``: what one ``enqueue`` call is given."""

    id: str
    #: the message as stored (see :mod:`celery_emq.codec`)
    payload: bytes
    priority: int = 0
    max_stalled: int | Unset | None = UNSET
    group: str = ""
    eta_ms: int | None = None
    task_id: str = ""


def script_source(name: str) -> str:
    """Return the Lua source of one script shipped in ``celery_emq/lua``."""
    return resources.files("celery_emq").joinpath("lua").joinpath(f"{name}.lua").read_text("utf-8")


def _outcome(reply: Any, script: str) -> Outcome:
    try:
        return Outcome(int(reply))
    except (TypeError, ValueError) as exc:
        raise ScriptContractError(f"{script}.lua answered {reply!r}") from exc


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


def _start_call(k: QueueKeys, job_id: str, token: str) -> tuple[list[str], list[Any]]:
    return [k.job(job_id), k.metrics("fenced")], [token]


def _ack_call(k: QueueKeys, chunk: Sequence[tuple[str, str]]) -> tuple[list[str], list[Any]]:
    keys = [k.active, k.pending, k.wake, k.dead, k.metrics("completed"), k.base]
    return keys, [x for claim in chunk for x in claim]


def _ack_outcomes(reply: Any, expected: int) -> list[Outcome]:
    if len(reply) != expected:
        raise ScriptContractError(f"ack.lua answered {len(reply)} codes")
    return [_outcome(code, "ack") for code in reply]


def read_tally(reply: Any) -> tuple[dict[str, int], list[tuple[str, int, int | None]]]:
    """Read what ``tally.lua`` answered (see :meth:`Scripts.tally`)."""
    if len(reply) < 5 or (len(reply) - 5) % 3:
        raise ScriptContractError(f"tally.lua answered {len(reply)} items")
    names = ("pending", "active", "delayed", "dead", "lanes")
    counts = {n: int(v) for n, v in zip(names, reply[:5], strict=True)}
    page = [
        (_text(reply[i]), int(reply[i + 1]), int(reply[i + 2]) if reply[i + 2] else None)
        for i in range(5, len(reply), 3)
    ]
    return counts, page


def _oldest_call(
    k: QueueKeys, lane_offset: int, lane_limit: int, active_offset: int, active_limit: int
) -> tuple[list[str], list[Any]]:
    return (
        [k.pending, k.active, k.lanes, k.base],
        [lane_offset, lane_limit, active_offset, active_limit],
    )


def read_oldest(reply: Any) -> tuple[int | None, int | None]:
    """Read what ``oldest.lua`` answered (see :meth:`Scripts.oldest`)."""
    if not isinstance(reply, list) or len(reply) != 2:
        raise ScriptContractError(f"oldest.lua answered {reply!r}")
    enqueued, claimed = reply
    return (int(enqueued) if enqueued else None, int(claimed) if claimed else None)


class Scripts:
    """The Lua transitions, registered on one redis-py client."""

    def __init__(self, client: Any) -> None:
        self._client = client
        self._scripts = {name: client.register_script(script_source(name)) for name in SCRIPT_NAMES}

    def _run(self, name: str, keys: Sequence[str], args: Sequence[Any]) -> Any:
        script = self._scripts[name]
        try:
            # The common case in one call: the script is already loaded.
            return self._client.evalsha(script.sha, len(keys), *keys, *args)
        except RedisClusterException as exc:
            # No node of a cluster answers (or none serves the slot): not a
            # RedisError, but the same as a connection that failed.
            raise ConnectionError(f"Redis Cluster: {exc}") from exc
        except NoScriptError:
            # Loads it (after a restart or SCRIPT FLUSH) and runs it again.
            return script(keys=list(keys), args=list(args), client=self._client)

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

        ``payload`` is the message as stored (:func:`celery_emq.codec.pack`).
        ``max_stalled`` gives the job a stall budget of its own (``None``: never
        dead-letter); left unset, the sweep's default applies. A job whose
        ``eta_ms`` is still ahead waits in ``delayed`` until it is due. Given a
        pipeline as ``client``, the call is queued on it (and ``OK`` returned).
        """
        keys, args = _enqueue_call(
            k, job_id, payload, priority, now_ms, ttl_ms, max_stalled, group, eta_ms, task_id
        )
        if client is not None:
            self._scripts["enqueue"](keys=keys, args=args, client=client)
            return Outcome.OK
        return _outcome(self._run("enqueue", keys, args), "enqueue")

    def enqueue_many(
        self, k: QueueKeys, jobs: Sequence[NewJob], now_ms: int | None, ttl_ms: int = 0
    ) -> list[Outcome]:
        """Add jobs as :meth:`enqueue` would, in order; one :class:`Outcome` per job.

        One call per :data:`ENQUEUE_BATCH` jobs.
        """
        out: list[Outcome] = []
        for keys, args, n in _enqueue_many_calls(k, jobs, now_ms, ttl_ms):
            out.extend(_enqueue_many_outcomes(self._run("enqueue_many", keys, args), n))
        return out

    def promote(
        self, k: QueueKeys, now_ms: int | None, limit: int, task_ids: Sequence[str] = ()
    ) -> tuple[int, bool]:
        """Move due delayed jobs (and those of ``task_ids``, due or not) to their queue.

        Returns how many were promoted, and whether the queue has jobs to claim.
        """
        reply = self._run(
            "promote",
            self._promote_keys(k),
            [_time_arg(now_ms), limit, *task_ids],
        )
        return int(reply[0]), bool(reply[1])

    def tally(
        self, k: QueueKeys, offset: int, limit: int, heads: bool = False
    ) -> tuple[dict[str, int], list[tuple[str, int, int | None]]]:
        """Return a queue's counts and one page of its lanes: (group, size, head's enqueued_ms).

        The counts are ``pending`` (the default lane only), ``active``,
        ``delayed``, ``dead`` and ``lanes`` (how many there are).
        """
        reply = self._run("tally", self.tally_keys(k), [offset, limit, 1 if heads else 0])
        return read_tally(reply)

    def oldest(
        self, k: QueueKeys, lane_offset: int, lane_limit: int, active_offset: int, active_limit: int
    ) -> tuple[int | None, int | None]:
        """Return the least ``enqueued_ms`` of a page of lanes and ``claimed_ms`` of active jobs.

        The default lane is read with the first page of lanes (``lane_offset`` 0);
        each lane is read at the head of every priority band in use.
        """
        keys, args = _oldest_call(k, lane_offset, lane_limit, active_offset, active_limit)
        return read_oldest(self._run("oldest", keys, args))

    @staticmethod
    def tally_keys(k: QueueKeys) -> list[str]:
        return [k.pending, k.active, k.delayed, k.dead, k.lanes, k.base]

    @staticmethod
    def _promote_keys(k: QueueKeys) -> list[str]:
        return [k.pending, k.wake, k.seq, k.lanes, k.delayed, k.etas, k.base]

    def claim(
        self,
        k: QueueKeys,
        now_ms: int | None,
        lease_ms: int,
        owner: str,
        count: int,
        held: int = 0,
        ttl_ms: int = 0,
        alone: bool = True,
    ) -> list[Claimed]:
        """Claim up to ``count`` jobs, leasing each to ``owner`` under a fresh claim id.

        A job that lapsed before its task started is claimed only ``alone``
        (the caller holds no other claim), and only as the first of the batch:
        a batch of its own, its :class:`Claimed` marked ``suspect``.
        """
        nonce = new_nonce()
        reply = self._run(
            "claim",
            [k.pending, k.active, k.wake, k.seq, k.head, k.lanes, k.cursor, k.expires, k.base],
            [_time_arg(now_ms), lease_ms, owner, count, held, ttl_ms, nonce, int(alone)],
        )
        if len(reply) % 6:
            raise ScriptContractError(f"claim.lua answered {len(reply)} items")
        return [
            Claimed(
                _text(reply[i]),
                reply[i + 1],
                int(reply[i + 2]),
                int(reply[i + 3]),
                f"{int(reply[i + 3])}.{nonce}",
                bool(int(reply[i + 4])),
                bool(int(reply[i + 5])),
            )
            for i in range(0, len(reply), 6)
        ]

    def start(self, k: QueueKeys, job_id: str, token: str) -> Outcome:
        """Record that the claim ``token`` of a job started its task."""
        return _outcome(self._run("start", *_start_call(k, job_id, token)), "start")

    def ack(self, k: QueueKeys, claims: Sequence[tuple[str, str]]) -> list[Outcome]:
        """Delete finished jobs, each named by its claim (id, token); one outcome each."""
        outcomes: list[Outcome] = []
        for start in range(0, len(claims), ACK_BATCH):
            chunk = claims[start : start + ACK_BATCH]
            outcomes.extend(_ack_outcomes(self._run("ack", *_ack_call(k, chunk)), len(chunk)))
        return outcomes

    def batch(self) -> Batch:
        """Return an empty :class:`Batch` of script calls on this client."""
        return Batch(self)

    def release(
        self, k: QueueKeys, job_id: str, token: str, unless_started: bool = False
    ) -> Outcome:
        """Return a claimed job to the front of ``pending`` without counting a stall."""
        return _outcome(
            self._run(
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
            reply = self._run(
                "extend",
                [k.active, k.job_prefix, k.metrics("fenced")],
                [lease_ms, _time_arg(now_ms), *(x for claim in chunk for x in claim)],
            )
            lost.extend((_text(reply[i]), _text(reply[i + 1])) for i in range(0, len(reply), 2))
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
        return _outcome(
            self._run(
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
                [job_id, token, reason, error, _time_arg(now_ms)],
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
            self._run(
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
    ) -> list[Swept]:
        """Count a stall on lapsed (or the named) claims; recover or dead-letter each.

        A lapsed claim whose task never started is requeued uncounted; one that
        lapsed in an outage (no sweep for over half ``lease_ms``) is granted
        one more lease, once. Past ``max_lapsed`` lapses before a start
        (``None``: no bound), a job is dead-lettered as ``never_started``.
        A pass over lapsed claims (no ``claims``) then applies the morgue's
        retention (0 disables a bound): each dead job it deletes is reported
        with the outcome ``trimmed``.
        """
        reply = self._run(
            "sweep",
            [k.active, k.pending, k.wake, k.head, k.dead, k.lanes, k.base],
            [
                _time_arg(now_ms),
                limit,
                -1 if max_stalled is None else max_stalled,
                reason,
                lease_ms,
                -1 if max_lapsed is None else max_lapsed,
                dead_max_age_ms,
                dead_max_size,
                *(x for claim in claims for x in claim),
            ],
        )
        if len(reply) % 4:
            raise ScriptContractError(f"sweep.lua answered {len(reply)} items")
        return [
            Swept(_text(reply[i]), _text(reply[i + 1]), int(reply[i + 2]), reply[i + 3] or b"")
            for i in range(0, len(reply), 4)
        ]

    def reap(self, k: QueueKeys, now_ms: int | None, limit: int) -> list[str]:
        """Return lapsed jobs to the front of ``pending``, uncounted; return their ids."""
        reply = self._run(
            "reap",
            [k.active, k.pending, k.wake, k.head, k.lanes, k.base],
            [_time_arg(now_ms), limit],
        )
        return [_text(x) for x in reply]

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
            done, absent = self._run(
                "retry",
                [k.dead, k.pending, k.wake, k.head, k.lanes, k.base],
                [_time_arg(now_ms), int(whole), *chunk],
            )
            moved.extend(_text(x) for x in done)
            missing.extend(_text(x) for x in absent)
        return moved, missing

    def give_back(self, k: QueueKeys) -> bool:
        """Return a popped wake marker while the queue has claimable jobs."""
        return bool(self._run("give_back", [k.wake, k.pending, k.lanes], []))

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
            deleted, absent = self._run("purge_dead", [k.dead, k.base], [int(whole), *chunk])
            n += int(deleted)
            missing.extend(_text(x) for x in absent)
        return n, missing


def _enqueue_call(
    k: QueueKeys,
    job_id: str,
    payload: str | bytes,
    priority: int,
    now_ms: int | None,
    ttl_ms: int,
    max_stalled: int | Unset | None,
    group: str,
    eta_ms: int | None,
    task_id: str,
) -> tuple[list[str], list[Any]]:
    """The KEYS and ARGV of one ``enqueue.lua`` call (see :meth:`Scripts.enqueue`)."""
    keys = [
        k.pending,
        k.wake,
        k.seq,
        k.job(job_id),
        k.lanes,
        k.expires,
        k.base,
        k.msg(job_id),
        k.delayed,
        k.etas,
    ]
    args = [
        job_id,
        payload,
        priority,
        _time_arg(now_ms),
        ttl_ms,
        _budget_arg(max_stalled),
        group,
        "" if eta_ms is None else eta_ms,
        task_id,
    ]
    return keys, args


def _enqueue_many_calls(
    k: QueueKeys, jobs: Sequence[NewJob], now_ms: int | None, ttl_ms: int
) -> list[tuple[list[str], list[Any], int]]:
    """The KEYS, ARGV and job count of each ``enqueue_many.lua`` call for ``jobs``."""
    keys = [k.pending, k.wake, k.seq, k.lanes, k.expires, k.base, k.delayed, k.etas]
    calls = []
    for start in range(0, len(jobs), ENQUEUE_BATCH):
        chunk = jobs[start : start + ENQUEUE_BATCH]
        args: list[Any] = [_time_arg(now_ms), ttl_ms]
        for job in chunk:
            args += (
                job.id,
                job.payload,
                job.priority,
                _budget_arg(job.max_stalled),
                job.group,
                "" if job.eta_ms is None else job.eta_ms,
                job.task_id,
            )
        calls.append((keys, args, len(chunk)))
    return calls


def _enqueue_many_outcomes(reply: Any, expected: int) -> list[Outcome]:
    if len(reply) != expected:
        raise ScriptContractError(f"enqueue_many.lua answered {len(reply)} codes")
    return [_outcome(code, "enqueue_many") for code in reply]


#: Replies of a call (on a cluster) that did not reach the master of its slot:
#: it is run again alone through the cluster client, which follows the change.
_MISSED = (MovedError, AskError, TryAgainError, ClusterDownError, ConnectionError, TimeoutError)


class Batch:
    """Script calls on one client sent together: one round trip for the lot.

    A non-transactional pipeline of ``EVALSHA`` calls: each script stays atomic
    on its own, and one call's error (or a script the server lost after a
    ``SCRIPT FLUSH``, a restart or a failover, which is loaded and run again)
    leaves the others' results standing. redis-py's pipeline would ask ``SCRIPT
    EXISTS`` first, a round trip of its own on every send: the calls here go
    as plain ``EVALSHA`` instead.

    Each method queues one transition and returns a handle; :meth:`execute`
    sends them all, after which :meth:`result` returns a handle's outcome or
    raises the error its call met.
    """

    def __init__(self, scripts: Scripts) -> None:
        self._scripts = scripts
        self._calls: list[tuple[str, list[str], list[Any]]] = []
        self._replies: list[Any] = []
        #: Per handle: the indices of its calls and how to read their replies.
        self._handles: list[tuple[list[int], Callable[[list[Any]], Any]]] = []
        #: Replicas that confirmed the last :meth:`execute`'s writes (None: not asked).
        self.confirmed: int | None = None

    def __len__(self) -> int:
        return len(self._handles)

    def _add(self, calls: list[tuple[str, list[str], list[Any]]], read: Callable[..., Any]) -> int:
        first = len(self._calls)
        self._calls.extend(calls)
        self._handles.append((list(range(first, len(self._calls))), read))
        return len(self._handles) - 1

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
    ) -> int:
        """Queue :meth:`Scripts.enqueue`; its result is an :class:`Outcome`."""
        keys, args = _enqueue_call(
            k, job_id, payload, priority, now_ms, ttl_ms, max_stalled, group, eta_ms, task_id
        )
        return self._add([("enqueue", keys, args)], lambda replies: _outcome(replies[0], "enqueue"))

    def enqueue_many(
        self, k: QueueKeys, jobs: Sequence[NewJob], now_ms: int | None, ttl_ms: int = 0
    ) -> int:
        """Queue :meth:`Scripts.enqueue_many`; its result is one :class:`Outcome` per job."""
        calls = _enqueue_many_calls(k, jobs, now_ms, ttl_ms)

        def read(replies: list[Any]) -> list[Outcome]:
            return [
                o
                for reply, (_keys, _args, n) in zip(replies, calls, strict=True)
                for o in _enqueue_many_outcomes(reply, n)
            ]

        return self._add([("enqueue_many", keys, args) for keys, args, _n in calls], read)

    def start(self, k: QueueKeys, job_id: str, token: str) -> int:
        """Queue :meth:`Scripts.start`; its result is an :class:`Outcome`."""
        return self._add(
            [("start", *_start_call(k, job_id, token))],
            lambda replies: _outcome(replies[0], "start"),
        )

    def ack(self, k: QueueKeys, claims: Sequence[tuple[str, str]]) -> int:
        """Queue :meth:`Scripts.ack`; its result is one :class:`Outcome` per claim."""
        chunks = [claims[i : i + ACK_BATCH] for i in range(0, len(claims), ACK_BATCH)]

        def read(replies: list[Any]) -> list[Outcome]:
            return [
                o
                for reply, chunk in zip(replies, chunks, strict=True)
                for o in _ack_outcomes(reply, len(chunk))
            ]

        return self._add([("ack", *_ack_call(k, chunk)) for chunk in chunks], read)

    def promote(self, k: QueueKeys, limit: int) -> int:
        """Queue :meth:`Scripts.promote` of due jobs; its result is (promoted, waiting)."""
        return self._add(
            [("promote", Scripts._promote_keys(k), ["", limit])],
            lambda replies: (int(replies[0][0]), bool(replies[0][1])),
        )

    def tally(self, k: QueueKeys, offset: int, limit: int, heads: bool = False) -> int:
        """Queue :meth:`Scripts.tally`; its result is (counts, one page of lanes)."""
        return self._add(
            [("tally", Scripts.tally_keys(k), [offset, limit, 1 if heads else 0])],
            lambda replies: read_tally(replies[0]),
        )

    def oldest(
        self, k: QueueKeys, lane_offset: int, lane_limit: int, active_offset: int, active_limit: int
    ) -> int:
        """Queue :meth:`Scripts.oldest`; its result is (enqueued_ms, claimed_ms)."""
        call = _oldest_call(k, lane_offset, lane_limit, active_offset, active_limit)
        return self._add([("oldest", *call)], lambda replies: read_oldest(replies[0]))

    def execute(self, confirm: Callable[[Any], None] | None = None) -> None:
        """Send every queued call in one round trip.

        Args:
            confirm: given, it is handed the pipeline once the calls are queued
                on it and queues one ``WAIT`` there, on the connection that
                carries the writes (:meth:`JobStore.confirm_replicas`);
                :attr:`confirmed` is then how many replicas acknowledged them.

        Raises:
            redis.RedisError: the round trip itself failed (nothing is known
                of any call: each may or may not have run).
        """
        self.confirmed = None
        if not self._calls:
            return
        client = self._scripts._client
        if isinstance(client, RedisCluster):
            try:
                self._replies = self._execute_by_node(client, confirm)
            except RedisClusterException as exc:
                raise ConnectionError(f"Redis Cluster: {exc}") from exc
            return
        replies = self._send(self._calls, confirm, load=False)
        lost = [i for i, reply in enumerate(replies) if isinstance(reply, NoScriptError)]
        if lost:
            # The server lost its scripts (a restart, a failover, SCRIPT FLUSH):
            # run those calls again by their text, in one more round trip on
            # one connection, which the WAIT (if any) then covers too.
            try:
                again = self._send([self._calls[i] for i in lost], confirm, load=True)
            except RedisError as exc:
                again = [exc] * len(lost)
                self.confirmed = 0 if confirm is not None else None
            for i, reply in zip(lost, again, strict=True):
                replies[i] = reply
        self._replies = replies

    def _execute_by_node(
        self, client: RedisCluster, confirm: Callable[[Any], None] | None
    ) -> list[Any]:
        """One pipeline per master, each call to the master of its keys' slot.

        redis-py's cluster pipeline asks the server for the keys of every
        ``EVALSHA`` (``COMMAND GETKEYS``), a command more per call; and a
        ``WAIT`` counts the writes of its own connection only, so each master's
        pipeline carries its own (:attr:`confirmed` is the fewest replicas any
        confirmed). A call whose slot moved, or whose master did not answer, is
        run again alone through the cluster client, outside any ``WAIT`` (so
        counted unconfirmed): every batched transition is safe to repeat (a
        repeated ack finds nothing).
        """
        by_node: dict[str, list[int]] = {}
        nodes: dict[str, Any] = {}
        for i, (_name, keys, _args) in enumerate(self._calls):
            node = client.get_node_from_key(keys[0])  # type: ignore[no-untyped-call]
            by_node.setdefault(node.name, []).append(i)
            nodes[node.name] = node
        replies: list[Any] = [None] * len(self._calls)
        for name, indices in by_node.items():
            server = client.get_redis_connection(nodes[name])
            calls = [self._calls[i] for i in indices]
            try:
                out = self._send(calls, confirm, load=False, client=server)
                lost = [j for j, reply in enumerate(out) if isinstance(reply, NoScriptError)]
                if lost:
                    again = self._send([calls[j] for j in lost], confirm, load=True, client=server)
                    for j, reply in zip(lost, again, strict=True):
                        out[j] = reply
            except RedisError as exc:
                out = [exc] * len(indices)
            for i, reply in zip(indices, out, strict=True):
                replies[i] = reply
        for i, reply in enumerate(replies):
            if isinstance(reply, _MISSED):
                name, keys, args = self._calls[i]
                try:
                    replies[i] = self._scripts._run(name, keys, args)
                except RedisError as exc:
                    replies[i] = exc
                if confirm is not None:
                    self.confirmed = 0
        return replies

    def _send(
        self,
        calls: list[tuple[str, list[str], list[Any]]],
        confirm: Callable[[Any], None] | None,
        load: bool,
        client: Any = None,
    ) -> list[Any]:
        scripts = self._scripts._scripts
        with (client or self._scripts._client).pipeline(transaction=False) as pipe:
            for name, keys, args in calls:
                if load:
                    # EVAL runs the script's text, and caches it for the next EVALSHA.
                    pipe.execute_command("EVAL", scripts[name].script, len(keys), *keys, *args)
                else:
                    pipe.execute_command("EVALSHA", scripts[name].sha, len(keys), *keys, *args)
            if confirm is not None:
                confirm(pipe)
            replies: list[Any] = pipe.execute(raise_on_error=False)
        if confirm is not None:
            reply = replies.pop()
            # The writes of both round trips count: the fewer replicas that hold all.
            n = reply if isinstance(reply, int) else 0
            self.confirmed = n if self.confirmed is None else min(self.confirmed, n)
        return replies

    def result(self, handle: int) -> Any:
        """Return what the call queued as ``handle`` answered, or raise its error."""
        indices, read = self._handles[handle]
        replies = [self._replies[i] for i in indices]
        for reply in replies:
            if isinstance(reply, Exception):
                raise reply
        return read(replies)
