"""What the scripts hand back, typed: outcomes, claimed and swept jobs, and new jobs.

The mapping from the scripts' integer codes to :class:`Outcome` lives in
:mod:`.calls`; these are the values every layer above the store reads.
"""

from __future__ import annotations

import enum
import secrets
from collections.abc import Callable
from dataclasses import dataclass, field

__all__ = [
    "UNSET",
    "Claimed",
    "Claims",
    "Looked",
    "NewJob",
    "Outcome",
    "Scan",
    "Swept",
    "SweptOutcome",
    "Unset",
    "Verdict",
    "live_token",
    "new_nonce",
]


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


class SweptOutcome(str, enum.Enum):
    """What a sweep did with one job (equal to the word ``sweep.lua`` answers)."""

    #: a due delayed job made claimable
    PROMOTED = "promoted"
    #: back at the front of its queue, a stall counted
    RECOVERED = "recovered"
    #: lapsed before it started: back in line, uncounted
    REQUEUED = "requeued"
    #: an older claim completed it, or its task succeeded: deleted
    COMPLETED = "completed"
    #: lapsed in an outage: one more lease, uncounted
    GRACED = "graced"
    #: deleted by the morgue's retention
    TRIMMED = "trimmed"
    #: from the script alone: past its budget, to be retired (see ``JobStore.sweep``)
    DOOMED = "doomed"
    #: retired to the morgue, past its budget of stalls...
    DEAD = "dead"
    #: ...or of lapses before a start
    NEVER_STARTED = "never_started"
    #: not a job: the x-expires registry holds queues (``stalled`` says how many)
    EXPIRING = "expiring"
    #: not a job: the server's clock at the pass (in ``stalled``)
    CLOCK = "clock"


@dataclass(frozen=True)
class Swept:
    """One job a sweep examined: what it did and the job's stall count."""

    id: str
    outcome: SweptOutcome
    stalled: int
    payload: bytes


#: Asked of each job a sweep doomed, before it is retired: did its task succeed after
#: all? Given the job as it would die (outcome "dead" or "never_started") and when it
#: was published (ms, the Redis server's clock; ``None`` if its row does not say).
Verdict = Callable[[Swept, "int | None"], bool]


@dataclass(frozen=True)
class Claimed:
    """One job handed out by ``claim``."""

    id: str
    #: the message as stored (see :mod:`celery_emq.store.codec`)
    payload: bytes
    stalled: int
    deliveries: int
    #: the claim's id, ``<deliveries>.<nonce>``: its fencing token, which every
    #: settle of the claim names (see :func:`new_nonce`)
    token: str
    #: a delayed job promoted by a revoke of its task
    revoked: bool = False
    #: a suspect: the job lapsed before its task ever started, so it may be a
    #: message that kills its worker while it is received (one at a time per caller)
    suspect: bool = False


class Claims(list[Claimed]):
    """What one ``claim`` handed out, in order.

    ``passed_suspect`` is set when the call passed over a job that lapsed
    before its task started, which the caller could not take (it took one
    already, or said it holds one that has not started): that job keeps its
    place, and the claim took the jobs behind it.
    """

    passed_suspect: bool = False


class SweptJobs(list["Swept"]):
    """What one ``sweep`` pass did, in order.

    ``now_ms`` is the server's clock when a pass over lapsed claims ran (the
    sweeper's evidence of its contact with the node; ``None`` for a charge).
    """

    now_ms: int | None = None


@dataclass(frozen=True)
class NewJob:
    """One job for ``enqueue_many``: what one ``enqueue`` call is given."""

    id: str
    #: the message as stored (see :mod:`celery_emq.store.codec`)
    payload: bytes
    priority: int = 0
    max_stalled: int | Unset | None = UNSET
    group: str = ""
    eta_ms: int | None = None
    task_id: str = ""


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
class Looked:
    """What one look over several queues of one server found (see ``JobStore.look``)."""

    #: the server's clock at the look (ms)
    now_ms: int
    #: how many queues the x-expires registry holds
    expiring: int
    #: per queue asked, in order: whether a sweep pass has work there
    needs: list[bool]


@dataclass(frozen=True)
class Scan:
    """What a consumer's look at its queues found (see ``JobStore.scan``)."""

    #: the queues that have jobs to claim, in the order asked
    waiting: list[str]
    #: in how many ms (server clock) the earliest delayed job of these queues is
    #: due; ``None``: none is delayed
    next_due_ms: int | None
    #: the queues whose own call failed (a slot migrating), each with its error:
    #: they are left out of ``waiting``
    failed: dict[str, BaseException] = field(default_factory=dict)
