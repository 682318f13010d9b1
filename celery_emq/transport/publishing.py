"""Publishing: a kombu message stored as a job, alone or in a publish batch.

A message becomes a job (:func:`~celery_emq.transport.messages.new_job`) and
is stored in one script call; a retried publish keeps its first attempt's job
id, so Redis stores it once. The queue is then recorded in the registry (or as
an expiring queue), so a sweep finds it.
"""

from __future__ import annotations

import logging
from typing import Any

import redis

from celery_emq import errors
from celery_emq.store.outcomes import NewJob, Outcome
from celery_emq.transport.batch import BATCH_ARGUMENT, PublishBatch, is_broker_full
from celery_emq.transport.errors import BrokerFullError, ReplicasUnconfirmedError
from celery_emq.transport.messages import new_job
from celery_emq.transport.store_channel import StoreChannel

__all__ = ["Publishing"]

logger = logging.getLogger(__name__)


class Publishing(StoreChannel):
    """The channel's publishing half: ``_put`` stores the job, batches buffer them."""

    @property
    def supports_batch_publish(self) -> bool:
        """Whether ``Producer.batch()`` may buffer this channel's publishes (see batch.py)."""
        return True

    def create_publish_batch(self, max_size: int) -> PublishBatch:
        """kombu 5.7's hook: a batch sending its publishes together (see batch.py)."""
        return PublishBatch(self, max_size)

    def _new_job(self, message: dict[str, Any]) -> tuple[NewJob, bool]:
        """Return the job a message becomes (its payload the JSON text), and if it is a task."""
        return new_job(message, self._get_message_priority(message, reverse=False))

    def _put(self, queue: str, message: dict[str, Any], **kwargs: Any) -> None:
        job, is_task = self._new_job(message)
        ttl_ms = self._queue_ttl.get(queue, 0)
        publish_batch = kwargs.get(BATCH_ARGUMENT)
        if isinstance(publish_batch, PublishBatch):
            task_id = (message.get("headers") or {}).get("id") if is_task else None
            publish_batch.enqueue(queue, job, ttl_ms, is_task, task_id)
            return
        job_id = job.id
        try:
            outcome = self.store.enqueue(
                queue,
                job_id,
                job.payload,
                job.priority,
                ttl_ms,
                max_stalled=job.max_stalled,
                group=job.group,
                eta_ms=job.eta_ms,
                task_id=job.task_id,
            )
        except redis.ResponseError as exc:
            if is_broker_full(exc):
                raise BrokerFullError(queue, str(exc)) from exc
            raise
        except errors.ReplicasUnconfirmedError as exc:
            raise ReplicasUnconfirmedError.of(exc) from exc
        if outcome is Outcome.DUPLICATE:
            logger.debug("celery_emq: job %s already in %s; publish ignored", job_id, queue)
        self.note_published(queue, job_id, ttl_ms, is_task)

    def note_published(self, queue: str, job_id: str, ttl_ms: int, is_task: bool) -> None:
        """Record a queue a job was stored in: in the registry, or as an expiring queue."""
        # The job is stored: the publish has succeeded. Recording the queue
        # (kept apart; on a cluster, on another master) is tried again on the
        # next publish or consume if it fails now, and must not make a stored
        # publish look failed (it would be sent again under a new job id).
        try:
            if ttl_ms:
                self._note_expiring(queue, ttl_ms)
            elif is_task:
                # A Celery task message: its queue holds work to recover and to
                # show. Replies (remote control, rpc:// results) carry no task.
                self._register(queue)
        except Exception as exc:
            logger.warning(
                "celery_emq: published job %s to %s, but could not record the queue "
                "in the registry (tried again on the next publish): %r",
                job_id,
                queue,
                exc,
            )
