"""The kombu channel: thin glue from kombu's Channel API to the job store.

Everything kombu's Redis transport does besides task queues is inherited:
connection handling, TLS/auth, PUB/SUB fanout (remote control, events), the
binding tables and the event-loop integration. Task-queue storage, consuming,
ack/reject/restore and recovery go through :class:`~celery_emq.store.JobStore`,
in three parts: the store, declaring and settles
(:mod:`~celery_emq.transport.store_channel`), consuming
(:mod:`~celery_emq.transport.consuming`) and publishing
(:mod:`~celery_emq.transport.publishing`); the message/job translation is
:mod:`~celery_emq.transport.messages`.
"""

from __future__ import annotations

from celery_emq.transport.consuming import Consuming
from celery_emq.transport.lease import keeper
from celery_emq.transport.publishing import Publishing
from celery_emq.transport.settle import batcher
from celery_emq.transport.sweep_thread import sweep_thread

__all__ = ["Channel"]


class Channel(Consuming, Publishing):
    """A kombu Redis channel whose task queues live in the leased job store."""

    def close(self) -> None:
        # Nothing this process settled may wait past the close (a warm
        # shutdown, a reconnect): queued acks and start records go now.
        batcher().flush()
        if self._in_poll:
            # A BRPOP is in flight. A reply already there is read without
            # claiming, and a popped marker given back so another consumer
            # wakes for that job. Otherwise the wait (an idle one lasts
            # seconds) is not sat through: a blocked BRPOP whose connection
            # closes pops nothing.
            # A connection reset meanwhile (a restart, a failover) is dropped
            # too: the close goes on, or kombu would read the dead wait again.
            queue = None
            try:
                if self._in_poll.can_read(timeout=0):
                    queue = self._brpop_reply()
            except Exception:
                queue = None
            connection, self._in_poll = self._in_poll, None
            if connection is not None:
                try:
                    connection.disconnect()
                except Exception:  # pragma: no cover - a socket already gone
                    pass
            if queue is not None:
                self._give_back_marker(queue)
        super().close()
        if self._store is not None:
            sweep_thread().unwatch_store(self._store)
            if not keeper().holds(self._store):
                self._disconnect_store()
