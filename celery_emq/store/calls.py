"""The KEYS and ARGV of script calls, and how their replies are read.

Shared by :class:`~celery_emq.store.scripts.Scripts` (one call at a time) and
:class:`~celery_emq.store.batch.Batch` (calls sent together), so that both
send the same arguments and read the same answers. The mapping from the
scripts' integer codes to :class:`~celery_emq.store.outcomes.Outcome` lives
here only.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from celery_emq.errors import ScriptContractError
from celery_emq.store.keys import QueueKeys
from celery_emq.store.outcomes import UNSET, NewJob, Outcome, Unset

__all__ = [
    "ACK_BATCH",
    "ENQUEUE_BATCH",
    "EXTEND_BATCH",
    "MORGUE_BATCH",
    "ack_call",
    "ack_outcomes",
    "budget_arg",
    "enqueue_call",
    "enqueue_many_calls",
    "enqueue_many_outcomes",
    "oldest_call",
    "outcome_of",
    "promote_keys",
    "read_oldest",
    "read_tally",
    "start_call",
    "tally_keys",
    "text",
    "time_arg",
]

#: Most claims one ``extend`` call carries (the rest go in further calls).
EXTEND_BATCH = 512
#: Most jobs one ``enqueue_many`` call adds (the rest go in further calls).
ENQUEUE_BATCH = 500
#: Most claims one ``ack`` call carries.
ACK_BATCH = 500
#: Most ids one ``retry`` or ``purge_dead`` call carries.
MORGUE_BATCH = 500


def time_arg(now_ms: int | None) -> int | str:
    """``now_ms`` for a script: ``''`` makes the script read the Redis server's clock."""
    return "" if now_ms is None else now_ms


def budget_arg(max_stalled: int | Unset | None) -> str | int:
    """A stall budget for a script: ``''`` unset, -1 never dead-letter."""
    if max_stalled is UNSET:
        return ""
    return -1 if max_stalled is None else max_stalled


def outcome_of(reply: Any, script: str) -> Outcome:
    """Read a script's code as an :class:`Outcome` (a code it cannot answer raises)."""
    try:
        return Outcome(int(reply))
    except (TypeError, ValueError) as exc:
        raise ScriptContractError(f"{script}.lua answered {reply!r}") from exc


def text(value: bytes | str) -> str:
    """A reply item as text."""
    return value.decode() if isinstance(value, bytes) else value


def enqueue_call(
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
        time_arg(now_ms),
        ttl_ms,
        budget_arg(max_stalled),
        group,
        "" if eta_ms is None else eta_ms,
        task_id,
    ]
    return keys, args


def enqueue_many_calls(
    k: QueueKeys, jobs: Sequence[NewJob], now_ms: int | None, ttl_ms: int
) -> list[tuple[list[str], list[Any], int]]:
    """The KEYS, ARGV and job count of each ``enqueue_many.lua`` call for ``jobs``."""
    keys = [k.pending, k.wake, k.seq, k.lanes, k.expires, k.base, k.delayed, k.etas]
    calls = []
    for start in range(0, len(jobs), ENQUEUE_BATCH):
        chunk = jobs[start : start + ENQUEUE_BATCH]
        args: list[Any] = [time_arg(now_ms), ttl_ms]
        for job in chunk:
            args += (
                job.id,
                job.payload,
                job.priority,
                budget_arg(job.max_stalled),
                job.group,
                "" if job.eta_ms is None else job.eta_ms,
                job.task_id,
            )
        calls.append((keys, args, len(chunk)))
    return calls


def enqueue_many_outcomes(reply: Any, expected: int) -> list[Outcome]:
    """Read what one ``enqueue_many.lua`` call answered: an outcome per job."""
    if len(reply) != expected:
        raise ScriptContractError(f"enqueue_many.lua answered {len(reply)} codes")
    return [outcome_of(code, "enqueue_many") for code in reply]


def start_call(
    k: QueueKeys, job_id: str, token: str, received: bool = False
) -> tuple[list[str], list[Any]]:
    """The KEYS and ARGV of one ``start.lua`` call (``received``: only that, not a start)."""
    return [k.job(job_id), k.metrics("fenced")], [token, "received" if received else "started"]


def ack_call(k: QueueKeys, chunk: Sequence[tuple[str, str]]) -> tuple[list[str], list[Any]]:
    """The KEYS and ARGV of one ``ack.lua`` call for up to :data:`ACK_BATCH` claims."""
    keys = [k.active, k.pending, k.wake, k.dead, k.metrics("completed"), k.base]
    return keys, [x for claim in chunk for x in claim]


def ack_outcomes(reply: Any, expected: int) -> list[Outcome]:
    """Read what one ``ack.lua`` call answered: an outcome per claim."""
    if len(reply) != expected:
        raise ScriptContractError(f"ack.lua answered {len(reply)} codes")
    return [outcome_of(code, "ack") for code in reply]


def promote_keys(k: QueueKeys) -> list[str]:
    """The KEYS of ``promote.lua``."""
    return [k.pending, k.wake, k.seq, k.lanes, k.delayed, k.etas, k.base]


def tally_keys(k: QueueKeys) -> list[str]:
    """The KEYS of ``tally.lua``."""
    return [k.pending, k.active, k.delayed, k.dead, k.lanes, k.base]


def read_tally(reply: Any) -> tuple[dict[str, int], list[tuple[str, int, int | None]]]:
    """Read what ``tally.lua`` answered (see :meth:`Scripts.tally`)."""
    if len(reply) < 5 or (len(reply) - 5) % 3:
        raise ScriptContractError(f"tally.lua answered {len(reply)} items")
    names = ("pending", "active", "delayed", "dead", "lanes")
    counts = {n: int(v) for n, v in zip(names, reply[:5], strict=True)}
    page = [
        (text(reply[i]), int(reply[i + 1]), int(reply[i + 2]) if reply[i + 2] else None)
        for i in range(5, len(reply), 3)
    ]
    return counts, page


def oldest_call(
    k: QueueKeys, lane_offset: int, lane_limit: int, active_offset: int, active_limit: int
) -> tuple[list[str], list[Any]]:
    """The KEYS and ARGV of one ``oldest.lua`` call."""
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
