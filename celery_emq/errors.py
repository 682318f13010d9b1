"""The one rooted error hierarchy of celery_emq.

Every layer may raise these; they import nothing but the standard library. The
errors the transport raises through kombu are kombu's errors too: the
transport raises subclasses of :class:`BrokerFullError`,
:class:`ReplicasUnconfirmedError` and :class:`BatchFlushError` that are also
kombu's ``OperationalError`` or ``BatchPublishError`` (see
:mod:`celery_emq.transport.errors`), so an ``except`` on either catches them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

__all__ = [
    "NOT_STORED",
    "STORED",
    "UNKNOWN",
    "BatchFlushError",
    "BatchMessage",
    "BrokerFullError",
    "CeleryHookMissingError",
    "EmqError",
    "InvalidBrokerURLError",
    "InvalidOptionError",
    "InvalidQueueNameError",
    "ReplicasUnconfirmedError",
    "ScriptContractError",
    "StalledJobError",
    "UnknownJobError",
]


class EmqError(Exception):
    """Root of every error celery_emq raises on purpose."""


class InvalidOptionError(EmqError, ValueError):
    """A transport option has a value outside its accepted range.

    The message always names the option and what it accepts.
    """

    def __init__(self, option: str, value: object, accepted: str) -> None:
        self.option = option
        self.value = value
        self.accepted = accepted
        super().__init__(f"invalid transport option {option}={value!r}: expected {accepted}")


class InvalidQueueNameError(EmqError, ValueError):
    """A queue name cannot be stored (it would not share one hash slot)."""


class BrokerFullError(EmqError):
    """Redis refused a publish: it reached ``maxmemory`` and evicts nothing.

    Nothing of the job was written (a script is refused at its first write).
    What the transport raises is a kombu ``OperationalError`` too, so code that
    catches those still does.
    """

    def __init__(self, queue: str, detail: str) -> None:
        self.queue = queue
        super().__init__(
            f"Redis refused the publish to queue {queue!r}: it is out of memory "
            f"(maxmemory reached with maxmemory-policy noeviction); nothing was written. "
            f"Drain or purge queues, or raise maxmemory. Redis said: {detail}"
        )


class CeleryHookMissingError(EmqError, RuntimeError):
    """The running Celery lacks an internal a guarantee of celery_emq rests on.

    Raised as a worker starts (never in a producer): each missing hook is
    named with what is wrong, the guarantee it serves, and the Celery, kombu
    and billiard versions. The hooks are listed in docs/hooks.md.
    """

    def __init__(self, missing: Sequence[tuple[str, str, str]], versions: str) -> None:
        #: (hook, what is wrong, the guarantee it serves) for each missing hook.
        self.missing = tuple(missing)
        self.versions = versions
        lines = "; ".join(
            f"{hook} ({problem}), which keeps this guarantee: {guarantee}"
            for hook, problem, guarantee in self.missing
        )
        super().__init__(
            f"celery_emq cannot run in this worker: {versions} lacks {lines}. "
            f"celery_emq supports Celery 5.4 to 5.7 (see docs/hooks.md)"
        )


class ScriptContractError(EmqError):
    """A Lua script answered with something its header does not allow.

    This signals a bug or a foreign writer on the keys, never an expected
    outcome: expected outcomes are return codes.
    """


class StalledJobError(EmqError):
    """A task was dead-lettered: it stalled more times than its budget allows.

    Stored as the task's result (when a result backend is configured), so
    ``AsyncResult.get()`` raises it instead of waiting forever.
    """

    def __init__(
        self,
        message: str = "",
        job_id: str = "",
        queue: str = "",
        stalled: int = 0,
        reason: str = "",
    ) -> None:
        self.job_id = job_id
        self.queue = queue
        self.stalled = stalled
        self.reason = reason
        super().__init__(message or f"job {job_id} in {queue} stalled {stalled} times ({reason})")

    def __reduce__(self) -> tuple[type[StalledJobError], tuple[str, str, str, int, str]]:
        return (type(self), (str(self), self.job_id, self.queue, self.stalled, self.reason))


class InvalidBrokerURLError(EmqError, ValueError):
    """A broker URL names a deployment the transport cannot serve.

    Raised before anything connects, so a mistyped URL never lands on whatever
    Redis answers on ``localhost:6379``.
    """


class ReplicasUnconfirmedError(EmqError):
    """Fewer replicas than ``wait_replicas`` confirmed a publish within ``wait_timeout_ms``.

    The job is stored on the master (the write itself succeeded) but may or may
    not survive a failover. Publishing it again carrying its job id
    (``emq_job_id``, as kombu's retry of the same message does) is recognised
    as the same job while that job waits or runs; once it ran and was acked,
    such a publish is a new run.
    """

    def __init__(self, queue: str, job_id: str, confirmed: int, wanted: int, timeout_ms: int):
        self.queue = queue
        self.job_id = job_id
        self.confirmed = confirmed
        self.wanted = wanted
        self.timeout_ms = timeout_ms
        super().__init__(
            f"publish of job {job_id} to queue {queue!r} was confirmed by {confirmed} of "
            f"{wanted} replica(s) within {timeout_ms} ms (wait_replicas): the job is on the "
            f"master but may or may not survive a failover; publishing it again with "
            f"emq_job_id={job_id!r} does not store it twice while it waits or runs"
        )

    def __reduce__(self) -> tuple[type[ReplicasUnconfirmedError], tuple[str, str, int, int, int]]:
        return (
            type(self),
            (self.queue, self.job_id, self.confirmed, self.wanted, self.timeout_ms),
        )


class UnknownJobError(EmqError, LookupError):
    """Ids given to the morgue name no dead job; nothing was changed.

    ``missing`` holds those ids, in the order given. Ids are checked before
    anything moves; a job that leaves the morgue in between (another retry or
    purge, a retention trim) is not acted on, every other id of the call is,
    and ``done`` holds those (a partial result: ``missing`` names every id
    not acted on).
    """

    def __init__(
        self, missing: list[str], queue: str | None = None, done: Sequence[str] = ()
    ) -> None:
        self.missing = list(missing)
        self.queue = queue
        self.done = list(done)
        where = f"queue {queue!r}" if queue else "any queue's morgue"
        changed = f"the other {len(self.done)} job(s) were acted on" if done else "nothing changed"
        super().__init__(
            f"no dead job with job id or Celery task id {', '.join(map(repr, self.missing))} "
            f"in {where}; {changed}"
        )

    def __reduce__(
        self,
    ) -> tuple[type[UnknownJobError], tuple[list[str], str | None, list[str]]]:
        return (type(self), (self.missing, self.queue, self.done))


#: What became of one message of a failed publish batch flush (:class:`BatchMessage`).
STORED = "stored"
NOT_STORED = "not stored"
UNKNOWN = "unknown"


class BatchMessage(NamedTuple):
    """One message of a failed publish batch flush, and what became of it.

    A message routed to several queues is one ``BatchMessage`` per queue.
    """

    #: The queue; for a fanout message (a broadcast), the channel it is published on.
    queue: str
    #: The job id (``emq_job_id``); ``None`` for a fanout message, which has none.
    job_id: str | None
    #: The Celery task id (the message's ``id`` header); ``None`` if not a task.
    task_id: str | None
    #: :data:`STORED` (in its queue, or already there: a job with its id
    #: existed), :data:`NOT_STORED` (never sent) or :data:`UNKNOWN` (the call
    #: carrying it failed or its reply was lost: it may or may not be stored).
    #: A fanout message counts as stored once published.
    outcome: str


class BatchFlushError(EmqError):
    """A publish batch's flush failed, with what is known (kombu's ``BatchPublishError`` too).

    ``messages`` names every message of the flush (and the publish a flush at
    ``max_size`` was making room for, not sent) as a :class:`BatchMessage`: its
    queue, job id, Celery task id and outcome, in the order they were flushed
    (each queue's jobs together, fanout messages last). The jobs are also in
    exactly one of three lists, each of ``(queue, job_id)``: ``stored`` (the
    job is in its queue), ``duplicate`` (a job with its id was already there:
    nothing changed) and ``unknown`` (the call carrying it failed, or its
    reply was lost: it may or may not be stored). ``confirmed`` is how many
    replicas acknowledged the flush (``None``: not asked, see ``wait_replicas``).

    Publishing a message that is not known stored again with its job id
    (``emq_job_id``, and for a Celery task the same ``task_id``) stores none
    twice while the first copy waits or runs: ``task_ids(UNKNOWN, NOT_STORED)``
    with each message's ``job_id`` is what a Celery caller sends again.
    """

    def __init__(
        self,
        reason: str,
        stored: list[tuple[str, str]],
        duplicate: list[tuple[str, str]],
        unknown: list[tuple[str, str]],
        confirmed: int | None = None,
        messages: Sequence[BatchMessage] = (),
    ) -> None:
        self.reason = reason
        self.stored = stored
        self.duplicate = duplicate
        self.unknown = unknown
        self.confirmed = confirmed
        self.messages = [BatchMessage(*m) for m in messages]
        counts = {
            outcome: sum(m.outcome == outcome for m in self.messages)
            for outcome in (NOT_STORED, UNKNOWN)
        }
        pending = self.task_ids(UNKNOWN, NOT_STORED)
        shown = ", ".join(pending[:5]) + (
            f" and {len(pending) - 5} more" if len(pending) > 5 else ""
        )
        super().__init__(
            f"publish batch flush failed ({reason}): {len(stored)} job(s) stored, "
            f"{len(duplicate)} already there, {len(unknown)} of unknown outcome"
            + (f", {counts[NOT_STORED]} message(s) not sent" if counts[NOT_STORED] else "")
            + (f"; task(s) not known stored: {shown}" if pending else "")
        )

    def task_ids(self, *outcomes: str) -> list[str]:
        """Return the Celery task ids of the messages with one of ``outcomes``, in order."""
        return [m.task_id for m in self.messages if m.outcome in outcomes and m.task_id]

    def __reduce__(self) -> tuple[Any, ...]:
        return (
            type(self),
            (
                self.reason,
                self.stored,
                self.duplicate,
                self.unknown,
                self.confirmed,
                [tuple(m) for m in self.messages],
            ),
        )
