"""``take_in``: enqueue a message moved from another broker, once per source delivery tag.

One script per message: ``enqueue.lua`` wrapped with the record of the source's
delivery tag in the queue's ``migrated`` set (:data:`MIGRATED_TTL_MS`). A tag
recorded before is not enqueued again, even if its job already ran, and a tag is
recorded only when its message is a job, in the same script: a message moved
twice is one job (see :mod:`celery_emq.ops.migrate`).

The wrapper is built from ``enqueue.lua`` here (the one script not in
``lua/``): KEYS are enqueue's and the queue's ``migrated`` set; ARGV are
enqueue's and the tag, the time, the set's TTL. It answers -1 for a tag
recorded before (nothing enqueued), else enqueue's answer.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from redis.cluster import RedisCluster

from celery_emq.errors import ScriptContractError
from celery_emq.store.calls import enqueue_call, outcome_of, text
from celery_emq.store.codec import pack
from celery_emq.store.jobstore import JobStore
from celery_emq.store.loader import script_source
from celery_emq.store.outcomes import NewJob, Outcome

__all__ = ["MIGRATED_TTL_MS", "TAKE_IN", "take_in"]

#: How long a queue remembers the delivery tags it took in.
MIGRATED_TTL_MS = 7 * 86_400_000
#: The answer of a tag recorded before.
_ALREADY = -1

TAKE_IN = f"""local function enqueue()
{script_source("enqueue")}
end
local migrated, tag = KEYS[#KEYS], ARGV[#ARGV - 2]
if redis.call('ZSCORE', migrated, tag) then
  return {_ALREADY}
end
local done = enqueue()
if done == {int(Outcome.OK)} or done == {int(Outcome.DUPLICATE)} then
  redis.call('ZADD', migrated, ARGV[#ARGV - 1], tag)
  redis.call('PEXPIRE', migrated, ARGV[#ARGV])
end
return done
"""


def take_in(
    store: JobStore, queue: str, jobs: Sequence[tuple[str, NewJob]]
) -> list[Outcome | Exception | None]:
    """Enqueue each job not taken in before under its source tag; one answer per job.

    Each job's ``payload`` is the message's JSON text. The calls go in one
    pipeline on the queue's keys (one hash slot: on a Redis Cluster, to its
    master), after a ``SCRIPT LOAD`` on that server. A call that meets a moved
    slot there fails in place, like any other error.

    Returns:
        Per job, in order: enqueue's :class:`Outcome`, ``None`` when its tag
        was taken in before (nothing enqueued), or the error its call met (a
        ``redis.RedisError``, or :class:`ScriptContractError` for an answer no
        script gives).
    """
    k = store.keys(queue)
    server = _server_of(store.client, k.migrated)
    sha = text(server.script_load(TAKE_IN))
    now_ms = store.server_ms()
    with server.pipeline(transaction=False) as pipe:
        for tag, job in jobs:
            keys, args = enqueue_call(
                k,
                job.id,
                pack(job.payload),
                job.priority,
                None,
                0,
                job.max_stalled,
                job.group,
                job.eta_ms,
                job.task_id,
            )
            pipe.evalsha(sha, len(keys) + 1, *keys, k.migrated, *args, tag, now_ms, MIGRATED_TTL_MS)
        replies = pipe.execute(raise_on_error=False)
    return [_read(reply) for reply in replies]


def _read(reply: Any) -> Outcome | Exception | None:
    if isinstance(reply, Exception):
        return reply
    if isinstance(reply, int) and reply == _ALREADY:
        return None
    try:
        return outcome_of(reply, "enqueue")
    except ScriptContractError as exc:
        return exc


def _server_of(client: Any, key: str) -> Any:
    """The client of the server holding ``key``: on a cluster, its slot's master.

    redis-py's cluster pipeline takes no ``EVALSHA``; a queue's keys share one
    slot, so a batch goes in one plain pipeline to that master.
    """
    if isinstance(client, RedisCluster):
        node = client.get_node_from_key(key)  # type: ignore[no-untyped-call]
        return client.get_redis_connection(node)
    return client
