"""The kombu channel: thin glue from kombu's Channel API to the job store.

Everything kombu's Redis transport does besides task queues is inherited:
connection handling, TLS/auth, PUB/SUB fanout (remote control, events), the
binding tables and the event-loop integration. Task-queue storage, consuming,
ack/reject/restore and recovery go through :class:`~celery_emq.store.JobStore`.
"""

from __future__ import annotations

import logging
import socket
import sys
import time
import uuid
from datetime import datetime
from queue import Empty
from time import monotonic
from typing import Any

import redis
from kombu.serialization import TRUSTED_CONTENT
from kombu.transport import redis as kombu_redis
from kombu.utils.encoding import bytes_to_str
from kombu.utils.json import dumps, loads

from celery_emq import errors
from celery_emq.options import EmqOptions
from celery_emq.store.codec import unpack
from celery_emq.store.jobstore import JobStore
from celery_emq.store.retries import connection_retry
from celery_emq.store.scripts import UNSET, Claimed, NewJob, Outcome, Unset
from celery_emq.store.server import check_server
from celery_emq.transport.batch import BATCH_ARGUMENT, PublishBatch, is_broker_full
from celery_emq.transport.compat import ChannelCompat
from celery_emq.transport.errors import BrokerFullError, ReplicasUnconfirmedError
from celery_emq.transport.lease import keeper
from celery_emq.transport.process import transport_started
from celery_emq.transport.qos import QoS
from celery_emq.transport.settle import batcher
from celery_emq.transport.sweep_thread import sweep_thread
from celery_emq.transport.sweeper import Sweeper

__all__ = ["Channel"]

logger = logging.getLogger(__name__)

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
#: How often a channel records again that a queue it publishes to or consumes is a
#: task queue (the registry may have dropped it while it was empty).
REGISTER_EVERY_S = 60.0
#: TCP keepalive on every connection: a peer that vanished without closing the
#: connection is noticed after about 10 + 3 x 5 s of silence, not hours.
KEEPALIVE_OPTIONS: dict[int, int] = {
    opt: value
    for name, value in (("TCP_KEEPIDLE", 10), ("TCP_KEEPINTVL", 5), ("TCP_KEEPCNT", 3))
    if (opt := getattr(socket, name, None)) is not None
}


class Channel(ChannelCompat, kombu_redis.Channel):
    """A kombu Redis channel whose task queues live in the leased job store."""

    QoS = QoS
    connection_class: Any
    _in_poll: Any = False
    _brpop_sent_at: Any = None

    # No connection waits for ever on a dead link (kombu's defaults are None):
    # each is overridden by the transport option of the same name.
    socket_connect_timeout: Any = 5.0
    socket_timeout: Any = 10.0
    socket_keepalive: Any = True
    socket_keepalive_options: Any = KEEPALIVE_OPTIONS

    def __init__(self, connection: Any, *args: Any, **kwargs: Any) -> None:
        topts = connection.client.transport_options
        # Validate before connecting, so a bad option fails fast and by name.
        self.emq = EmqOptions.from_transport_options(topts)
        # The target, not the scheme: after a switch to the next alternate of
        # an emqs+sentinel:// URL, kombu names the transport "emqs+sentinel".
        # kombu applies ssl only when it is a dict of options: ssl=True (Celery's
        # broker_use_ssl=True) would leave its connections in plaintext, while
        # the cluster's and Flower's clients take it for TLS.
        if connection.target.tls or connection.client.ssl:
            self.connection_class = self.connection_class_ssl
        self._no_ack: dict[str, bool] = {}
        self._accept: dict[str, Any] = {}
        self._queue_ttl: dict[str, int] = {}
        self._wake_queues: dict[str, str] = {}
        self._store: JobStore | None = None
        self._store_pool: Any = None
        self._sweeper: Sweeper | None = None
        self._registered_at: dict[str, float] = {}
        self._noted_expiring_at: dict[str, float] = {}
        self._budgets: dict[str, int | Unset | None] = {}
        self._scanned_at = monotonic()
        super().__init__(connection, *args, **kwargs)
        # Inside a Celery worker, before it binds its message handlers: see
        # what its handling of lost processes and refused messages decides.
        transport_started()

    # -- the store -------------------------------------------------------

    @property
    def store(self) -> JobStore:
        """The job store, on a connection pool of its own.

        The pool is the channel's own so that the store keeps working for
        deliveries still running after kombu reset its pools (reconnect).
        """
        if self._store is None:
            self._store = JobStore(
                self._new_store_client(),
                self.emq.key_prefix,
                self.emq.lease_ms,
                self.emq.wait_replicas,
                self.emq.wait_timeout_ms,
            )
        return self._store

    def _connparams(self, asynchronous: bool = False) -> dict[str, Any]:
        """kombu's connection parameters, with the retry policy of ``command_retries``."""
        params = super()._connparams(asynchronous)
        params.update(connection_retry(self.emq.command_retries))
        return params

    def _new_store_client(self) -> Any:
        """A redis-py client for the store, on a pool of the channel's own."""
        params = self._connparams()
        params["socket_timeout"] = self.store_timeout_s
        self._store_pool = redis.ConnectionPool(**params)
        return redis.Redis(connection_pool=self._store_pool)

    @property
    def store_timeout_s(self) -> float:
        """The store's socket timeout: one renewal interval, from 1 to 5 s.

        A renewal stuck on a dead connection must fail in time for the keeper
        to retry on a fresh one before the lease lapses. With ``wait_replicas``
        it is at least ``wait_timeout_ms`` + 0.5 s, so a ``WAIT`` can run out.
        """
        bound = max(1.0, min(5.0, self.emq.renew_interval_ms / 1000))
        timeout = min(float(self.socket_timeout), bound) if self.socket_timeout else bound
        if self.emq.wait_replicas:
            # A publish or settle may block in WAIT for wait_timeout_ms: its
            # reply must not be cut off (it would read as a failed write).
            timeout = max(timeout, self.emq.wait_timeout_ms / 1000 + 0.5)
        return timeout

    @property
    def sweeper(self) -> Sweeper:
        """The sweeper over this channel's store (signals, results, events)."""
        if self._sweeper is None:
            self._sweeper = Sweeper(self.store, self.emq)
        return self._sweeper

    def _register(self, queue: str) -> None:
        """Record a task queue in the registry, again at most every REGISTER_EVERY_S."""
        now = monotonic()
        if now - self._registered_at.get(queue, -REGISTER_EVERY_S) >= REGISTER_EVERY_S:
            self.store.register(queue)
            self._registered_at[queue] = now

    def _note_expiring(self, queue: str, ttl_ms: int) -> None:
        """Keep an ``x-expires`` queue in the expiry registry, again every half TTL.

        The expiry pass drops a queue only once it went unused for a whole TTL,
        so a channel that noted it less than half a TTL ago need not again.
        """
        now = monotonic()
        if now - self._noted_expiring_at.get(queue, float("-inf")) >= ttl_ms / 2000:
            self.store.note_expiring(queue)
            self._noted_expiring_at[queue] = now

    def _check_server(self) -> None:
        """Warn once per process and server of settings that can lose jobs."""
        conninfo = self.connection.client
        where = (conninfo.hostname, conninfo.port, conninfo.virtual_host)
        if where in _checked_servers:
            return
        _checked_servers.add(where)
        try:
            check = check_server(self.store.client)
        except Exception as exc:
            logger.info("celery_emq: could not read the Redis server's settings: %r", exc)
            return
        for text in check.warnings:
            logger.warning("celery_emq: %s", text)
        for text in check.notes:
            logger.info("celery_emq: %s", text)

    @property
    def owner(self) -> str:
        return keeper().owner

    # -- declaring -------------------------------------------------------

    def _new_queue(self, queue: str, auto_delete: bool = False, **kwargs: Any) -> None:
        super()._new_queue(queue, auto_delete=auto_delete, **kwargs)
        ttl_ms = _queue_ttl_ms(kwargs)
        if ttl_ms:
            self._queue_ttl[queue] = ttl_ms
            self.store.declare_expiring(queue, ttl_ms)
        else:
            self._queue_ttl.pop(queue, None)

    # -- publishing ------------------------------------------------------

    @property
    def supports_batch_publish(self) -> bool:
        """Whether ``Producer.batch()`` may buffer this channel's publishes (see batch.py)."""
        return True

    def create_publish_batch(self, max_size: int) -> PublishBatch:
        """kombu 5.7's hook: a batch sending its publishes together (see batch.py)."""
        return PublishBatch(self, max_size)

    def _new_job(self, message: dict[str, Any]) -> tuple[NewJob, bool]:
        """Return the job a message becomes (its payload the JSON text), and if it is a task."""
        props = message["properties"]
        # kombu gives every publish attempt a new delivery tag, but a retry
        # (after a connection error, when Redis may have run the first attempt)
        # hands the same properties again: the job id of the first attempt
        # stays, and the retry is a DUPLICATE, not a second job.
        job_id = props.get(JOB_ID_PROPERTY) or props.get("delivery_tag") or uuid.uuid4().hex
        props[JOB_ID_PROPERTY] = job_id
        props["delivery_tag"] = job_id
        headers = message.get("headers") or {}
        budget: int | Unset | None = UNSET
        if BUDGET_OPTION in headers:
            budget = _budget(headers[BUDGET_OPTION])
        group = headers.get(GROUP_HEADER) or ""
        if not isinstance(group, str):
            group = str(group)
        eta_ms = _eta_ms(headers.get("eta")) if "task" in headers else None
        task_id = headers.get("id") if eta_ms is not None else None
        # The delivery tag and job id are the key's: not stored twice.
        stored = {**message, "properties": {k: v for k, v in props.items() if k not in _KEYED}}
        job = NewJob(
            job_id,
            dumps(stored).encode(),
            self._get_message_priority(message, reverse=False),
            budget,
            group,
            eta_ms,
            task_id if isinstance(task_id, str) else "",
        )
        return job, "task" in headers

    def _put(self, queue: str, message: dict[str, Any], **kwargs: Any) -> None:
        job, is_task = self._new_job(message)
        ttl_ms = self._queue_ttl.get(queue, 0)
        publish_batch = kwargs.get(BATCH_ARGUMENT)
        if isinstance(publish_batch, PublishBatch):
            publish_batch.enqueue(queue, job, ttl_ms, is_task)
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

    # -- consuming -------------------------------------------------------

    def basic_consume(
        self, queue: str, no_ack: bool, callback: Any, consumer_tag: str, **kwargs: Any
    ) -> Any:
        self._no_ack[queue] = bool(no_ack)
        # kombu's Consumer hands its bound receive callback: its ``accept`` is
        # the content the consumer will decode (Celery's accept_content).
        self._accept[queue] = getattr(getattr(callback, "__self__", None), "accept", None)
        ret = super().basic_consume(queue, no_ack, callback, consumer_tag, **kwargs)
        if not no_ack and queue not in self._fanout_queues:
            # Inside a worker, once it is ready, settles wait this long for company.
            batcher().delay_ms = self.emq.settle_delay_ms
            # A consuming process sweeps what it consumes: recovery needs no
            # other process.
            self._register(queue)
            self._check_server()
            sweep_thread().watch(self.sweeper, queue)
        return ret

    def basic_get(self, queue: str, no_ack: bool = False, **kwargs: Any) -> Any:
        claimed = self._claim(queue, 1, held=0)
        if not claimed:
            return None
        payload, tag = claimed[0]
        if no_ack:
            self._settle(tag)
        message = self.Message(payload, channel=self)
        if not no_ack:
            self.qos.append(message, message.delivery_tag)
        return message

    def _get(self, queue: str, timeout: float | None = None) -> dict[str, Any]:
        claimed = self._claim(queue, 1, held=0)
        if not claimed:
            raise Empty()
        payload, tag = claimed[0]
        if self._no_ack.get(queue, False):
            self._settle(tag)
        return payload

    def _brpop_start(self, timeout: float | None = None) -> None:
        if timeout is None:
            timeout = self.brpop_timeout
        queues = self._queue_cycle.consume(len(self.active_queues))
        if not queues:
            return
        wake_keys = [self.store.keys(q).wake for q in queues]
        for q, key in zip(queues, wake_keys, strict=True):
            self._wake_queues[key] = q
            if self.global_keyprefix and key.startswith(self.global_keyprefix):
                # kombu's prefixing client strips its prefix from BRPOP replies.
                self._wake_queues[key[len(self.global_keyprefix) :]] = q
        self._in_poll = self.client.connection
        self._brpop_sent_at = monotonic()
        self.client.connection.send_command("BRPOP", *wake_keys, timeout or 0)

    def _brpop_reply(self, **options: Any) -> str | None:
        """Read the pending BRPOP reply; return the queue whose marker was popped."""
        try:
            try:
                reply = self.client.parse_response(self.client.connection, "BRPOP", **options)
            except self.connection_errors:
                self.client.connection.disconnect()
                raise
        finally:
            self._in_poll = None
            self._flush_brpop_reauth()
        if not reply:
            return None
        return self._wake_queues[bytes_to_str(reply[0])]

    def _brpop_read(self, **options: Any) -> bool:
        queue = self._brpop_reply(**options)
        return self._deliver_woken([] if queue is None else [queue])

    def _deliver_woken(self, woken: list[str]) -> bool:
        """Claim for each queue whose wake marker was popped; scan the rest when due.

        Raises:
            Empty: nothing was delivered.
        """
        delivered = False
        for i, queue in enumerate(woken):
            if queue not in self._active_queues:
                self._give_back_marker(queue)
                continue
            self._queue_cycle.rotate(queue)
            try:
                delivered = self._claim_and_deliver(queue, held=1) or delivered
            except BaseException:
                for rest in woken[i + 1 :]:
                    self._give_back_marker(rest)
                raise
        # A marker can be lost (a consumer killed between its BRPOP and its
        # claim), so look at every queue after a wait timed out, and at least
        # once a scan interval however busy another queue keeps the BRPOP: a
        # stranded job waits at most about one interval. An idle queue costs
        # one EXISTS here, not a claim.
        now = monotonic()
        if not woken or now - self._scanned_at >= self._scan_interval_s:
            self._scanned_at = now
            for q in self._waiting(self.active_queues):
                if self._claim_and_deliver(q, held=0):
                    delivered = True
        if delivered:
            return True
        raise Empty()

    def _waiting(self, queues: list[str]) -> list[str]:
        """Those of ``queues`` that have jobs to claim (promoting due delayed jobs)."""
        return self.store.waiting(queues)

    @property
    def _scan_interval_s(self) -> float:
        return float(self.brpop_timeout or 1)

    def _claim_and_deliver(self, queue: str, held: int) -> bool:
        """Claim a batch and hand each message to the consumer.

        A batch reaches the consumer or goes back: if a delivery raises, the
        claims not yet delivered are released at once (uncounted) before the
        error propagates. A no-ack consumer's deliveries are deleted once
        handed over, in one call for the batch.
        """
        budget = self.qos.can_consume_max_estimate()
        count = self.emq.claim_batch if budget is None else min(budget, self.emq.claim_batch)
        if count <= 0 or keeper().awaits_suspect():
            if held:
                self._give_back_marker(queue)
            return False
        no_ack = self._no_ack.get(queue, False)
        claimed = self._claim(queue, count, held)
        delivered = 0
        try:
            for payload, _tag in claimed:
                self.connection._deliver(payload, queue)
                delivered += 1
        except BaseException:
            # The delivery that raised may not have reached the QoS; the rest
            # surely did not. Both go back now, not when their leases lapse.
            self._release_all(
                [tag for _payload, tag in claimed[delivered:] if tag not in self.qos._delivered]
            )
            raise
        finally:
            if no_ack:
                self._settle_many([tag for _payload, tag in claimed[:delivered]])
        return bool(claimed)

    def _claim(self, queue: str, count: int, held: int) -> list[tuple[dict[str, Any], str]]:
        """Claim up to ``count`` jobs; return each decodable one's payload and delivery tag.

        A job that lapsed before its task started may kill this process while
        it is received: the store hands it out only to a process that holds no
        other claim (``alone``), so nothing else dies with it, and this process
        claims nothing more, on any queue, until it is heard to start (see
        :meth:`~celery_emq.transport.lease.LeaseKeeper.hold_suspect`).
        """
        if keeper().awaits_suspect():
            return []
        alone = keeper().held_count() == 0
        if alone and batcher().queued():
            # Acks of claims already forgotten may still wait for company: were
            # a suspect handed out now to kill this process, they would die
            # unsent and their tasks run again. They go first.
            batcher().flush()
        claimed = self.store.claim(
            queue,
            self.owner,
            count,
            held=held,
            ttl_ms=self._queue_ttl.get(queue, 0),
            alone=alone,
        )
        if not claimed:
            return []
        tags = keeper().hold(
            self.store,
            queue,
            [(c.id, c.token) for c in claimed],
            self.emq.renew_interval_ms,
        )
        for job, tag in zip(claimed, tags, strict=True):
            if job.suspect:
                # The keeper renews its lease, so no lapse of it frees this
                # process: one lease after its claim does.
                keeper().hold_suspect(tag, self.emq.lease_ms / 1000)
        out = []
        try:
            for job, tag in zip(claimed, tags, strict=True):
                payload = self._decode(queue, job, tag)
                if payload is not None:
                    out.append((payload, tag))
        except BaseException:
            # The caller gets none of the batch: none of it may stay held. (A
            # claim already dead-lettered is no longer held; releasing it is a no-op.)
            self._release_all(tags)
            raise
        return out

    def _decode(self, queue: str, job: Claimed, tag: str) -> dict[str, Any] | None:
        """Turn a claimed job into a kombu message; dead-letter what cannot be."""
        try:
            payload = loads(bytes_to_str(unpack(job.payload)))
            props = payload["properties"]
            headers = payload.setdefault("headers", {})
            if not isinstance(props, dict) or not isinstance(headers, dict):
                raise TypeError("properties and headers must be objects")
            if payload.get("body"):
                # What kombu will do to build the message: a body it cannot
                # decode must go to the morgue here, not fail every delivery.
                self.decode_body(payload["body"], props.get("body_encoding"))
        except Exception as exc:
            logger.error("celery_emq: job %s in %s cannot be decoded: %r", job.id, queue, exc)
            self._bury(tag, "malformed", f"{type(exc).__name__}: {exc}")
            return None
        refused = _refused_content(payload.get("content-type"), self._accept.get(queue))
        if refused:
            logger.error("celery_emq: job %s in %s refused: %s", job.id, queue, refused)
            self._bury(tag, CONTENT_DISALLOWED, refused)
            return None
        if job.revoked:
            _remember_revoked(headers.get("id"))
        props["delivery_tag"] = tag
        # Only publish attempts share it: a message published again from what a
        # consumer received is a new job.
        props.pop(JOB_ID_PROPERTY, None)
        if BUDGET_OPTION not in headers:
            self._apply_task_budget(queue, job.id, headers.get("task"))
        if job.deliveries > 1 or job.stalled:
            # Only the documented emq_* headers are added (kombu's contract: the
            # headers are what was published); kombu's own flag is delivery_info's.
            headers[STALLED_HEADER] = job.stalled
            headers[DELIVERIES_HEADER] = job.deliveries
            props.setdefault("delivery_info", {})["redelivered"] = True
        else:
            # A header copied from an earlier message (a retry) says nothing of this job.
            headers.pop(STALLED_HEADER, None)
            headers.pop(DELIVERIES_HEADER, None)
        return payload  # type: ignore[no-any-return]

    def _apply_task_budget(self, queue: str, job_id: str, task_name: Any) -> None:
        """Write a task's own ``emq_max_stalled`` on its job row, if it has one."""
        if not isinstance(task_name, str):
            return
        budget = self._budgets.get(task_name)
        if budget is None and task_name not in self._budgets:
            budget = self._budgets[task_name] = _task_budget(task_name)
        if budget is not UNSET:
            value = -1 if budget is None else budget
            self.store.client.hset(self.store.keys(queue).job(job_id), "max_stalled", value)

    def _give_back_marker(self, queue: str) -> None:
        """Return a popped wake marker, so another consumer wakes for that job."""
        self.store.give_back(queue)

    # -- settling --------------------------------------------------------
    #
    # Every settle names its claim (job id and token): a settle whose claim is
    # no longer the job's live claim never changes the live claim of another.

    def _settle(self, tag: str) -> None:
        self._settle_many([tag])

    def _settle_many(self, tags: list[str]) -> None:
        """Ack deliveries: at once, or inside a worker with other settles (see settle.py)."""
        claims = [c for c in map(keeper().forget, tags) if c is not None]
        batcher().ack(claims)

    def _release(self, tag: str, unless_started: bool = False) -> None:
        keeper().release(tag, unless_started)

    def _release_all(
        self, tags: list[str], unless_started: bool = False, unseen: bool = False
    ) -> None:
        for tag in tags:
            keeper().release(tag, unless_started, unseen)

    def _bury(self, tag: str, reason: str, error: str) -> None:
        claim = keeper().forget(tag)
        if claim is None:
            return
        Sweeper(claim.store, self.emq).bury(claim.queue, claim.job_id, claim.token, reason, error)

    def _charge(self, tag: str, reason: str) -> None:
        claim = keeper().forget(tag)
        if claim is None:
            return
        Sweeper(claim.store, self.emq).charge(
            claim.queue, claim.job_id, claim.token, reason, self.emq.max_stalled
        )

    def _restore(self, message: Any, leftmost: bool = False) -> None:
        self._release(message.delivery_tag)

    # -- queue management ------------------------------------------------

    def _size(self, queue: str) -> int:
        return self.store.size(queue)

    def _purge(self, queue: str) -> int:
        return self.store.purge(queue)

    def _has_queue(self, queue: str, **kwargs: Any) -> bool:
        return self.store.exists(queue)

    def _delete(self, queue: str, *args: Any, **kwargs: Any) -> None:
        super()._delete(queue, *args, **kwargs)
        self.store.purge(queue)

    def close(self) -> None:
        # Nothing this process settled may wait past the close (a warm
        # shutdown, a reconnect): queued acks and start records go now.
        batcher().flush()
        if self._in_poll:
            # A BRPOP is in flight: read its reply without claiming, and give a
            # popped marker back so another consumer wakes for that job.
            try:
                queue = self._brpop_reply()
            except Exception:
                queue = None
            if queue is not None:
                self._give_back_marker(queue)
        super().close()
        if self._store is not None:
            sweep_thread().unwatch_store(self._store)
            if not keeper().holds(self._store):
                self._disconnect_store()

    def _disconnect_store(self) -> None:
        """Close the store's connections (none of its claims is held any longer)."""
        self._store_pool.disconnect()


#: Servers this process has checked (host, port, db): one warning each.
_checked_servers: set[tuple[Any, Any, Any]] = set()


#: Message properties the job's key already holds (not stored in the message).
_KEYED = ("delivery_tag", JOB_ID_PROPERTY)

#: A task whose ETA is at least this far ahead waits in the broker's delayed set;
#: a nearer one is claimed at once and waits in the worker (Celery's timer).
DELAY_MIN_MS = 1000


def _eta_ms(eta: Any) -> int | None:
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


def _remember_revoked(task_id: Any) -> None:
    """Make this worker discard a task revoked while it waited in the delayed set.

    Celery keeps revokes in memory (3 hours by default): a worker that started
    later, or forgot, learns it here, before the message reaches Celery.
    """
    state = sys.modules.get("celery.worker.state")
    if state is not None and isinstance(task_id, str):
        state.revoked.add(task_id)


def _queue_ttl_ms(kwargs: dict[str, Any]) -> int:
    """Return a queue's ``x-expires`` (ms) from its declare arguments, or 0."""
    try:
        value = int(kwargs["arguments"]["x-expires"])
    except (KeyError, TypeError, ValueError):
        return 0
    return max(value, 0)


def _refused_content(content_type: Any, accept: Any) -> str:
    """Return why a consumer refuses a body of ``content_type``, or '' if it takes it."""
    if accept is None or not content_type or content_type in TRUSTED_CONTENT:
        return ""
    if content_type in accept:
        return ""
    return (
        f"ContentDisallowed: the consumer does not accept content of type {content_type} "
        f"(accept_content: {', '.join(sorted(accept))}); the body was not decoded"
    )


def _budget(value: Any) -> int | Unset | None:
    """Read a stall budget given in a header: an int >= 0, or None for never."""
    if value is None:
        return None
    if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
        return value
    logger.warning(
        "celery_emq: ignoring %s=%r (expected an int >= 0 or None)", BUDGET_OPTION, value
    )
    return UNSET


def _task_budget(task_name: str) -> int | Unset | None:
    """Return the ``emq_max_stalled`` attribute of a task of the current app."""
    from celery._state import get_current_app

    try:
        task = get_current_app().tasks.get(task_name)
    except Exception:
        return UNSET
    if task is None or not hasattr(task, BUDGET_OPTION):
        return UNSET
    return _budget(getattr(task, BUDGET_OPTION))
