"""Publish batches: kombu 5.7's ``Producer.batch()`` on ``emq://``.

Inside ``with producer.batch():`` kombu hands each publish to the channel's
:class:`PublishBatch` (``Channel.create_publish_batch``). The channel turns the
message into its job as a single publish would (the job id is fixed there, from
the message's ``emq_job_id`` or delivery tag) and the batch buffers it. A flush
(at ``max_size`` buffered jobs and at the end of the batch) sends one
``enqueue_many`` script call per queue (per :data:`~celery_emq.store.scripts.ENQUEUE_BATCH`
jobs), all in one pipeline, followed by one ``WAIT`` when ``wait_replicas`` is
set: on Redis Cluster one pipeline (and ``WAIT``) per master, each queue's call
to the master of its slot. Each job gets the row, message, lane, FIFO
sequence and wake marker a single publish gives it.

Why a flush may be sent again. kombu's stock Redis transport refuses batches
when its client retries (``retry_on_timeout`` and the like), because a
replayed pipeline of ``LPUSH`` stores every message twice. Here a replay is
harmless: each job's id is fixed before the job is buffered, and
``enqueue_many.lua`` stores a job only if no job with its id exists (it answers
DUPLICATE otherwise, changing nothing). So a pipeline that redis-py sends again
after a lost reply, or the messages of a failed flush the caller publishes
again with the job ids :class:`~celery_emq.errors.BatchFlushError` names,
stores no job twice while the first copy waits or runs. (Once that job ran and was acked its
id is free again, as for a single publish kombu retries.) Fanout messages
(remote control broadcasts) have no job id: they are sent at the flush in one
pipeline when the client does not retry, else one ``PUBLISH`` each, as a
publish outside a batch would be.

A failed flush. Whatever fails (building or sending the calls, a reply, too few
replicas, a fanout ``PUBLISH``), the flush raises :class:`BatchFlushError`,
kombu's ``BatchPublishError`` and no connection error, so kombu's publish retry
does not publish again into the failed batch. It names every message as a
:class:`~celery_emq.errors.BatchMessage`: queue, job id, Celery task id and
whether it was stored, not sent, or of unknown outcome. A failed store sends
no fanout message; a publish that a flush at ``max_size`` came before is named
not sent.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any, Protocol

import redis

from celery_emq.errors import NOT_STORED, STORED, UNKNOWN, BatchMessage
from celery_emq.store.jobstore import JobStore
from celery_emq.store.scripts import NewJob, Outcome
from celery_emq.transport.errors import BatchFlushError

__all__ = ["BATCH_ARGUMENT", "PublishBatch", "is_broker_full"]

#: The keyword argument kombu's producer batch hands ``basic_publish`` (and so
#: ``_put`` and ``_put_fanout``) to name the batch a publish goes into.
BATCH_ARGUMENT = "_publish_batch"


class BatchChannel(Protocol):
    """What a publish batch needs of its channel (the transport's ``Channel``)."""

    @property
    def store(self) -> JobStore: ...

    def basic_publish(self, message: Any, exchange: Any, routing_key: Any, **kwargs: Any) -> Any:
        """kombu's publish: routes the message, calling ``_put`` per queue."""

    def conn_or_acquire(self, client: Any = None) -> Any:
        """kombu's client (as a context manager), which fanout messages go through."""

    def note_published(self, queue: str, job_id: str, ttl_ms: int, is_task: bool) -> None:
        """Record a queue a job was stored in."""


def is_broker_full(exc: redis.ResponseError) -> bool:
    """Whether Redis refused a write for want of memory (``maxmemory``)."""
    # Redis 7 answers OOM; Redis 6.2 wraps it in a script error.
    return isinstance(exc, redis.exceptions.OutOfMemoryError) or "OOM command" in str(exc)


class PublishBatch:
    """Buffers a producer's publishes and sends them together (kombu's batch contract).

    ``publish`` buffers, ``flush`` sends (raising :class:`BatchFlushError`, a
    kombu ``BatchPublishError``, when it fails: a failed batch takes no more
    publishes), ``discard`` drops what is buffered, ``close`` ends the batch.
    """

    def __init__(self, channel: BatchChannel, max_size: int) -> None:
        self.channel = channel
        self.max_size = max_size
        #: Jobs per queue, in publish order; and each queue's x-expires TTL.
        self._jobs: dict[str, list[NewJob]] = {}
        self._ttl_ms: dict[str, int] = {}
        #: Queues that got a Celery task message (recorded in the registry).
        self._task_queues: set[str] = set()
        #: The Celery task id of each buffered job that is a task, by job id.
        self._task_ids: dict[str, str] = {}
        #: Fanout messages: (channel name, payload, Celery task id or None).
        self._fanout: list[tuple[str, Any, str | None]] = []
        self._buffered = 0
        #: What the publish being routed adds (a message may go to several
        #: queues), each with the message it is, as a failed flush names it.
        self._collecting: list[tuple[Callable[[], None], BatchMessage]] | None = None
        self._failed: BaseException | None = None
        self._aborted = False
        self._closed = False

    def __len__(self) -> int:
        """How many jobs and fanout messages wait for the next flush."""
        return self._buffered

    def publish(self, message: Any, **kwargs: Any) -> Any:
        """Route one prepared message and buffer what it stores; flush at ``max_size``."""
        self._check_usable()
        adds: list[tuple[Callable[[], None], BatchMessage]] = []
        self._collecting = adds
        try:
            kwargs[BATCH_ARGUMENT] = self
            result = self.channel.basic_publish(message, **kwargs)
        finally:
            self._collecting = None
        if adds:
            if self._buffered and self._buffered + len(adds) > self.max_size:
                # If this flush fails, the message being published was not sent.
                self._flush([described for _, described in adds])
            for add, _ in adds:
                add()
            self._buffered += len(adds)
            if self._buffered >= self.max_size:
                self.flush()
        return result

    def enqueue(
        self, queue: str, job: NewJob, ttl_ms: int, is_task: bool, task_id: str | None = None
    ) -> None:
        """Buffer one job (the channel's ``_put`` inside a batch); ``task_id``: its Celery task."""

        def add() -> None:
            self._jobs.setdefault(queue, []).append(job)
            self._ttl_ms[queue] = ttl_ms
            if is_task:
                self._task_queues.add(queue)
            if task_id:
                self._task_ids[job.id] = task_id

        self._route(add, BatchMessage(queue, job.id, task_id or None, NOT_STORED))

    def add(self, name: str, *args: Any) -> None:
        """Buffer one Redis command kombu's fanout routing asks for (``publish``)."""
        if name != "publish" or len(args) != 2:
            raise RuntimeError(f"a publish batch cannot buffer {name!r}")
        topic, payload = args
        task_id = _task_id(payload)
        self._route(
            lambda: self._fanout.append((topic, payload, task_id)),
            BatchMessage(topic, None, task_id, NOT_STORED),
        )

    def _route(self, add: Callable[[], None], described: BatchMessage) -> None:
        if self._collecting is None:
            raise RuntimeError("a publish batch takes messages only through publish()")
        self._collecting.append((add, described))

    def flush(self) -> None:
        """Send every buffered job and fanout message.

        Raises:
            BatchFlushError: a call failed, or too few replicas confirmed (with
                ``wait_replicas``): what became of each message (stored, not
                sent, or of unknown outcome), by job id and Celery task id.
        """
        self._flush([])

    def _flush(self, after: list[BatchMessage]) -> None:
        """Flush; a failure also names ``after`` (a publish waiting for it) as not sent."""
        self._check_usable()
        if not self._buffered:
            return
        jobs, ttl_ms, fanout = self._jobs, self._ttl_ms, self._fanout
        task_queues, task_ids = self._task_queues, self._task_ids
        self._reset()
        try:
            sent = _Sent()
            if jobs:
                self._store(jobs, ttl_ms, task_queues, sent)
            # After a failed store nothing more is sent: the batch is failed.
            fanout_outcomes = [NOT_STORED] * len(fanout)
            if fanout and sent.reason is None:
                fanout_outcomes = self._send_fanout(fanout, sent)
            if sent.reason is None:
                return
            messages = [
                BatchMessage(queue, job.id, task_ids.get(job.id), outcome)
                for queue, js in jobs.items()
                for job, outcome in zip(js, sent.outcomes[queue], strict=True)
            ]
            messages += [
                BatchMessage(topic, None, task_id, outcome)
                for (topic, _, task_id), outcome in zip(fanout, fanout_outcomes, strict=True)
            ]
            messages += after
            raise BatchFlushError(
                sent.reason, sent.stored, sent.duplicate, sent.unknown, sent.confirmed, messages
            ) from sent.cause
        except BaseException as exc:
            self._failed = exc
            raise

    def _store(
        self,
        jobs: dict[str, list[NewJob]],
        ttl_ms: dict[str, int],
        task_queues: set[str],
        sent: _Sent,
    ) -> None:
        store = self.channel.store
        try:
            batch = store.scripts.batch()
            handles = {
                q: store.queue_enqueue_many(batch, q, js, ttl_ms[q]) for q, js in jobs.items()
            }
        except Exception as exc:
            # Nothing was sent.
            sent.fail(exc)
            sent.outcomes = {q: [NOT_STORED] * len(js) for q, js in jobs.items()}
            return
        confirm = store.confirm_replicas if store.wait_replicas else None
        try:
            batch.execute(confirm=confirm)
        except Exception as exc:
            # The round trip failed: each call may or may not have run.
            sent.fail(exc)
            sent.unknown = [(q, job.id) for q, js in jobs.items() for job in js]
            sent.outcomes = {q: [UNKNOWN] * len(js) for q, js in jobs.items()}
            return
        for queue, handle in handles.items():
            try:
                outcomes = batch.result(handle)
            except Exception as exc:
                sent.fail(exc)
                sent.unknown += [(queue, job.id) for job in jobs[queue]]
                sent.outcomes[queue] = [UNKNOWN] * len(jobs[queue])
                continue
            for job, outcome in zip(jobs[queue], outcomes, strict=True):
                listed = sent.duplicate if outcome is Outcome.DUPLICATE else sent.stored
                listed.append((queue, job.id))
            sent.outcomes[queue] = [STORED] * len(jobs[queue])
            # Every job is in the queue (stored now or before: a replayed
            # flush is all DUPLICATE): record the queue, as a single publish does.
            self.channel.note_published(
                queue, jobs[queue][-1].id, ttl_ms[queue], queue in task_queues
            )
        if sent.reason is None and confirm is not None:
            if (batch.confirmed or 0) < store.wait_replicas:
                sent.reason = (
                    f"{batch.confirmed or 0} of {store.wait_replicas} replica(s) confirmed "
                    f"within {store.wait_timeout_ms} ms (wait_replicas); the jobs are on the master"
                )
                sent.confirmed = batch.confirmed or 0

    def _send_fanout(self, fanout: list[tuple[str, Any, str | None]], sent: _Sent) -> list[str]:
        """Publish the fanout messages; return each one's outcome (a failure noted in ``sent``)."""
        outcomes = [NOT_STORED] * len(fanout)
        try:
            with self.channel.conn_or_acquire() as client:
                if _retries(client):
                    for i, (topic, payload, _) in enumerate(fanout):
                        outcomes[i] = UNKNOWN
                        client.publish(topic, payload)
                        outcomes[i] = STORED
                    return outcomes
                outcomes = [UNKNOWN] * len(fanout)
                with client.pipeline(transaction=False) as pipe:
                    for topic, payload, _ in fanout:
                        pipe.publish(topic, payload)
                    pipe.execute()
                return [STORED] * len(fanout)
        except Exception as exc:
            sent.fail(exc)
            return outcomes

    def discard(self) -> None:
        """Drop what is buffered (the batch's block raised)."""
        self._aborted = True
        self._reset()

    def close(self) -> None:
        """End the batch (nothing is held between flushes)."""
        self._closed = True
        self._reset()

    def _reset(self) -> None:
        self._jobs, self._ttl_ms, self._task_queues, self._fanout = {}, {}, set(), []
        self._task_ids = {}
        self._buffered = 0

    def _check_usable(self) -> None:
        if self._closed:
            raise RuntimeError("the publish batch is closed")
        if self._aborted:
            raise RuntimeError("the publish batch is aborted")
        if self._failed is not None:
            raise BatchFlushError(
                "a previous flush of this batch failed", [], [], []
            ) from self._failed


class _Sent:
    """What one flush found: each job's outcome, and its first failure."""

    def __init__(self) -> None:
        self.stored: list[tuple[str, str]] = []
        self.duplicate: list[tuple[str, str]] = []
        self.unknown: list[tuple[str, str]] = []
        #: Each queue's jobs' outcomes, in the order of its jobs.
        self.outcomes: dict[str, list[str]] = {}
        self.reason: str | None = None
        self.cause: BaseException | None = None
        self.confirmed: int | None = None

    def fail(self, exc: BaseException) -> None:
        if self.reason is None:
            self.reason, self.cause = _reason(exc), exc


def _task_id(payload: Any) -> str | None:
    """The Celery task id of a fanout message's payload (kombu's JSON text), if a task's."""
    try:
        headers = json.loads(payload).get("headers") or {}
    except Exception:
        return None
    task_id = headers.get("id") if "task" in headers else None
    return task_id if isinstance(task_id, str) else None


def _reason(exc: BaseException) -> str:
    if isinstance(exc, redis.ResponseError) and is_broker_full(exc):
        return f"Redis is full (maxmemory): {exc}"
    return f"{type(exc).__name__}: {exc}"


def _retries(client: Any) -> bool:
    """Whether ``client`` may send a command again after a lost reply."""
    kwargs = getattr(getattr(client, "connection_pool", None), "connection_kwargs", {})
    return bool(
        kwargs.get("retry_on_timeout")
        or kwargs.get("retry_on_error")
        or kwargs.get("retry") is not None
    )
