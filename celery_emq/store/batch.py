"""Script calls on one client sent together: one round trip for the lot."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from redis.cluster import RedisCluster
from redis.exceptions import (
    AskError,
    ClusterDownError,
    ConnectionError,
    MovedError,
    NoScriptError,
    RedisClusterException,
    RedisError,
    TimeoutError,
    TryAgainError,
)

from celery_emq.store.calls import (
    ACK_BATCH,
    ack_call,
    ack_outcomes,
    enqueue_call,
    enqueue_many_calls,
    enqueue_many_outcomes,
    oldest_call,
    outcome_of,
    promote_keys,
    read_oldest,
    read_tally,
    start_call,
    tally_keys,
)
from celery_emq.store.keys import QueueKeys
from celery_emq.store.loader import Loaded
from celery_emq.store.outcomes import UNSET, NewJob, Outcome, Unset

__all__ = ["Batch"]

#: Replies of a call (on a cluster) that did not reach the master of its slot:
#: it is run again alone through the cluster client, which follows the change.
_MISSED = (MovedError, AskError, TryAgainError, ClusterDownError, ConnectionError, TimeoutError)


class Batch:
    """Script calls on one client sent together: one round trip for the lot.

    A non-transactional pipeline of ``EVALSHA`` calls: each script stays atomic
    on its own, and one call's error (or a script the server lost after a
    ``SCRIPT FLUSH``, a restart or a failover, which is loaded and run again)
    leaves the others' results standing. redis-py's pipeline would ask ``SCRIPT
    EXISTS`` first, a round trip of its own on every send: the calls here go
    as plain ``EVALSHA`` instead.

    Each method queues one transition and returns a handle; :meth:`execute`
    sends them all, after which :meth:`result` returns a handle's outcome or
    raises the error its call met.
    """

    def __init__(self, scripts: Loaded) -> None:
        self._scripts = scripts
        self._calls: list[tuple[str, list[str], list[Any]]] = []
        self._replies: list[Any] = []
        #: Per handle: the indices of its calls and how to read their replies.
        self._handles: list[tuple[list[int], Callable[[list[Any]], Any]]] = []
        #: Replicas that confirmed the last :meth:`execute`'s writes (None: not asked).
        self.confirmed: int | None = None

    def __len__(self) -> int:
        return len(self._handles)

    def _add(self, calls: list[tuple[str, list[str], list[Any]]], read: Callable[..., Any]) -> int:
        first = len(self._calls)
        self._calls.extend(calls)
        self._handles.append((list(range(first, len(self._calls))), read))
        return len(self._handles) - 1

    def enqueue(
        self,
        k: QueueKeys,
        job_id: str,
        payload: str | bytes,
        priority: int,
        now_ms: int | None,
        ttl_ms: int = 0,
        max_stalled: int | Unset | None = UNSET,
        group: str = "",
        eta_ms: int | None = None,
        task_id: str = "",
    ) -> int:
        """Queue :meth:`Scripts.enqueue`; its result is an :class:`Outcome`."""
        keys, args = enqueue_call(
            k, job_id, payload, priority, now_ms, ttl_ms, max_stalled, group, eta_ms, task_id
        )
        return self._add(
            [("enqueue", keys, args)], lambda replies: outcome_of(replies[0], "enqueue")
        )

    def enqueue_many(
        self, k: QueueKeys, jobs: Sequence[NewJob], now_ms: int | None, ttl_ms: int = 0
    ) -> int:
        """Queue :meth:`Scripts.enqueue_many`; its result is one :class:`Outcome` per job."""
        calls = enqueue_many_calls(k, jobs, now_ms, ttl_ms)

        def read(replies: list[Any]) -> list[Outcome]:
            return [
                o
                for reply, (_keys, _args, n) in zip(replies, calls, strict=True)
                for o in enqueue_many_outcomes(reply, n)
            ]

        return self._add([("enqueue_many", keys, args) for keys, args, _n in calls], read)

    def start(self, k: QueueKeys, job_id: str, token: str, received: bool = False) -> int:
        """Queue :meth:`Scripts.start`; its result is an :class:`Outcome`."""
        return self._add(
            [("start", *start_call(k, job_id, token, received))],
            lambda replies: outcome_of(replies[0], "start"),
        )

    def ack(self, k: QueueKeys, claims: Sequence[tuple[str, str]]) -> int:
        """Queue :meth:`Scripts.ack`; its result is one :class:`Outcome` per claim."""
        chunks = [claims[i : i + ACK_BATCH] for i in range(0, len(claims), ACK_BATCH)]

        def read(replies: list[Any]) -> list[Outcome]:
            return [
                o
                for reply, chunk in zip(replies, chunks, strict=True)
                for o in ack_outcomes(reply, len(chunk))
            ]

        return self._add([("ack", *ack_call(k, chunk)) for chunk in chunks], read)

    def promote(self, k: QueueKeys, limit: int) -> int:
        """Queue :meth:`Scripts.promote` of due jobs; its result is (promoted, waiting, next_due).

        ``next_due`` is in how many ms the earliest job still delayed is due (-1: none).
        """
        return self._add(
            [("promote", promote_keys(k), ["", limit])],
            lambda replies: (int(replies[0][0]), bool(replies[0][1]), int(replies[0][2])),
        )

    def tally(self, k: QueueKeys, offset: int, limit: int, heads: bool = False) -> int:
        """Queue :meth:`Scripts.tally`; its result is (counts, one page of lanes)."""
        return self._add(
            [("tally", tally_keys(k), [offset, limit, 1 if heads else 0])],
            lambda replies: read_tally(replies[0]),
        )

    def oldest(
        self, k: QueueKeys, lane_offset: int, lane_limit: int, active_offset: int, active_limit: int
    ) -> int:
        """Queue :meth:`Scripts.oldest`; its result is (enqueued_ms, claimed_ms)."""
        call = oldest_call(k, lane_offset, lane_limit, active_offset, active_limit)
        return self._add([("oldest", *call)], lambda replies: read_oldest(replies[0]))

    def execute(self, confirm: Callable[[Any], None] | None = None) -> None:
        """Send every queued call in one round trip.

        Args:
            confirm: given, it is handed the pipeline once the calls are queued
                on it and queues one ``WAIT`` there, on the connection that
                carries the writes (:meth:`JobStore.confirm_replicas`);
                :attr:`confirmed` is then how many replicas acknowledged them.

        Raises:
            redis.RedisError: the round trip itself failed (nothing is known
                of any call: each may or may not have run).
        """
        self.confirmed = None
        if not self._calls:
            return
        client = self._scripts.client
        if isinstance(client, RedisCluster):
            try:
                self._replies = self._execute_by_node(client, confirm)
            except RedisClusterException as exc:
                raise ConnectionError(f"Redis Cluster: {exc}") from exc
            return
        replies = self._send(self._calls, confirm, load=False)
        lost = [i for i, reply in enumerate(replies) if isinstance(reply, NoScriptError)]
        if lost:
            # The server lost its scripts (a restart, a failover, SCRIPT FLUSH):
            # run those calls again by their text, in one more round trip on
            # one connection, which the WAIT (if any) then covers too.
            try:
                again = self._send([self._calls[i] for i in lost], confirm, load=True)
            except RedisError as exc:
                again = [exc] * len(lost)
                self.confirmed = 0 if confirm is not None else None
            for i, reply in zip(lost, again, strict=True):
                replies[i] = reply
        self._replies = replies

    def _execute_by_node(
        self, client: RedisCluster, confirm: Callable[[Any], None] | None
    ) -> list[Any]:
        """One pipeline per master, each call to the master of its keys' slot.

        redis-py's cluster pipeline asks the server for the keys of every
        ``EVALSHA`` (``COMMAND GETKEYS``), a command more per call; and a
        ``WAIT`` counts the writes of its own connection only, so each master's
        pipeline carries its own (:attr:`confirmed` is the fewest replicas any
        confirmed). A call whose slot moved, or whose master did not answer, is
        run again alone through the cluster client, outside any ``WAIT`` (so
        counted unconfirmed): every batched transition is safe to repeat (a
        repeated ack finds nothing).
        """
        by_node: dict[str, list[int]] = {}
        nodes: dict[str, Any] = {}
        for i, (_name, keys, _args) in enumerate(self._calls):
            node = client.get_node_from_key(keys[0])  # type: ignore[no-untyped-call]
            by_node.setdefault(node.name, []).append(i)
            nodes[node.name] = node
        replies: list[Any] = [None] * len(self._calls)
        for name, indices in by_node.items():
            server = client.get_redis_connection(nodes[name])
            calls = [self._calls[i] for i in indices]
            try:
                out = self._send(calls, confirm, load=False, client=server)
                lost = [j for j, reply in enumerate(out) if isinstance(reply, NoScriptError)]
                if lost:
                    again = self._send([calls[j] for j in lost], confirm, load=True, client=server)
                    for j, reply in zip(lost, again, strict=True):
                        out[j] = reply
            except RedisError as exc:
                out = [exc] * len(indices)
            for i, reply in zip(indices, out, strict=True):
                replies[i] = reply
        for i, reply in enumerate(replies):
            if isinstance(reply, _MISSED):
                name, keys, args = self._calls[i]
                try:
                    replies[i] = self._scripts.run(name, keys, args)
                except RedisError as exc:
                    replies[i] = exc
                if confirm is not None:
                    self.confirmed = 0
        return replies

    def _send(
        self,
        calls: list[tuple[str, list[str], list[Any]]],
        confirm: Callable[[Any], None] | None,
        load: bool,
        client: Any = None,
    ) -> list[Any]:
        scripts = self._scripts.registered
        with (client or self._scripts.client).pipeline(transaction=False) as pipe:
            for name, keys, args in calls:
                if load:
                    # EVAL runs the script's text, and caches it for the next EVALSHA.
                    pipe.execute_command("EVAL", scripts[name].script, len(keys), *keys, *args)
                else:
                    pipe.execute_command("EVALSHA", scripts[name].sha, len(keys), *keys, *args)
            if confirm is not None:
                confirm(pipe)
            replies: list[Any] = pipe.execute(raise_on_error=False)
        if confirm is not None:
            reply = replies.pop()
            # The writes of both round trips count: the fewer replicas that hold all.
            n = reply if isinstance(reply, int) else 0
            self.confirmed = n if self.confirmed is None else min(self.confirmed, n)
        return replies

    def result(self, handle: int) -> Any:
        """Return what the call queued as ``handle`` answered, or raise its error."""
        indices, read = self._handles[handle]
        replies = [self._replies[i] for i in indices]
        for reply in replies:
            if isinstance(reply, Exception):
                raise reply
        return read(replies)
