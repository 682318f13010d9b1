"""Which deployment a broker URL names; a URL the transport cannot serve fails by name."""

from __future__ import annotations

import socket

import pytest
from kombu import Connection

import celery_emq  # noqa: F401  (registers emq://)
from celery_emq.errors import InvalidBrokerURLError
from celery_emq.store.topology import target_of


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_plain_urls_name_one_server() -> None:
    t = target_of(Connection("emq://127.0.0.1:6379/3"))
    assert (t.kind, t.tls) == ("single", False)
    t = target_of(Connection("emqs://h:6380/2"))
    assert (t.kind, t.tls) == ("single", True)
    # A Unix socket goes through kombu's own handling.
    assert target_of(Connection("emq+socket:///run/redis.sock")).kind == "single"


def test_sentinel_url_lists_every_sentinel_and_the_database() -> None:
    conn = Connection("emq+sentinel://:pw@127.0.0.1:26379;emq+sentinel://127.0.0.2:26380/4")
    t = target_of(conn)
    assert t.kind == "sentinel"
    assert t.nodes == (("127.0.0.1", 26379), ("127.0.0.2", 26380))
    assert t.db == 4
    assert t.password == "pw"


def test_cluster_url_names_its_seeds() -> None:
    t = target_of(Connection("emq+cluster://127.0.0.1:7101;emq+cluster://127.0.0.1:7102/0"))
    assert t.kind == "cluster"
    assert t.nodes == (("127.0.0.1", 7101), ("127.0.0.1", 7102))
    assert target_of(Connection("emqs+cluster://127.0.0.1:7101/0")).tls is True


@pytest.mark.parametrize(
    "url",
    [
        "emq+rediss://127.0.0.1:6379/0",
        "emq+clustr://127.0.0.1:6379/0",
        "emq+sentinel://127.0.0.1:26379/0;emq+cluster://127.0.0.1:7000/0",
    ],
)
def test_a_url_it_cannot_serve_fails_by_name(url: str) -> None:
    with pytest.raises(InvalidBrokerURLError) as err:
        target_of(Connection(url))
    assert "emq+sentinel://" in str(err.value) and "emq+cluster://" in str(err.value)


def test_cluster_url_does_not_land_on_the_local_redis() -> None:
    # A cluster URL whose node is down must fail on that node, never connect
    # to whatever Redis answers on localhost:6379 (the kombu default).
    port = _free_port()
    conn = Connection(
        f"emq+cluster://127.0.0.1:{port}/0",
        transport_options={"socket_connect_timeout": 0.5},
        connect_timeout=0.5,
    )
    try:
        with pytest.raises(Exception) as err:
            conn.ensure_connection(max_retries=1, timeout=5)
            with conn.channel() as ch:
                ch.client.ping()
        assert str(port) in str(err.value) or isinstance(err.value, InvalidBrokerURLError)
    finally:
        conn.release()


@pytest.mark.parametrize(
    ("url", "kind"),
    [
        ("emq+sentinel://:pw@127.0.0.1:26379;emq+sentinel://127.0.0.2:26380/4", "sentinel"),
        ("emqs+sentinel://127.0.0.1:26379;emqs+sentinel://127.0.0.2:26380/4", "sentinel"),
        ("emq+cluster://127.0.0.1:7101;emq+cluster://127.0.0.2:7102/0", "cluster"),
    ],
)
def test_switching_to_the_next_alternate_names_the_same_deployment(url: str, kind: str) -> None:
    # On a connection error kombu switches to the URL's next alternate, which it
    # reads as a URL of transport "emq+sentinel": that must still name the same
    # deployment, not one server on the sentinel's port (or an unknown transport).
    conn = Connection(url)
    before = target_of(conn)
    conn.switch(conn.alt[1])
    assert conn.get_transport_cls() is not None
    after = target_of(conn)
    assert after == before
    assert after.kind == kind
