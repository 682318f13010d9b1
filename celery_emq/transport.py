"""The kombu transport: thin glue from kombu's Channel/QoS API to the job store.

Everything kombu's Redis transport does besides task queues is inherited:
connection handling, TLS/auth, PUB/SUB fanout (remote control, events), the
binding tables and the event-loop integration. Task-queue storage, consuming,
ack/reject/restore and recovery go through :class:`~celery_emq.store.JobStore`.
"""

from __future__ import annotations

import logging
import uuid
from queue import Empty
from time import monotonic
from typing import Any

import redis
from kombu.transport import redis as kombu_redis
from kombu.transport import virtual
from kombu.utils.encoding import bytes_to_str
from kombu.utils.json import dumps, loads

from .lease import keeper
from .options import EmqOptions
from .scripts import UNSET, Claimed, Outcome, Unset
from .store import JobStore
from .sweeper import Sweeper, sweep_thread
from .worker_state import WORKER_LOST, install_worker_probes, pop_mark, started_delivery_tags

__all__ = ["Channel", "QoS", "Transport"]

logger = logging.getLogger(__name__)

#: Header a redelivered message carries: how many times the job stalled.
STALLED_HEADER = "emq_stalled"
#: Header a redelivered message carries: how many times the job was claimed.
DELIVERIES_HEADER = "emq_deliveries"
#: Header (at publish) or task attribute giving a job its own stall budget.
BUDGET_OPTION = "emq_max_stalled"
#: Header (at publish) naming the fair-lane group a job waits in.
GROUP_HEADER = "emq_group"


class QoS(kombu_redis.QoS):
    """Acks, rejects and restores through the job store.

    kombu's Redis QoS keeps a DB-global ``unacked`` hash restored by age; here
    the claim already wrote the lease, so ``append`` only does bookkeeping.
    """

    channel: Channel

    def append(self, message: Any, delivery_tag: str) -> None:
        virtual.QoS.append(self, message, delivery_tag)

    def ack(self, delivery_tag: str) -> None:
        if not self._settle_marked(delivery_tag):
            self.channel._settle(delivery_tag)
        virtual.QoS.ack(self, delivery_tag)

    def reject(self, delivery_tag: str, requeue: bool = False) -> None:
        if not self._settle_marked(delivery_tag):
            if requeue:
                self.channel._release(delivery_tag)
            else:
                self.channel._bury(delivery_tag, "rejected", "rejected without requeue")
        virtual.QoS.ack(self, delivery_tag)

    def _settle_marked(self, delivery_tag: str) -> bool:
        """Settle a delivery Celery's handling marked with a reason; False if unmarked.

        A lost pool process is a stall (counted against the budget); a message
        Celery could not decode or will not run is dead-lettered with the reason.
        """
        mark = pop_mark(delivery_tag)
        if mark is None:
            return False
        if mark.reason == WORKER_LOST:
            self.channel._charge(delivery_tag, WORKER_LOST)
        else:
            self.channel._bury(delivery_tag, mark.reason, mark.error)
        return True

    def restore_unacked(self, client: Any = None) -> None:
        """Release unstarted deliveries at once; keep leases of started ones.

        Called when the channel closes (warm shutdown, broker reconnect). A
        delivery whose task already runs keeps its lease in the process-wide
        keeper, which goes on renewing it until the task acks.
        """
        self._flush()
        started = started_delivery_tags()
        for tag in list(self._delivered):
            if tag not in started:
                self.channel._release(tag)
        self._delivered.clear()

    def restore_by_tag(self, tag: str, client: Any = None, leftmost: bool = False) -> None:
        self.channel._release(tag)

    def restore_visible(self, *args: Any, **kwargs: Any) -> None:
        """Do nothing: lapsed leases are recovered by the reaper and sweep."""


class Channel(kombu_redis.Channel):
    """A kombu Redis channel whose task queues live in the leased job store."""

    QoS = QoS
    connection_class: Any
    _in_poll: Any = False
    _brpop_sent_at: Any = None

    def __init__(self, connection: Any, *args: Any, **kwargs: Any) -> None:
        topts = connection.client.transport_options
        # Validate before connecting, so a bad option fails fast and by name.
        self.emq = EmqOptions.from_transport_options(topts)
        if connection.client.transport_cls == "emqs" and not connection.client.ssl:
            self.connection_class = self.connection_class_ssl
        self._no_ack: dict[str, bool] = {}
        self._wake_queues: dict[str, str] = {}
        self._store: JobStore | None = None
        self._store_pool: Any = None
        self._sweeper: Sweeper | None = None
        self._registered_queues: set[str] = set()
        self._budgets: dict[str, int | Unset | None] = {}
        super().__init__(connection, *args, **kwargs)
        # Inside a Celery worker, before it binds its message handlers: see
        # what its handling of lost processes and refused messages decides.
        install_worker_probes()

    # -- the store -------------------------------------------------------

    @property
    def store(self) -> JobStore:
        """The job store, on a connection pool of its own.

        The pool is the channel's own so that the store keeps working for
        deliveries still running after kombu reset its pools (reconnect).
        """
        if self._store is None:
            self._store_pool = redis.ConnectionPool(**self._connparams())
            self._store = JobStore(
                redis.Redis(connection_pool=self._store_pool),
                self.emq.key_prefix,
                self.emq.lease_ms,
            )
        return self._store

    @property
    def sweeper(self) -> Sweeper:
        """The sweeper over this channel's store (signals, results, events)."""
        if self._sweeper is None:
            self._sweeper = Sweeper(self.store, self.emq)
        return self._sweeper

    def _register(self, queue: str) -> None:
        if queue not in self._registered_queues:
            self.store.register(queue)
            self._registered_queues.add(queue)

    @property
    def owner(self) -> str:
        return keeper().owner

    # -- publishing ------------------------------------------------------

    @property
    def supports_batch_publish(self) -> bool:
        return False

    def _put(self, queue: str, message: dict[str, Any], **kwargs: Any) -> None:
        props = message["properties"]
        job_id = props.get("delivery_tag") or uuid.uuid4().hex
        props["delivery_tag"] = job_id
        priority = self._get_message_priority(message, reverse=False)
        ttl_ms = self._expires.get(queue, 0)
        headers = message.get("headers") or {}
        budget: int | Unset | None = UNSET
        if BUDGET_OPTION in headers:
            budget = _budget(headers[BUDGET_OPTION])
        if not ttl_ms:
            self._register(queue)
        group = headers.get(GROUP_HEADER) or ""
        if not isinstance(group, str):
            group = str(group)
        outcome = self.store.enqueue(
            queue, job_id, dumps(message), priority, ttl_ms, max_stalled=budget, group=group
        )
        if outcome is Outcome.DUPLICATE:
            logger.debug("celery_emq: job %s already in %s; publish ignored", job_id, queue)

    # -- consuming -------------------------------------------------------

    def basic_consume(self, queue: str, no_ack: bool, *args: Any, **kwargs: Any) -> Any:
        self._no_ack[queue] = bool(no_ack)
        ret = super().basic_consume(queue, no_ack, *args, **kwargs)
        if not no_ack and queue not in self._fanout_queues:
            # A consuming process sweeps what it consumes: recovery needs no
            # other process.
            self._register(queue)
            sweep_thread().watch(self.sweeper, queue)
        return ret

    def basic_get(self, queue: str, no_ack: bool = False, **kwargs: Any) -> Any:
        payloads = self._claim(queue, 1, held=0, no_ack=no_ack)
        if not payloads:
            return None
        message = self.Message(payloads[0], channel=self)
        if not no_ack:
            self.qos.append(message, message.delivery_tag)
        return message

    def _get(self, queue: str, timeout: float | None = None) -> dict[str, Any]:
        payloads = self._claim(queue, 1, held=0, no_ack=False)
        if not payloads:
            raise Empty()
        return payloads[0]

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
        if queue is not None:
            self._queue_cycle.rotate(queue)
            if self._claim_and_deliver(queue, held=1):
                return True
            raise Empty()
        # The wait timed out. A marker can be lost (a consumer killed between
        # its BRPOP and its claim), so look once at every queue before waiting
        # again: a stranded job waits at most one BRPOP timeout. An idle queue
        # costs one EXISTS here, not a claim.
        for q in self.store.waiting(self.active_queues):
            if self._claim_and_deliver(q, held=0):
                return True
        raise Empty()

    def _claim_and_deliver(self, queue: str, held: int) -> bool:
        budget = self.qos.can_consume_max_estimate()
        count = self.emq.claim_batch if budget is None else min(budget, self.emq.claim_batch)
        if count <= 0:
            if held:
                self._give_back_marker(queue)
            return False
        payloads = self._claim(queue, count, held, self._no_ack.get(queue, False))
        for payload in payloads:
            self.connection._deliver(payload, queue)
        return bool(payloads)

    def _claim(self, queue: str, count: int, held: int, no_ack: bool) -> list[dict[str, Any]]:
        claimed = self.store.claim(queue, self.owner, count, held=held, no_ack=no_ack)
        if not claimed:
            return []
        if not no_ack:
            keeper().hold(self.store, queue, [c.id for c in claimed], self.emq.renew_interval_ms)
        payloads = []
        for job in claimed:
            payload = self._decode(queue, job)
            if payload is not None:
                payloads.append(payload)
        return payloads

    def _decode(self, queue: str, job: Claimed) -> dict[str, Any] | None:
        """Turn a claimed job into a kombu message; dead-letter what cannot be."""
        try:
            payload = loads(bytes_to_str(job.payload))
            props = payload["properties"]
            headers = payload.setdefault("headers", {})
            if not isinstance(props, dict) or not isinstance(headers, dict):
                raise TypeError("properties and headers must be objects")
        except Exception as exc:
            logger.error("celery_emq: job %s in %s cannot be decoded: %r", job.id, queue, exc)
            keeper().forget(job.id)
            self.sweeper.bury(queue, job.id, "malformed", f"{type(exc).__name__}: {exc}")
            return None
        props["delivery_tag"] = job.id
        if BUDGET_OPTION not in headers:
            self._apply_task_budget(queue, job.id, headers.get("task"))
        if job.deliveries > 1 or job.stalled:
            headers["redelivered"] = True
            headers[STALLED_HEADER] = job.stalled
            headers[DELIVERIES_HEADER] = job.deliveries
            props.setdefault("delivery_info", {})["redelivered"] = True
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
        self.store.client.lpush(self.store.keys(queue).wake, 1)

    # -- settling --------------------------------------------------------

    def _settle(self, tag: str) -> None:
        held = keeper().forget(tag)
        if held is None:
            return
        store, queue = held
        outcome = store.ack(queue, tag, self.owner)
        if outcome is not Outcome.OK:
            logger.warning("celery_emq: ack of %s in %s: %s", tag, queue, outcome.name)

    def _release(self, tag: str) -> None:
        held = keeper().forget(tag)
        if held is None:
            return
        store, queue = held
        store.release(queue, tag, self.owner)

    def _bury(self, tag: str, reason: str, error: str) -> None:
        held = keeper().forget(tag)
        if held is None:
            return
        store, queue = held
        Sweeper(store, self.emq).bury(queue, tag, reason, error)

    def _charge(self, tag: str, reason: str) -> None:
        held = keeper().forget(tag)
        if held is None:
            return
        store, queue = held
        Sweeper(store, self.emq).charge(queue, tag, self.owner, reason, self.emq.max_stalled)

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
                self._store_pool.disconnect()


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


class Transport(kombu_redis.Transport):
    """The ``emq://`` transport (``emqs://`` for TLS)."""

    Channel = Channel
    driver_name = "emq"
    implements = kombu_redis.Transport.implements.extend(batch_publish=False)

    @property
    def supports_batch_publish(self) -> bool:
        return False
