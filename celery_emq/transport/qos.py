"""The channel's QoS: acks, rejects and restores through the job store."""

from __future__ import annotations

from typing import Any, Protocol

from kombu.transport import redis as kombu_redis
from kombu.transport import virtual

from celery_emq.transport.process import WORKER_LOST, host
from celery_emq.transport.settle import batcher

__all__ = ["QoS", "SettlingChannel", "refill_at"]


class SettlingChannel(Protocol):
    """What the QoS asks of its channel: each settle, as the job store does it."""

    def _settle(self, tag: str) -> None: ...

    def _release(self, tag: str, unless_started: bool = False) -> None: ...

    def _release_all(
        self, tags: list[str], unless_started: bool = False, unseen: bool = False
    ) -> None: ...

    def _bury(self, tag: str, reason: str, error: str) -> None: ...

    def _charge(self, tag: str, reason: str) -> None: ...


class QoS(kombu_redis.QoS):
    """Acks, rejects and restores through the job store.

    kombu's Redis QoS keeps a DB-global ``unacked`` hash restored by age; here
    the claim already wrote the lease, so ``append`` only does bookkeeping.
    """

    channel: SettlingChannel

    def append(self, message: Any, delivery_tag: str) -> None:
        virtual.QoS.append(self, message, delivery_tag)

    def can_consume(self) -> bool:
        """Whether to wait for (and claim) more jobs now.

        Every claim costs a round trip (two after an idle wait), so a prefork
        or solo worker whose pool is busy tops up its prefetch in batches: it
        claims again once half its prefetch is free. It does not wait while a
        pool process may idle (see :meth:`Host.claim_at_once`).
        """
        pcount = self.prefetch_count
        if not pcount:
            return True
        free = pcount - (len(self._delivered) - len(self._dirty))
        return free > 0 and (free >= refill_at(pcount) or host().claim_at_once())

    def ack(self, delivery_tag: str) -> None:
        host().settled(delivery_tag)
        if not self._settle_marked(delivery_tag):
            self.channel._settle(delivery_tag)
        virtual.QoS.ack(self, delivery_tag)

    def reject(self, delivery_tag: str, requeue: bool = False) -> None:
        host().settled(delivery_tag)
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
        mark = host().pop_mark(delivery_tag)
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
        # Start records queued for prefork children go first: the recorded
        # start decides what stays held below.
        batcher().flush()
        started = host().started_delivery_tags()
        # A prefork child may have started one before the worker heard of it:
        # the recorded start decides, and such a claim stays held.
        self.channel._release_all(
            [tag for tag in self._delivered if tag not in started], unless_started=True, unseen=True
        )
        self._delivered.clear()

    def restore_by_tag(self, tag: str, client: Any = None, leftmost: bool = False) -> None:
        self.channel._release(tag)

    def restore_visible(self, *args: Any, **kwargs: Any) -> None:
        """Do nothing: lapsed leases are recovered by the reaper and sweep."""


def refill_at(prefetch: int) -> int:
    """Return how many prefetch slots a busy worker lets free before it claims again."""
    return max(1, prefetch // 2)
