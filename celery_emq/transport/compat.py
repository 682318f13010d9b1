"""What the supported Celery and kombu releases (5.4 to 5.7) do differently, in one place.

The transport's channel subclasses kombu's Redis ``Channel`` and leans on a few
of its attributes that only recent kombu has. :class:`ChannelCompat` comes
first in the channel's bases and gives each of them the kombu 5.7 behaviour on
every supported release. :func:`sentinel_connection_classes` mends redis-py
5.0.0's Sentinel connections, which break pub/sub.
"""

from __future__ import annotations

import inspect
from typing import Any

from kombu.transport import redis as kombu_redis
from kombu.transport.base import to_rabbitmq_queue_arguments

__all__ = ["ChannelCompat", "sentinel_connection_classes"]

_KOMBU_OPTIONS: tuple[str, ...] = tuple(kombu_redis.Channel.from_transport_options)


class ChannelCompat:
    """kombu 5.7's Redis channel behaviour that older kombu lacks."""

    #: The BRPOP wait in seconds. kombu 5.6 and later set it on each channel
    #: (from the transport's ``polling_interval``), hiding this default; kombu
    #: 5.4 and 5.5 always wait 1 s.
    brpop_timeout: Any = 1

    #: The name each of the channel's connections gives itself (``CLIENT
    #: SETNAME``), from the ``client_name`` transport option. kombu 5.6 added
    #: the option; kombu 5.4 and 5.5 ignore it.
    client_name: Any = None
    from_transport_options: Any = _KOMBU_OPTIONS + (
        () if "client_name" in _KOMBU_OPTIONS else ("client_name",)
    )

    def _connparams(self, asynchronous: bool = False) -> dict[str, Any]:
        """kombu's connection parameters, with ``client_name`` where kombu leaves it out."""
        parent: Any = super()
        params: dict[str, Any] = parent._connparams(asynchronous)
        if self.client_name is not None:
            params.setdefault("client_name", self.client_name)
        return params

    def prepare_queue_arguments(self, arguments: Any, **kwargs: Any) -> Any:
        """Turn a queue's ``expires``/``message_ttl``/... into ``x-*`` declare arguments.

        kombu 5.7's Redis channel does this; before it, kombu's virtual channels
        dropped these options, so ``Queue(expires=...)`` (Celery's reply and
        event queues) declared a queue that never expired.
        """
        return to_rabbitmq_queue_arguments(arguments, **kwargs)

    def _flush_brpop_reauth(self) -> None:
        """Send a pending streaming re-auth on the idle BRPOP connection.

        kombu 5.7 does this; older kombu does no streaming re-authentication,
        so there is nothing to send.
        """
        flush = getattr(super(), "_flush_brpop_reauth", None)
        if flush is not None:
            flush()


def sentinel_connection_classes() -> tuple[type[Any], type[Any]]:
    """redis-py's Sentinel-managed connection classes (plain and TLS), pub/sub-capable.

    redis-py 5.0.0's ``SentinelManagedConnection.read_response`` does not take
    the ``push_request`` argument its pub/sub passes (5.0.1 added it), so
    kombu's fanout (remote control, events) raised ``TypeError`` through
    Sentinel. There, a subclass takes it and hands it to the connection below,
    keeping redis-py's rule: a master that now answers ``READONLY`` was demoted,
    so the connection drops and asks the sentinels again.
    """
    from redis.exceptions import ConnectionError, ReadOnlyError
    from redis.sentinel import SentinelManagedConnection, SentinelManagedSSLConnection

    if "push_request" in inspect.signature(SentinelManagedConnection.read_response).parameters:
        return SentinelManagedConnection, SentinelManagedSSLConnection

    class PushingSentinelManagedConnection(SentinelManagedConnection):
        def read_response(  # type: ignore[override]
            self,
            disable_decoding: bool = False,
            *,
            disconnect_on_error: bool = False,
            push_request: bool = False,
        ) -> Any:
            below: Any = super(SentinelManagedConnection, self)
            try:
                return below.read_response(
                    disable_decoding=disable_decoding,
                    disconnect_on_error=disconnect_on_error,
                    push_request=push_request,
                )
            except ReadOnlyError:
                if self.connection_pool.is_master:
                    self.disconnect()  # type: ignore[no-untyped-call]
                    raise ConnectionError("The previous master is now a replica") from None
                raise

    class PushingSentinelManagedSSLConnection(
        PushingSentinelManagedConnection, SentinelManagedSSLConnection
    ):
        pass

    return PushingSentinelManagedConnection, PushingSentinelManagedSSLConnection
