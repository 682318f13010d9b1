"""Flower's broker client for emq://, on every redis-py the project supports."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

import celery_emq  # noqa: F401  (registers emq://)


def test_queue_lengths_close_a_client_without_aclose(redis_url: str, prefix: str) -> None:
    # redis-py 5.0.0's asyncio client has close() only (aclose() came in 5.0.1).
    pytest.importorskip("flower")
    from flower.utils.broker import Broker

    from celery_emq.ops.flower import register

    assert register()
    broker = Broker(
        redis_url.replace("redis://", "emq://", 1), broker_options={"global_keyprefix": prefix}
    )
    real = broker.redis
    closed: list[bool] = []

    class ClientOf500:
        def __getattr__(self, name: str) -> Any:
            if name == "aclose":
                raise AttributeError(name)
            return getattr(real, name)

        async def close(self) -> None:
            closed.append(True)
            aclose = getattr(real, "aclose", None)
            await (aclose() if aclose is not None else real.close())

    broker.redis = ClientOf500()
    [info] = asyncio.run(broker.queues(["q"]))
    assert (info["name"], info["messages"]) == ("q", 0)
    assert closed == [True]
