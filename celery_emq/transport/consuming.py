"""Consuming: waiting for work, claiming it, and handing each claim to kombu.

A consumer blocks on its queues' wake lists (one ``BRPOP``), claims a batch
from each queue whose marker it popped, and scans its queues when a wait times
out, and at least once a scan interval while markers keep coming (a marker can
be lost). An idle consumer's wait lasts until the earliest delayed job it knows
of is due, or ``idle_wait_s``: the scan that follows promotes due jobs and
learns the next due time; a delayed job due earlier than any before pushes a
``soon`` marker the wait also blocks on. Each claimed job is decoded into a kombu
message; one that cannot be, or whose content the consumer refuses, goes to
the morgue. A delivery that fails gives the rest of its batch back at once.
"""

from __future__ import annotations

import logging
from queue import Empty
from time import monotonic
from typing import Any

from kombu.utils.encoding import bytes_to_str
from kombu.utils.json import loads

from celery_emq.store.codec import unpack
from celery_emq.store.outcomes import UNSET, Claimed, Scan
from celery_emq.transport.lease import keeper
from celery_emq.transport.messages import (
    BUDGET_OPTION,
    CONTENT_DISALLOWED,
    budget,
    mark_delivery,
    refused_content,
)
from celery_emq.transport.process import host
from celery_emq.transport.settle import batcher
from celery_emq.transport.store_channel import StoreChannel
from celery_emq.transport.sweep_thread import sweep_thread

__all__ = ["Consuming"]

logger = logging.getLogger(__name__)

#: How long a nudge no wait popped stays (see :meth:`Consuming._nudge`).
NUDGE_TTL_MS = 60_000


class Consuming(StoreChannel):
    """The channel's consuming half: the wait, the claims, the decoding of each."""

    def basic_consume(
        self, queue: str, no_ack: bool, callback: Any, consumer_tag: str, **kwargs: Any
    ) -> Any:
        self._no_ack[queue] = bool(no_ack)
        # kombu's Consumer hands its bound receive callback: its ``accept`` is
        # the content the consumer will decode (Celery's accept_content).
        self._accept[queue] = getattr(getattr(callback, "__self__", None), "accept", None)
        ret = super().basic_consume(queue, no_ack, callback, consumer_tag, **kwargs)
        nudge = queue not in self._fanout_queues and self._in_poll
        if not no_ack and queue not in self._fanout_queues:
            # Inside a worker, once it is ready, settles wait this long for company.
            batcher().delay_ms = self.emq.settle_delay_ms
            # A consuming process sweeps what it consumes: recovery needs no
            # other process.
            self._register(queue)
            self._check_server()
            # A new queue is looked at before the first wait (a job stranded
            # by a lost marker, a delayed job due soon).
            self._next_scan_at = 0.0
            sweep_thread().watch(self.sweeper, queue, at_once=True)
        if nudge:
            # The wait in flight names only the queues consumed when it began;
            # last, so a failed nudge leaves the queue registered and swept (the
            # wait then ends within idle_wait_s anyway).
            try:
                self._nudge()
            except self.connection_errors:
                logger.debug("celery_emq: could not cut the wait short", exc_info=True)
        return ret

    def basic_get(self, queue: str, no_ack: bool = False, **kwargs: Any) -> Any:
        claimed = self._claim(queue, 1, held=0)
        if not claimed:
            return None
        payload, tag = claimed[0]
        self._received(tag)  # handed over: the caller decodes it
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
        self._received(tag)  # handed over: kombu decodes it
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
        soon_keys = [self.store.keys(q).soon for q in queues] + [self._nudge_key]
        for q, key, soon in zip(queues, wake_keys, soon_keys[:-1], strict=True):
            self._wake_queues[key] = q
            self._soon_keys.add(soon)
            if self.global_keyprefix and key.startswith(self.global_keyprefix):
                # kombu's prefixing client strips its prefix from BRPOP replies.
                self._wake_queues[key[len(self.global_keyprefix) :]] = q
                self._soon_keys.add(soon[len(self.global_keyprefix) :])
        self._in_poll = self.client.connection
        self._brpop_sent_at = monotonic()
        self.client.connection.send_command(
            "BRPOP", *wake_keys, *soon_keys, f"{self._wait_timeout_s():.3f}"
        )

    @property
    def _nudge_key(self) -> str:
        """This channel's own list: a push to it cuts its wait in flight short."""
        key = f"{self.store.prefix}:nudge:{self._nudge_id}"
        self._soon_keys.add(key)
        if self.global_keyprefix and key.startswith(self.global_keyprefix):
            self._soon_keys.add(key[len(self.global_keyprefix) :])
        return key

    def _nudge(self) -> None:
        """End the wait in flight now: the next one names the queues consumed now.

        The scan that follows looks at every queue at once (a message may
        already wait in the one just consumed).
        """
        self._next_scan_at = 0.0
        pipe = self.store.client.pipeline(transaction=False)
        # A nudge no wait pops (the channel closed meanwhile) does not stay.
        pipe.lpush(self._nudge_key, 1).pexpire(self._nudge_key, NUDGE_TTL_MS)
        pipe.execute()

    def _wait_timeout_s(self) -> float:
        """How long the next wait may block: until the next scan is due, within bounds.

        Never 0 (a BRPOP that would block for ever).
        """
        return max(0.01, min(self._next_scan_at - monotonic(), self._idle_wait_s))

    @property
    def _idle_wait_s(self) -> float:
        """The longest wait: ``idle_wait_s``, under the socket timeout and kombu's health check.

        kombu drops a BRPOP connection whose reply is overdue by
        ``brpop_timeout + health_check_interval``; a socket timeout would
        fail a read that waited longer than it.
        """
        wait = self.emq.idle_wait_s
        if self.socket_timeout:
            wait = min(wait, 0.8 * float(self.socket_timeout))
        if self.health_check_interval:
            wait = min(wait, float(self.brpop_timeout or 1) + self.health_check_interval / 2)
        return max(wait, 0.05)

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
        key = bytes_to_str(reply[0])
        if key in self._soon_keys:
            # A delayed job due before any the wait knew of: scan now (the
            # scan learns when it is due), as after a wait that timed out.
            self._next_scan_at = 0.0
            return None
        return self._wake_queues[key]

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
            # A scan that raises is not tried again at once by every wait.
            self._next_scan_at = now + self._scan_interval_s
            scan = self._scan(self.active_queues)
            wait_s = self._idle_wait_s
            if scan.next_due_ms is not None:
                wait_s = min(wait_s, scan.next_due_ms / 1000)
                # Due while this channel may be busy: the process's sweep
                # (if it sweeps these queues) promotes it then.
                sweep_thread().due_in(scan.next_due_ms / 1000)
            self._next_scan_at = now + wait_s
            for q in scan.waiting:
                if self._claim_and_deliver(q, held=0):
                    delivered = True
        if delivered:
            return True
        raise Empty()

    def _scan(self, queues: list[str]) -> Scan:
        """Promote due delayed jobs; which of ``queues`` have jobs, when the next is due.

        On one server a queue's failed call is the server's: it is raised
        (the cluster's channel lets a queue whose slot migrates wait alone).
        """
        scan = self.store.scan(queues)
        if scan.failed:
            raise next(iter(scan.failed.values()))
        return scan

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
        if count <= 0:
            if held:
                self._give_back_marker(queue)
            return False
        no_ack = self._no_ack.get(queue, False)
        claimed = self._claim(queue, count, held)
        delivered = 0
        try:
            for payload, tag in claimed:
                self.connection._deliver(payload, queue)
                delivered += 1
                self._received(tag)
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

        A job that lapsed before its task started (a suspect) may kill this
        process as it is received. A claim takes at most one, beside any other
        jobs; until its delivery returns (the worker received it whole, see
        :meth:`_received`), it is the suspect of this process's claims: should
        the process die meanwhile, the sweep blames it alone and forgives the
        rest (sweep.lua).
        """
        ttl_ms = self._queue_ttl.get(queue, 0)
        claimed = self.store.claim(
            queue, self.owner, count, held=held, ttl_ms=ttl_ms, runs_here=host().tasks_run_here()
        )
        if not claimed:
            return []
        tags = keeper().hold(
            self.store,
            queue,
            [(c.id, c.token) for c in claimed],
            self.emq.renew_interval_ms,
        )
        suspects = [tag for job, tag in zip(claimed, tags, strict=True) if job.suspect]
        self._unreceived.update(suspects)
        out = []
        try:
            if suspects:
                # Were the suspect to kill this process as it is received, acks
                # and start records waiting for company would die unsent
                # (finished tasks run again, started ones look unstarted).
                batcher().flush()
            for job, tag in zip(claimed, tags, strict=True):
                payload = self._decode(queue, job, tag)
                if payload is not None:
                    out.append((payload, tag))
                else:
                    self._unreceived.discard(tag)  # dead-lettered, not delivered
        except BaseException:
            # The caller gets none of the batch: none of it may stay held. (A
            # claim already dead-lettered is no longer held; releasing it is a no-op.)
            self._unreceived.difference_update(suspects)
            self._release_all(tags)
            raise
        # The suspect is delivered first: its record of being received is then
        # queued before any task of its batch can start in this process.
        out.sort(key=lambda delivery: delivery[1] not in self._unreceived)
        return out

    def _received(self, tag: str) -> None:
        """A delivery reached the worker whole: if it was a suspect, say so to the store.

        The worker decoded it as it received it, so it is no message that kills
        its worker before its task starts; its lapses are forgotten, and the
        blame with them. The record is sent at once (one round trip per
        suspect; suspects come only from crashes), and goes before the body of
        any task delivered after it. Should it not reach Redis, the sweep may
        still blame the suspect if this process dies before its task starts.
        """
        if tag not in self._unreceived:
            return
        self._unreceived.discard(tag)
        claim = keeper().get(tag)
        if claim is None:
            return  # settled already (a no-ack consumer, a message refused)
        try:
            batcher().receive(claim)
            # Sent now, with whatever waits: a task already running in this
            # process (threads, gevent, eventlet) that kills it later must not
            # find the suspect still unreceived, or the suspect would take the
            # blame, and the killer none.
            batcher().flush()
        except Exception:
            logger.debug("celery_emq: could not record that %s was received", tag, exc_info=True)

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
        refused = refused_content(payload.get("content-type"), self._accept.get(queue))
        if refused:
            logger.error("celery_emq: job %s in %s refused: %s", job.id, queue, refused)
            self._bury(tag, CONTENT_DISALLOWED, refused)
            return None
        task_id = headers.get("id")
        if job.revoked and isinstance(task_id, str):
            # Revoked while it waited in the delayed set: a worker that started
            # later, or forgot, learns it here, before the message reaches it.
            host().revoked(task_id)
        if BUDGET_OPTION not in headers:
            self._apply_task_budget(queue, job.id, headers.get("task"))
        mark_delivery(payload, job, tag)
        return payload  # type: ignore[no-any-return]

    def _apply_task_budget(self, queue: str, job_id: str, task_name: Any) -> None:
        """Write a task's own ``emq_max_stalled`` on its job row, if it has one."""
        if not isinstance(task_name, str):
            return
        own = self._budgets.get(task_name)
        if own is None and task_name not in self._budgets:
            raw = host().task_budget(task_name)
            own = self._budgets[task_name] = UNSET if raw is UNSET else budget(raw)
        if own is not UNSET:
            value = -1 if own is None else own
            self.store.budget(queue, job_id, value)
