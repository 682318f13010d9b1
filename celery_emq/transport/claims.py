"""What a claim is, and how it is named: its delivery tag and its owner.

A claim is a job id and its fencing token, the claim id (the job's delivery
count at the claim and a random nonce, ``<deliveries>.<nonce>``: the count can
repeat after the server loses its last writes, the nonce cannot). The delivery
tag kombu and Celery see is :func:`delivery_tag` of the two, so two claims of
one job (the same job claimed again after its lease was lost) are two
deliveries, and a settle always names the claim it belongs to. The tag is also
the claim's one carrier: kombu puts it in the message's ``properties``, which
Celery hands to a pool process as ``task.request.properties``.

Every claim of a process is made under its :func:`worker_identity`.
"""

from __future__ import annotations

import os
import re
import socket
import uuid
from typing import TYPE_CHECKING, NamedTuple

from celery_emq.transport.process import host

if TYPE_CHECKING:
    from celery_emq.store.jobstore import JobStore

__all__ = ["TAG_SEP", "Claim", "delivery_tag", "owner_node", "parse_tag", "worker_identity"]

_identity: str | None = None

#: Separates the job id from the claim's token in a delivery tag.
TAG_SEP = "#"


#: A claim's token: ``<deliveries>.<nonce>`` (a bare count: a claim made by an
#: earlier version, which kept no claim id).
_TOKEN = re.compile(r"[0-9]+(?:\.[0-9a-f]+)?")


def delivery_tag(job_id: str, token: str) -> str:
    """Return the delivery tag of one claim: ``<job id>#<token>``."""
    return f"{job_id}{TAG_SEP}{token}"


def parse_tag(tag: str) -> tuple[str, str] | None:
    """Return ``(job id, token)`` of a claim's delivery tag, or ``None``."""
    job_id, sep, token = tag.rpartition(TAG_SEP)
    if not sep or not _TOKEN.fullmatch(token):
        return None
    return job_id, token


class Claim(NamedTuple):
    """One claim a process holds: where the job lives and its fencing token."""

    store: JobStore
    queue: str
    job_id: str
    token: str


def worker_identity() -> str:
    """Return this process's stable lease owner: node, pid and a random part.

    The node is the Celery worker's node name (``celery@host``) once its
    consumer started, else the host name. A sweep elsewhere reads it back from
    a dead job's history to report the failure from the worker that held it
    (:func:`owner_node`).
    """
    global _identity
    if _identity is None:
        node = host().nodename() or socket.gethostname()
        _identity = f"{node}:{os.getpid()}:{uuid.uuid4().hex[:12]}"
    return _identity


def owner_node(owner: str) -> str | None:
    """The Celery node name in a lease owner, if the owner was a started worker."""
    node = owner.rsplit(":", 2)[0] if owner.count(":") >= 2 else ""
    return node if "@" in node else None


def _forget_identity_in_child() -> None:
    # A forked child is another owner: it makes an identity of its own.
    global _identity
    _identity = None


os.register_at_fork(after_in_child=_forget_identity_in_child)
