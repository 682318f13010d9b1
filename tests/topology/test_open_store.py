"""open_store on Sentinel and Cluster: the store's own client reaches what the channel wrote."""

from __future__ import annotations

import uuid
from typing import Any

from celery import Celery
from kombu import Connection, Exchange, Producer, Queue

import celery_emq  # noqa: F401  (registers emq://)
from celery_emq.ops.appstore import open_store
from celery_emq.transport.channel import Channel

from .cluster_servers import Cluster
from .sentinel_servers import SentinelTopology


def publish(url: str, topts: dict[str, Any], name: str, n: int) -> None:
    q = Queue(name, Exchange(name, "direct"), routing_key=name)
    with Connection(url, transport_options=topts) as conn:
        producer = Producer(conn.channel())
        for i in range(n):
            producer.publish({"i": i}, exchange=q.exchange, routing_key=name, declare=[q])


def app_on(url: str, topts: dict[str, Any]) -> Celery:
    app = Celery("topo", broker=url, set_as_current=False)
    app.conf.broker_transport_options = topts
    return app


def no_channel(monkeypatch: Any) -> None:
    def refuse(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("a kombu Channel was built")

    monkeypatch.setattr(Channel, "__init__", refuse)


def test_open_store_on_sentinel_reads_the_master(
    sentinel_topology: SentinelTopology, monkeypatch: Any
) -> None:
    prefix = f"t{uuid.uuid4().hex[:10]}:"
    topts = {"master_name": sentinel_topology.master_name, "global_keyprefix": prefix}
    url = sentinel_topology.broker_url(db=3)
    publish(url, topts, "sq", 3)
    no_channel(monkeypatch)
    with open_store(app_on(url, topts)) as (store, _options):
        assert store.counts("sq")["pending"] == 3
        assert store.client.connection_pool.connection_kwargs["db"] == 3
        assert store.purge("sq") == 3


def test_open_store_on_a_cluster_reads_every_master(
    redis_cluster: Cluster, cluster_prefix: str, monkeypatch: Any
) -> None:
    topts = {"global_keyprefix": cluster_prefix}
    names = [f"cq{i}" for i in range(6)]
    for name in names:
        publish(redis_cluster.url, topts, name, 2)
    no_channel(monkeypatch)
    with open_store(app_on(redis_cluster.url, topts)) as (store, _options):
        assert [store.counts(n)["pending"] for n in names] == [2] * 6
        assert len({store.node_of(n) for n in names}) > 1
