"""``tally.lua`` on an asyncio redis-py client: the queue lengths Flower shows.

Flower reads its broker's queues from its own event loop, through an asyncio
client (one server, the master the sentinels name, or a Redis Cluster): the
script is registered on that client, so Flower runs no Lua of its own.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

from celery_emq.store.calls import read_tally, tally_keys
from celery_emq.store.keys import QueueKeys
from celery_emq.store.loader import script_source
from celery_emq.store.reads import LANE_PAGE

__all__ = ["AsyncTally"]


class AsyncTally:
    """Each queue's counts, read on an asyncio client.

    Args:
        client: a ``redis.asyncio`` client (``Redis`` or ``RedisCluster``).
        prefix: the key prefix (``EmqOptions.key_prefix``).
        pipelined: send the queues' calls in one pipeline (one round trip);
            on a cluster, where each queue may sit on another master, the
            calls go at once, each to the master of its queue's slot.
    """

    def __init__(self, client: Any, prefix: str, pipelined: bool = True) -> None:
        self.client = client
        self.prefix = prefix
        self.pipelined = pipelined

    async def counts(self, queues: Sequence[str]) -> list[dict[str, int]]:
        """Return each queue's ``pending`` (lanes included), ``active``, ``delayed``, ``dead``.

        One script call per queue (and per :data:`LANE_PAGE` further lanes).
        """
        keys = [QueueKeys(self.prefix, q) for q in queues]
        tally = self.client.register_script(script_source("tally"))
        replies = await self._first_pages(tally, keys)
        out = []
        for k, reply in zip(keys, replies, strict=True):
            counts, page = read_tally(reply)
            lane_sizes = [n for _, n, _ in page]
            while len(lane_sizes) < counts["lanes"] and len(page) == LANE_PAGE:
                more = [len(lane_sizes), LANE_PAGE, 0]
                page = read_tally(await tally(tally_keys(k), more))[1]
                lane_sizes += [n for _, n, _ in page]
            counts["pending"] += sum(lane_sizes)
            del counts["lanes"]
            out.append(counts)
        return out

    async def _first_pages(self, tally: Any, keys: list[QueueKeys]) -> list[Any]:
        first = [0, LANE_PAGE, 0]
        if not self.pipelined:
            return list(await asyncio.gather(*(tally(tally_keys(k), first) for k in keys)))
        async with self.client.pipeline() as pipe:
            for k in keys:
                await tally(tally_keys(k), first, client=pipe)
            return list(await pipe.execute())
