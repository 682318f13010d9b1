"""What every part of the job store shares: the client, its scripts, the queues' keys."""

from __future__ import annotations

from typing import Any

from celery_emq.store.keys import QueueKeys
from celery_emq.store.scripts import Scripts

__all__ = ["COUNTERS", "METRICS", "PURGE_BATCH", "SOON_TTL_MS", "StoreBase"]

#: Jobs one ``purge`` script call deletes before the store calls it again.
PURGE_BATCH = 1000
#: A queue's ``soon`` marker ends this long after its push (as enqueue.lua's).
SOON_TTL_MS = 60_000
#: The counters every queue keeps (``<p>:{q}:metrics:<name>``, field ``count``).
METRICS: tuple[str, ...] = ("completed", "recovered", "stalled", "failed", "retried")
#: Every counter a queue may hold: those and ``fenced`` (settles that named a claim
#: other than the live one, by verb), which appears only once one is counted.
COUNTERS: tuple[str, ...] = (*METRICS, "fenced")


class StoreBase:
    """What every part of the job store shares: the client, its scripts, the queues' keys.

    Args:
        client: a redis-py client (bytes replies, no key prefixing).
        prefix: the key prefix (``EmqOptions.key_prefix``).
        lease_ms: how long a claim holds a job.
        wait_replicas: how many replicas must confirm each publish and settle
            (0: none asked; see :meth:`confirm_replicas`).
        wait_timeout_ms: how long one confirmation may wait.
    """

    def __init__(
        self,
        client: Any,
        prefix: str,
        lease_ms: int,
        wait_replicas: int = 0,
        wait_timeout_ms: int = 1000,
    ) -> None:
        self.client = client
        self.prefix = prefix
        self.lease_ms = lease_ms
        self.wait_replicas = wait_replicas
        self.wait_timeout_ms = wait_timeout_ms
        self.scripts = Scripts(client)
        self._keys: dict[str, QueueKeys] = {}

    def keys(self, queue: str) -> QueueKeys:
        """Return (and cache) the keys of one queue."""
        k = self._keys.get(queue)
        if k is None:
            k = self._keys[queue] = QueueKeys(self.prefix, queue)
        return k

    def node_of(self, queue: str) -> str:
        """Name the server holding ``queue``'s keys (``host:port``): what a fault takes down.

        On a Cluster, the master serving the queue's slot as the client last
        learnt it (``?`` if no node is known to serve it); else the one server.
        """
        locate = getattr(self.client, "get_node_from_key", None)
        if locate is not None:
            try:
                return str(locate(self.keys(queue).active).name)
            except Exception:
                return "?"
        pool = getattr(self.client, "connection_pool", None)
        kwargs = getattr(pool, "connection_kwargs", {})
        if kwargs.get("host"):
            return f"{kwargs['host']}:{kwargs.get('port', 6379)}"
        return str(getattr(pool, "service_name", None) or kwargs.get("path") or "redis")

    @property
    def one_server(self) -> bool:
        """Whether every key lies on one server (not a Cluster): a script may then
        name keys of any slot."""
        return not hasattr(self.client, "get_node_from_key")

    def server_ms(self) -> int:
        """Return the Redis server's clock in ms: the time every deadline is read on."""
        seconds, micros = self.client.time()
        return int(seconds) * 1000 + int(micros) // 1000
