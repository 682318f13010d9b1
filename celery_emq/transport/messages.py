"""A kombu message as a job, and back: the headers, ids, ETA and budgets the channel reads.

Publishing turns a message into a :class:`~celery_emq.store.scripts.NewJob`
(:func:`new_job`); consuming turns a claimed job back into a message, marking
a redelivery (:func:`mark_delivery`) and refusing content the consumer does
not accept (:func:`refused_content`).
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Callable
from datetime import datetime
from typing import Any

from kombu.serialization import TRUSTED_CONTENT
from kombu.utils import json as kombu_json

from celery_emq.store.outcomes import UNSET, Claimed, NewJob, Unset

__all__ = [
    "BUDGET_OPTION",
    "CONTENT_DISALLOWED",
    "DELAY_MIN_MS",
    "DELIVERIES_HEADER",
    "GROUP_HEADER",
    "JOB_ID_PROPERTY",
    "KEYED",
    "STALLED_HEADER",
    "budget",
    "eta_ms",
    "mark_delivery",
    "new_job",
    "queue_ttl_ms",
    "refused_content",
]

logger = logging.getLogger(__name__)

#: kombu's JSON encoding, as kombu's own Redis channel stores messages: the
#: same text ``kombu.utils.json.dumps`` gives, from one encoder made once
#: (``dumps`` makes one per call, a third of its time on a task message).
#: Encoding keeps no state between calls, so threads may share it.
dumps: Callable[[Any], str] = kombu_json.JSONEncoder().encode

#: Header a redelivered message carries: how many times the job stalled.
STALLED_HEADER = "emq_stalled"
#: Header a redelivered message carries: how many times the job was claimed.
DELIVERIES_HEADER = "emq_deliveries"
#: Header (at publish) or task attribute giving a job its own stall budget.
BUDGET_OPTION = "emq_max_stalled"
#: Header (at publish) naming the fair-lane group a job waits in.
GROUP_HEADER = "emq_group"
#: The reason a message whose content type the consumer refuses is dead-lettered with.
CONTENT_DISALLOWED = "content_disallowed"
#: Message property holding the job id chosen by the first attempt to publish it.
JOB_ID_PROPERTY = "emq_job_id"
#: Message properties the job's key already holds (not stored in the message).
KEYED = ("delivery_tag", JOB_ID_PROPERTY)
#: A task whose ETA is at least this far ahead waits in the broker's delayed set;
#: a nearer one is claimed at once and waits in the worker (Celery's timer).
DELAY_MIN_MS = 1000


def new_job(message: dict[str, Any], priority: int) -> tuple[NewJob, bool]:
    """Return the job a message becomes (its payload the JSON text), and if it is a task.

    Sets the message's delivery tag (and the job id property) to the job id.
    """
    props = message["properties"]
    # kombu gives every publish attempt a new delivery tag, but a retry
    # (after a connection error, when Redis may have run the first attempt)
    # hands the same properties again: the job id of the first attempt
    # stays, and the retry is a DUPLICATE, not a second job.
    job_id = props.get(JOB_ID_PROPERTY) or props.get("delivery_tag") or uuid.uuid4().hex
    props[JOB_ID_PROPERTY] = job_id
    props["delivery_tag"] = job_id
    headers = message.get("headers") or {}
    job_budget: int | Unset | None = UNSET
    if BUDGET_OPTION in headers:
        job_budget = budget(headers[BUDGET_OPTION])
    group = headers.get(GROUP_HEADER) or ""
    if not isinstance(group, str):
        group = str(group)
    due_ms = eta_ms(headers.get("eta")) if "task" in headers else None
    task_id = headers.get("id") if due_ms is not None else None
    # The delivery tag and job id are the key's: not stored twice.
    stored = {**message, "properties": {k: v for k, v in props.items() if k not in KEYED}}
    if copied_counts(headers):
        stored["headers"] = {
            k: v for k, v in headers.items() if k not in (STALLED_HEADER, DELIVERIES_HEADER)
        }
    job = NewJob(
        job_id,
        dumps(stored).encode(),
        priority,
        job_budget,
        group,
        due_ms,
        task_id if isinstance(task_id, str) else "",
    )
    return job, "task" in headers


def copied_counts(headers: dict[str, Any]) -> bool:
    """Whether a message is a Celery retry carrying the counts of the delivery that retried.

    Celery's retry copies a request's custom headers into the new message: the
    ``emq_stalled``/``emq_deliveries`` a redelivery added say nothing of the new
    job. Any other message keeps headers of those names as its publisher gave them.
    """
    if "task" not in headers or not (STALLED_HEADER in headers or DELIVERIES_HEADER in headers):
        return False
    retries = headers.get("retries")
    return isinstance(retries, int) and not isinstance(retries, bool) and retries > 0


def mark_delivery(payload: dict[str, Any], job: Claimed, tag: str) -> None:
    """Make a claimed job's decoded message the delivery ``tag`` kombu will hand on."""
    props = payload["properties"]
    headers = payload["headers"]
    props["delivery_tag"] = tag
    # Only publish attempts share it: a message published again from what a
    # consumer received is a new job.
    props.pop(JOB_ID_PROPERTY, None)
    if job.deliveries > 1 or job.stalled:
        # Only the documented emq_* headers are added (kombu's contract: the
        # headers are what was published); kombu's own flag is delivery_info's.
        headers[STALLED_HEADER] = job.stalled
        headers[DELIVERIES_HEADER] = job.deliveries
        props.setdefault("delivery_info", {})["redelivered"] = True
    # A first delivery keeps the headers as published, a publisher's own
    # emq_stalled/emq_deliveries included (a Celery retry's copies were dropped
    # when it was published: copied_counts).


def eta_ms(eta: Any) -> int | None:
    """Return the epoch ms of a task's ETA header if it is far enough ahead, else None.

    Celery writes the ETA (``eta=`` or ``countdown=``) as an ISO 8601 time with
    its UTC offset; one without an offset is left to Celery.
    """
    if not isinstance(eta, str) or not eta:
        return None
    try:
        when = datetime.fromisoformat(eta)
    except ValueError:
        return None
    if when.tzinfo is None:
        return None
    ms = int(when.timestamp() * 1000)
    return ms if ms - time.time() * 1000 >= DELAY_MIN_MS else None


def budget(value: Any) -> int | Unset | None:
    """Read a stall budget given in a header or on a task: an int >= 0, or None for never."""
    if value is None:
        return None
    if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
        return value
    logger.warning(
        "celery_emq: ignoring %s=%r (expected an int >= 0 or None)", BUDGET_OPTION, value
    )
    return UNSET


def queue_ttl_ms(kwargs: dict[str, Any]) -> int:
    """Return a queue's ``x-expires`` (ms) from its declare arguments, or 0."""
    try:
        value = int(kwargs["arguments"]["x-expires"])
    except (KeyError, TypeError, ValueError):
        return 0
    return max(value, 0)


def refused_content(content_type: Any, accept: Any) -> str:
    """Return why a consumer refuses a body of ``content_type``, or '' if it takes it."""
    if accept is None or not content_type or content_type in TRUSTED_CONTENT:
        return ""
    if content_type in accept:
        return ""
    return (
        f"ContentDisallowed: the consumer does not accept content of type {content_type} "
        f"(accept_content: {', '.join(sorted(accept))}); the body was not decoded"
    )
