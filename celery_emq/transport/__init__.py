"""The kombu transport: Transport, Channel and QoS on the store, and what any
kombu consumer needs to keep its claims (the lease keeper, the settle batcher,
the sweeper thread).

``celery_emq.transport:Transport`` is the path kombu loads (the ``emq://``
aliases name it). The classes are read from their modules when first asked
for, so importing one of this package's modules does not import them all.
"""

from __future__ import annotations

from typing import Any

__all__ = ["Channel", "QoS", "Transport"]


def __getattr__(name: str) -> Any:
    if name == "Transport":
        from celery_emq.transport.transport import Transport

        return Transport
    if name == "Channel":
        from celery_emq.transport.channel import Channel

        return Channel
    if name == "QoS":
        from celery_emq.transport.qos import QoS

        return QoS
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
