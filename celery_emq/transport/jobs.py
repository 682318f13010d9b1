"""What a job is, for people: the task inside a stored kombu message."""

from __future__ import annotations

import base64
import json
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

from kombu import serialization

from celery_emq.store.codec import unpack

#: kombu's (untyped) deserializer, honouring the message's content type.
deserialize: Callable[..., Any] = serialization.loads
#: kombu's (untyped) reading of an ``accept_content`` setting into MIME types.
prepare_accept: Callable[..., Any] = serialization.prepare_accept_content

__all__ = ["DEFAULT_ACCEPT", "NEVER_STARTED", "JobInfo", "accepted_content", "describe"]

#: What is decoded when no app says otherwise: JSON only, never pickle or YAML.
DEFAULT_ACCEPT: frozenset[str] = frozenset({"application/json"})
#: The reason of a job dead-lettered because it lapsed again and again before its
#: task started: its body may kill whatever decodes it, so it is never decoded.
NEVER_STARTED = "never_started"


def accepted_content(app: Any) -> frozenset[str]:
    """Return the content types ``app`` accepts (its ``accept_content``), as MIME types.

    Without an app, or when its setting cannot be read, only JSON.
    """
    if app is None:
        return DEFAULT_ACCEPT
    try:
        names = app.conf.accept_content
        types = prepare_accept(names) if names else None
    except Exception:
        return DEFAULT_ACCEPT
    return frozenset(types) if types else DEFAULT_ACCEPT


@dataclass(frozen=True)
class JobInfo:
    """A job as signals, the CLI and the morgue API show it."""

    id: str
    queue: str
    task_name: str | None = None
    task_id: str | None = None
    args: Any = None
    kwargs: Any = None
    group: str | None = None
    stalled: int = 0
    reason: str = ""
    headers: dict[str, Any] = field(default_factory=dict)
    decode_error: str | None = None

    def as_dict(self) -> dict[str, Any]:
        """Return the fields as a JSON-friendly dict (the raw headers left out)."""
        data = asdict(self)
        del data["headers"]
        return data


def describe(
    payload: bytes | str,
    queue: str,
    job_id: str,
    stalled: int = 0,
    reason: str = "",
    accept: frozenset[str] = DEFAULT_ACCEPT,
) -> JobInfo:
    """Decode a stored message far enough to name its task, id and arguments.

    ``payload`` is the message's JSON text or its stored form (:mod:`celery_emq.store.codec`).

    Only a body whose content type is in ``accept`` (MIME types, see
    :func:`accepted_content`) is decoded; the task's name and id still come
    from the message's JSON headers. The body of a job dead-lettered as
    ``never_started`` is never decoded (it may kill its decoder): its content
    type and size are reported instead. Never raises: what cannot or may not be
    decoded is reported in ``decode_error``.
    """
    try:
        message = json.loads(unpack(payload))
        if not isinstance(message, dict):
            raise TypeError("the message is not a JSON object")
    except Exception as exc:
        return JobInfo(
            job_id,
            queue,
            stalled=stalled,
            reason=reason,
            decode_error=f"{type(exc).__name__}: {exc}",
        )
    headers = message.get("headers")
    if not isinstance(headers, dict):
        headers = {}
    try:
        props = message.get("properties") or {}
        body = message.get("body")
        if props.get("body_encoding") == "base64" and body is not None:
            body = base64.b64decode(body)
        if reason == NEVER_STARTED:
            raise _Undecoded(message.get("content-type"), body)
        decoded = deserialize(
            body,
            message.get("content-type"),
            message.get("content-encoding") or "utf-8",
            accept=accept,
        )
    except Exception as exc:
        return JobInfo(
            job_id,
            queue,
            task_name=_text_or_none(headers.get("task")),
            task_id=_text_or_none(headers.get("id")),
            group=_text_or_none(headers.get("emq_group")),
            stalled=stalled,
            reason=reason,
            headers=headers,
            decode_error=str(exc)
            if isinstance(exc, _Undecoded)
            else f"{type(exc).__name__}: {exc}",
        )
    args: Any = None
    kwargs: Any = None
    if "task" in headers:  # Celery message protocol 2
        if isinstance(decoded, list | tuple) and len(decoded) >= 2:
            args, kwargs = decoded[0], decoded[1]
        task_name, task_id = headers.get("task"), headers.get("id")
    elif isinstance(decoded, dict):  # protocol 1
        task_name, task_id = decoded.get("task"), decoded.get("id")
        args, kwargs = decoded.get("args"), decoded.get("kwargs")
    else:
        task_name = task_id = None
    return JobInfo(
        id=job_id,
        queue=queue,
        task_name=task_name,
        task_id=task_id,
        args=args,
        kwargs=kwargs,
        group=headers.get("emq_group"),
        stalled=stalled,
        reason=reason,
        headers=headers,
    )


class _Undecoded(Exception):
    """A body left undecoded on purpose, described by its content type and size."""

    def __init__(self, content_type: Any, body: Any) -> None:
        size = len(body.encode() if isinstance(body, str) else body or b"")
        super().__init__(
            f"{content_type or 'no content type'}, {size} bytes, not decoded: "
            "the job never started, and decoding it may kill the process"
        )


def _text_or_none(value: Any) -> str | None:
    return value if isinstance(value, str) else None
