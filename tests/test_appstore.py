"""Opening an app's job store: no kombu channel, the client the channel would build."""

from __future__ import annotations

import ssl
from typing import Any

import pytest
import redis
from celery import Celery
from kombu import Connection
from redis.sentinel import SentinelManagedConnection, SentinelManagedSSLConnection

from celery_emq.errors import EmqError, InvalidOptionError
from celery_emq.ops.appstore import AppStore, endpoint_of, open_store
from celery_emq.options import EmqOptions
from celery_emq.store.connect import KEEPALIVE_OPTIONS, connect, store_timeout_s
from celery_emq.store.jobstore import JobStore
from celery_emq.transport.channel import Channel


def test_open_store_reads_the_queues_without_a_kombu_channel(
    app: Celery, store: JobStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    store.enqueue("q", "a", "{}")
    store.register("q")

    def no_channel(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("a kombu Channel was built")

    monkeypatch.setattr(Channel, "__init__", no_channel)
    with open_store(app) as (opened, options):
        assert opened.prefix == store.prefix
        assert options.key_prefix == store.prefix
        assert opened.queues() == ["q"]
        assert opened.counts("q")["pending"] == 1
        pool = opened.client.connection_pool
        assert pool._created_connections == 1  # type: ignore[attr-defined]
    # Closed on exit: the connection it made is gone.
    assert all(c._sock is None for c in pool._available_connections)  # type: ignore[attr-defined]


def test_the_store_client_takes_the_channel_options(app: Celery) -> None:
    app.conf.broker_transport_options = {
        **app.conf.broker_transport_options,
        "renew_interval_ms": 2000,
        "socket_connect_timeout": 3,
        "command_retries": 2,
        "client_name": "ops",
    }
    with open_store(app) as (opened, options):
        kwargs = opened.client.connection_pool.connection_kwargs
        assert kwargs["socket_timeout"] == 2.0 == store_timeout_s(options, 10.0)
        assert kwargs["socket_connect_timeout"] == 3
        assert kwargs["socket_keepalive"] is True
        assert kwargs["socket_keepalive_options"] == KEEPALIVE_OPTIONS
        assert kwargs["client_name"] == "ops"
        assert kwargs["retry"].get_retries() == 2


def test_a_broker_that_is_not_emq_is_refused_by_name() -> None:
    app = Celery("other", broker="redis://127.0.0.1:6379/5", set_as_current=False)
    with pytest.raises(EmqError, match="not a celery_emq transport"):
        with open_store(app):
            pass


def test_refused_credentials_are_an_authentication_error(app: Celery) -> None:
    app.conf.broker_url = app.conf.broker_url.replace("://", "://nobody:wrong@", 1)
    source = AppStore(app)
    with pytest.raises(redis.AuthenticationError):
        source.get().queues()
    source.reset()


@pytest.mark.parametrize(
    ("url", "expected"),
    [
        ("emq://u:p%40ss@h:1234/3", dict(host="h", port=1234, db=3, username="u", password="p@ss")),
        ("emq://h", dict(host="h", port=6379, db=0, username=None, password=None, path=None)),
        ("emq+socket:///tmp/r.sock", dict(path="/tmp/r.sock", db=0)),
        ("emq+socket://:pw@/tmp/r.sock", dict(path="/tmp/r.sock", password="pw")),
    ],
)
def test_an_endpoint_reads_the_url_as_kombu_does(url: str, expected: dict[str, Any]) -> None:
    endpoint = endpoint_of(Connection(url))
    assert endpoint.target.kind == "single"
    for name, value in expected.items():
        assert getattr(endpoint, name) == value, name


def test_a_unix_socket_store_connects_by_path() -> None:
    endpoint = endpoint_of(Connection("emq+socket:///tmp/r.sock", transport_options={}))
    store, close = connect(endpoint, EmqOptions())
    kwargs = store.client.connection_pool.connection_kwargs
    assert kwargs["path"] == "/tmp/r.sock"
    assert "host" not in kwargs and "socket_keepalive" not in kwargs
    assert store.client.connection_pool.connection_class is redis.UnixDomainSocketConnection
    close()


@pytest.mark.parametrize("url", ["emqs://h:6380/1", "emq://h:6380/1"])
def test_tls_comes_from_the_url_or_broker_use_ssl(url: str) -> None:
    options = {"ssl_cert_reqs": ssl.CERT_REQUIRED, "ssl_ca_certs": "/ca.crt"}
    endpoint = endpoint_of(Connection(url, ssl=options))
    store, close = connect(endpoint, EmqOptions())
    pool = store.client.connection_pool
    assert pool.connection_class is redis.SSLConnection
    assert pool.connection_kwargs["ssl_ca_certs"] == "/ca.crt"
    assert pool.connection_kwargs["db"] == 1
    close()


@pytest.mark.parametrize("scheme", ["emq", "emqs"])
def test_a_sentinel_store_follows_the_master_the_sentinels_name(scheme: str) -> None:
    url = f"{scheme}+sentinel://u:pw@s1:26379;{scheme}+sentinel://s2:26380/4"
    topts = {"master_name": "mymaster", "min_other_sentinels": 1}
    endpoint = endpoint_of(Connection(url, transport_options=topts))
    store, close = connect(endpoint, EmqOptions.from_transport_options(topts))
    pool = store.client.connection_pool
    assert pool.service_name == "mymaster"
    assert pool.connection_kwargs["db"] == 4
    assert pool.connection_kwargs["username"] == "u"
    assert pool.connection_kwargs["password"] == "pw"
    tls = scheme == "emqs"
    expected = SentinelManagedSSLConnection if tls else SentinelManagedConnection
    assert pool.connection_class is expected
    sentinels = pool.sentinel_manager.sentinels
    assert [c.connection_pool.connection_kwargs["port"] for c in sentinels] == [26379, 26380]
    assert pool.sentinel_manager.min_other_sentinels == 1
    close()


def test_a_sentinel_store_needs_master_name() -> None:
    endpoint = endpoint_of(Connection("emq+sentinel://s1:26379/0"))
    with pytest.raises(InvalidOptionError, match="master_name"):
        connect(endpoint, EmqOptions())


def test_a_cluster_no_seed_of_which_answers_is_a_connection_error() -> None:
    endpoint = endpoint_of(
        Connection("emq+cluster://127.0.0.1:1/0", transport_options={"socket_connect_timeout": 1})
    )
    with pytest.raises(redis.ConnectionError):
        connect(endpoint, EmqOptions())
