"""Move tasks waiting on kombu's stock Redis transport (``redis://``) into ``emq://``.

The stock transport keeps each queue as Redis lists: ``<queue>`` and, for
priorities, ``<queue>\\x06\\x16<step>`` (steps 3, 6, 9 by default), published with
LPUSH and consumed from the right. Messages delivered to a worker and not yet
acked wait in the ``unacked`` hash (delivery tag -> ``[message, exchange,
routing_key]``) and the ``unacked_index`` sorted set. kombu's ``global_keyprefix``
goes in front of every one of these keys.

Crash-safe order, per batch of one list:

1. ``RPOPLPUSH`` each message from the queue's list into a staging list of the
   migration's own (``<queue>\\x06\\x16emq.migrating``): atomic on the source, so
   an old worker still consuming cannot take a message being moved;
2. enqueue each message of the batch into ``emq://`` with one script per message
   (the store's ``take_in``: ``enqueue.lua`` and, in the same script, the record
   of the source delivery tag in the queue's ``migrated`` set, 7 days): a tag is
   recorded only when its message is a job, and a message whose script failed
   (``NOSCRIPT`` after a failover, an error) is neither;
3. only then delete from the staging list the messages whose tag is recorded;
   the others stay there and the run stops with an error.

The job id is the message's delivery tag (as :meth:`Channel._put` chooses it), and
a tag already in ``migrated`` is not enqueued again, even if its job already
ran: a run stopped anywhere is finished by running the command again (it moves
whatever the staging lists hold first), and a message moved twice is one job.
``unacked`` entries go the same way, left in the hash until their enqueue is done.

The scripts of a batch go in one pipeline on the queue's keys (one hash slot on
a Redis Cluster: the pipeline goes to its master), after a ``SCRIPT LOAD`` on
that server.
"""

from __future__ import annotations

import hashlib
import json
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from kombu.transport.virtual.exchange import STANDARD_EXCHANGE_TYPES

from celery_emq.errors import EmqError
from celery_emq.store.jobstore import JobStore
from celery_emq.store.outcomes import UNSET, NewJob, Outcome
from celery_emq.store.take_in import MIGRATED_TTL_MS, take_in
from celery_emq.transport import messages
from celery_emq.transport.channel import Channel
from celery_emq.transport.messages import BUDGET_OPTION, GROUP_HEADER, JOB_ID_PROPERTY

__all__ = ["MIGRATED_TTL_MS", "Migration", "QueueCount"]

#: kombu's separator in priority list names and binding entries.
SEP = "\x06\x16"
#: The suffix of a queue's staging list on the source.
STAGING = SEP + "emq.migrating"
#: Messages moved per transaction.
BATCH = 200
#: The lock one migration holds on the source (seconds; renewed each batch).
LOCK_S = 60
#: Celery's own exchanges: their queues hold replies and events, not tasks.
INTERNAL_EXCHANGES = frozenset({"celery.pidbox", "reply.celery.pidbox", "celeryev"})


@dataclass
class QueueCount:
    """What one queue has (``waiting``, ``unacked``) and what the run did."""

    queue: str
    waiting: int = 0
    unacked: int = 0
    moved: int = 0
    moved_unacked: int = 0
    #: messages whose tag the queue had already taken in: removed from the source only
    already: int = 0

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class _Taken:
    """What one pipeline of :data:`TAKE_IN` did: ``done`` per message, in order."""

    moved: int = 0
    already: int = 0
    failed: int = 0
    error: str = ""
    done: list[bool] = field(default_factory=list)


class Migration:
    """Moves messages from a stock ``redis://`` broker into an emq channel's store.

    Args:
        source: a redis-py client on the stock transport's database (no prefixing).
        channel: an open :class:`celery_emq.transport.Channel` (the app's broker).
        keyprefix: kombu's ``global_keyprefix`` on the source.
        exchange_types: exchange name -> type (``direct``, ``topic``, ``fanout``),
            to route ``unacked`` messages; an exchange not named is ``direct``.
    """

    def __init__(
        self,
        source: Any,
        channel: Channel,
        keyprefix: str = "",
        exchange_types: dict[str, str] | None = None,
    ) -> None:
        self.source = source
        self.channel = channel
        self.store: JobStore = channel.store
        self.keyprefix = keyprefix
        self.exchange_types = dict(exchange_types or {})
        self._tables: dict[str, list[tuple[str, str, str]]] = {}
        self._lock_token = uuid.uuid4().hex

    # -- reading the source ------------------------------------------------

    def _key(self, name: str) -> str:
        return self.keyprefix + name

    def bound_queues(self) -> list[str]:
        """The queues bound to the source's exchanges, Celery's own left out."""
        found: set[str] = set()
        head = self._key("_kombu.binding.")
        for key in self.source.scan_iter(match=_glob(head) + "*", count=1000):
            exchange = _text(key)[len(head) :]
            if exchange in INTERNAL_EXCHANGES:
                continue
            found.update(queue for _, _, queue in self._table(exchange))
        return sorted(q for q in found if q)

    def _table(self, exchange: str) -> list[tuple[str, str, str]]:
        table = self._tables.get(exchange)
        if table is None:
            rows = self.source.smembers(self._key(f"_kombu.binding.{exchange}"))
            table = [_binding(_text(r)) for r in rows]
            self._tables[exchange] = table
        return table

    def lists(self, queue: str) -> list[str]:
        """The source's lists of ``queue`` (every priority step) that hold messages."""
        names = [queue] + [f"{queue}{SEP}{step}" for step in range(1, 10)]
        with self.source.pipeline(transaction=False) as pipe:
            for name in names:
                pipe.llen(self._key(name))
            sizes = pipe.execute()
        return [n for n, size in zip(names, sizes, strict=True) if size]

    def route(self, exchange: str, routing_key: str) -> list[str]:
        """The queues a message published to ``exchange`` with ``routing_key`` went to."""
        if not exchange:
            return [routing_key] if routing_key else []
        kind = STANDARD_EXCHANGE_TYPES.get(self.exchange_types.get(exchange, "direct"))
        if kind is None:
            return []
        return sorted(kind(None).lookup(self._table(exchange), exchange, routing_key, None))

    def unacked(self) -> Iterator[tuple[str, bytes, dict[str, Any] | None, list[str]]]:
        """Each ``unacked`` entry: tag, raw entry, message (``None`` if unreadable), queues."""
        for tag, raw in self.source.hscan_iter(self._key("unacked"), count=500):
            message, queues = None, []
            try:
                message, exchange, routing_key = json.loads(raw)
                queues = self.route(exchange or "", routing_key or "")
            except (ValueError, TypeError):
                message = None
            yield _text(tag), raw, message if isinstance(message, dict) else None, queues

    def count(self, queues: Sequence[str], unacked: bool) -> dict[str, QueueCount]:
        """How many messages each queue has waiting (staging included) and unacked."""
        counts = {q: QueueCount(q) for q in queues}
        for q, c in counts.items():
            names = [*self.lists(q), q + STAGING]
            c.waiting = sum(int(self.source.llen(self._key(n))) for n in names)
        if unacked:
            for _tag, _raw, _message, routed in self.unacked():
                for q in routed:
                    if q in counts:
                        counts[q].unacked += 1
        return counts

    # -- moving ------------------------------------------------------------

    def run(self, queues: Sequence[str], unacked: bool = False) -> dict[str, QueueCount]:
        """Move every waiting message of ``queues`` (and, with ``unacked``, theirs).

        Raises:
            EmqError: another migration holds the source's lock.
        """
        counts = self.count(queues, unacked)
        self._lock()
        try:
            for q in queues:
                staging = self._key(q + STAGING)
                # What a stopped run left half-moved goes first (oldest at the right).
                left = list(reversed(self.source.lrange(staging, 0, -1)))
                if left:
                    self._move(q, left, staging, counts[q])
                for name in self.lists(q):
                    while True:
                        self._renew_lock()
                        with self.source.pipeline(transaction=False) as pipe:
                            for _ in range(BATCH):
                                pipe.rpoplpush(self._key(name), staging)
                            batch = [m for m in pipe.execute() if m is not None]
                        if batch:
                            self._move(q, batch, staging, counts[q])
                        if len(batch) < BATCH:
                            break
            if unacked:
                self._move_unacked(counts)
        finally:
            self._unlock()
        return counts

    def _move(self, queue: str, raws: list[bytes], staging: str, count: QueueCount) -> None:
        taken = self._enqueue(queue, raws, redelivered=False)
        count.moved += taken.moved
        count.already += taken.already
        with self.source.pipeline(transaction=False) as pipe:
            for raw, done in zip(raws, taken.done, strict=True):
                if done:
                    pipe.lrem(staging, -1, raw)
            pipe.execute()
        if taken.error:
            raise EmqError(
                f"{taken.failed} message(s) of queue {queue!r} were not enqueued "
                f"({taken.error}); they wait on the source in {staging!r}: "
                "run the command again"
            )

    def _move_unacked(self, counts: dict[str, QueueCount]) -> None:
        batch: list[tuple[str, bytes, list[str]]] = []
        for tag, _raw, message, routed in self.unacked():
            wanted = [q for q in routed if q in counts]
            if message is None or not wanted:
                continue  # not for these queues (or not readable): left as it is
            batch.append((tag, json.dumps(message).encode(), wanted))
            if len(batch) >= BATCH:
                self._settle_unacked(batch, counts)
                batch = []
        if batch:
            self._settle_unacked(batch, counts)

    def _settle_unacked(
        self, batch: list[tuple[str, bytes, list[str]]], counts: dict[str, QueueCount]
    ) -> None:
        self._renew_lock()
        by_queue: dict[str, list[int]] = {}
        for i, (_tag, _raw, queues) in enumerate(batch):
            for q in queues:
                by_queue.setdefault(q, []).append(i)
        done = [True] * len(batch)
        errors: list[str] = []
        for q, rows in by_queue.items():
            taken = self._enqueue(q, [batch[i][1] for i in rows], redelivered=True)
            counts[q].moved_unacked += taken.moved
            counts[q].already += taken.already
            for i, ok in zip(rows, taken.done, strict=True):
                done[i] = done[i] and ok
            if taken.error:
                errors.append(f"{taken.failed} of queue {q!r} ({taken.error})")
        with self.source.pipeline(transaction=False) as pipe:
            for (tag, _raw, _queues), ok in zip(batch, done, strict=True):
                if ok:
                    pipe.zrem(self._key("unacked_index"), tag)
                    pipe.hdel(self._key("unacked"), tag)
            pipe.execute()
        if errors:
            raise EmqError(
                "unacked messages were not enqueued: "
                + "; ".join(errors)
                + f"; they wait on the source in {self._key('unacked')!r}: run the command again"
            )

    def _enqueue(self, queue: str, raws: list[bytes], redelivered: bool) -> _Taken:
        """Enqueue the messages not taken in before, each with the record of its tag.

        One pipeline on the queue's keys, errors answered in place: a message
        whose script failed is neither a job nor recorded (``done`` false).
        """
        jobs = [self._job(raw, redelivered) for raw in raws]
        replies = take_in(
            self.store,
            queue,
            [
                (
                    job["tag"],
                    NewJob(
                        job["id"],
                        str(job["stored"]).encode(),
                        job["priority"],
                        job["budget"],
                        job["group"],
                        job["eta_ms"],
                        job["task_id"],
                    ),
                )
                for job in jobs
            ],
        )
        taken = _Taken()
        for reply in replies:
            if isinstance(reply, Exception):
                taken.done.append(False)
                taken.failed += 1
                taken.error = taken.error or str(reply)
            elif reply is None:
                taken.done.append(True)
                taken.already += 1
            elif reply in (Outcome.OK, Outcome.DUPLICATE):
                taken.done.append(True)
                taken.moved += 1
            else:
                taken.done.append(False)
                taken.failed += 1
                taken.error = taken.error or f"enqueue.lua answered {int(reply)}"
        if taken.moved and any(j["task"] for j in jobs):
            self.store.register(queue)
        return taken

    def _job(self, raw: bytes, redelivered: bool) -> dict[str, Any]:
        """What ``Channel._put`` would enqueue for this stock message."""
        try:
            message = json.loads(raw)
            if not isinstance(message, dict) or not isinstance(message.get("properties"), dict):
                raise ValueError("not a kombu message")
        except ValueError:
            # Enqueued as it is: the consumer dead-letters it as malformed.
            tag = hashlib.sha1(raw).hexdigest()
            text = raw.decode("utf-8", "replace")
            return dict(tag=tag, id=tag, stored=text, priority=0, budget=UNSET, group="",
                        eta_ms=None, task_id="", task=False)  # fmt: skip
        props = message["properties"]
        tag = str(props.get("delivery_tag") or hashlib.sha1(raw).hexdigest())
        job_id = str(props.get(JOB_ID_PROPERTY) or tag)
        headers = message.get("headers") or {}
        if redelivered:
            headers["redelivered"] = True
            message["headers"] = headers
            if isinstance(props.get("delivery_info"), dict):
                props["delivery_info"]["redelivered"] = True
        budget = messages.budget(headers[BUDGET_OPTION]) if BUDGET_OPTION in headers else UNSET
        group = headers.get(GROUP_HEADER) or ""
        task = "task" in headers
        eta_ms = messages.eta_ms(headers.get("eta")) if task else None
        task_id = headers.get("id") if eta_ms is not None else None
        stored = {
            **message,
            "properties": {k: v for k, v in props.items() if k not in messages.KEYED},
        }
        return {
            "tag": tag,
            "id": job_id,
            "stored": json.dumps(stored),
            "priority": self.channel._get_message_priority(message, reverse=False),
            "budget": budget,
            "group": group if isinstance(group, str) else str(group),
            "eta_ms": eta_ms,
            "task_id": task_id if isinstance(task_id, str) else "",
            "task": task,
        }

    # -- one migration at a time -------------------------------------------

    @property
    def _lock_key(self) -> str:
        return self._key("_emq.migrate.lock")

    def _lock(self) -> None:
        if not self.source.set(self._lock_key, self._lock_token, nx=True, ex=LOCK_S):
            raise EmqError(
                "another `emq migrate` is moving this source's messages (lock "
                f"{self._lock_key!r}, expires within {LOCK_S} s of its last batch)"
            )

    def _renew_lock(self) -> None:
        if _text(self.source.get(self._lock_key) or b"") != self._lock_token:
            raise EmqError("this migration lost its lock on the source; run it again")
        self.source.expire(self._lock_key, LOCK_S)

    def _unlock(self) -> None:
        if _text(self.source.get(self._lock_key) or b"") == self._lock_token:
            self.source.delete(self._lock_key)


def _binding(row: str) -> tuple[str, str, str]:
    parts = row.split(SEP)
    while len(parts) < 3:
        parts.insert(0, "")
    return parts[0], parts[1], parts[2]


def _glob(text: str) -> str:
    """Escape ``text`` for a SCAN MATCH pattern."""
    return "".join("\\" + c if c in "*?[]\\" else c for c in text)


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


#: URL schemes of the stock transport's servers.
SOURCE_SCHEMES = ("redis://", "rediss://", "unix://")


def migrate_app(
    app: Any,
    source_url: str,
    keyprefix: str = "",
    queues: Sequence[str] = (),
    unacked: bool = False,
    dry_run: bool = False,
) -> list[QueueCount]:
    """Move (or, with ``dry_run``, count) the stock broker's waiting tasks into ``app``'s broker.

    ``queues`` defaults to those bound on the source and those the app declares.

    Raises:
        EmqError: the source is not a stock Redis URL, the app's broker is not
            emq://, or another migration runs.
    """
    import redis

    if not source_url.startswith(SOURCE_SCHEMES):
        raise EmqError(
            f"--from takes the stock transport's URL (redis://, rediss:// or unix://), "
            f"not {source_url!r}"
        )
    declared = list(app.amqp.queues.values())
    exchange_types = {q.exchange.name: q.exchange.type for q in declared if q.exchange is not None}
    source = redis.Redis.from_url(source_url)
    try:
        with app.connection_for_write() as conn:
            channel = conn.default_channel
            if not isinstance(channel, Channel):
                raise EmqError(f"the app's broker {conn.as_uri()} is not a celery_emq transport")
            migration = Migration(source, channel, keyprefix, exchange_types)
            names = list(queues) or sorted({*migration.bound_queues(), *(q.name for q in declared)})
            if dry_run:
                counts = migration.count(names, unacked)
            else:
                counts = migration.run(names, unacked)
    except redis.RedisError as exc:
        raise EmqError(f"cannot read the source {source_url}: {exc}") from None
    finally:
        source.close()
    return list(counts.values())
