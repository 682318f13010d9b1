"""The one rooted error hierarchy of celery_emq."""

from __future__ import annotations

from kombu.exceptions import OperationalError

__all__ = [
    "BrokerFullError",
    "EmqError",
    "InvalidBrokerURLError",
    "InvalidOptionError",
    "InvalidQueueNameError",
    "ScriptContractError",
    "StalledJobError",
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


class BrokerFullError(EmqError, OperationalError):
    """Redis refused a publish: it reached ``maxmemory`` and evicts nothing.

    Nothing of the job was written (a script is refused at its first write).
    A kombu ``OperationalError`` too, so code that catches those still does.
    """

    def __init__(self, queue: str, detail: str) -> None:
        self.queue = queue
        super().__init__(
            f"Redis refused the publish to queue {queue!r}: it is out of memory "
            f"(maxmemory reached with maxmemory-policy noeviction); nothing was written. "
            f"Drain or purge queues, or raise maxmemory. Redis said: {detail}"
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
