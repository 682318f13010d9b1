"""What a job is, for people: the task inside a stored kombu message."""

from __future__ import annotations

import base64
import json
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

from kombu import serialization

#: kombu's (untyped) deserializer, honouring the message's content type.
deserialize: Callable[..., Any] = serialization.loads

__all__ = ["JobInfo", "describe"]


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
    payload: bytes | str, queue: str, job_id: str, stalled: int = 0, reason: str = ""
) -> JobInfo:
    """Decode a stored message far enough to name its task, id and arguments.

    Never raises: what cannot be decoded is reported in ``decode_error``.
    """
    try:
        message = json.loads(payload)
        headers = message.get("headers") or {}
        props = message.get("properties") or {}
        body = message.get("body")
        if props.get("body_encoding") == "base64" and body is not None:
            body = base64.b64decode(body)
        decoded = deserialize(
            body,
            message.get("content-type"),
            message.get("content-encoding") or "utf-8",
            accept={
                "application/json",
                "application/x-python-serialize",
                "application/x-yaml",
                "application/x-msgpack",
            },
        )
    except Exception as exc:
        return JobInfo(
            job_id,
            queue,
            stalled=stalled,
            reason=reason,
            decode_error=f"{type(exc).__name__}: {exc}",
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
