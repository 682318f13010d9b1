"""celery_emq.testing.docker: pytest-celery's Redis broker node, through emq://.

Without Docker the node is built on a stand-in for its container: what is
checked is the configuration pytest-celery hands to the app and the workers.
"""

from __future__ import annotations

import pytest

pytest.importorskip("pytest_celery")

from pytest_celery import CeleryBrokerCluster, CeleryTestBroker

from celery_emq.testing.docker import EmqTestBroker, emq_url


class StandInContainer:
    """What pytest-celery's RedisContainer reports once its container runs."""

    def __init__(self) -> None:
        self.torn_down = False

    @property
    def celeryconfig(self) -> dict[str, object]:
        return {
            "url": "redis://redis-1a2b/0",
            "host_url": "redis://localhost:49153/0",
            "hostname": "redis-1a2b",
            "port": 49153,
            "vhost": "0",
        }

    def teardown(self) -> None:
        self.torn_down = True


def test_the_broker_node_hands_out_emq_urls() -> None:
    container = StandInContainer()
    broker = EmqTestBroker(container)
    assert isinstance(broker, CeleryTestBroker)
    assert broker.config()["url"] == "emq://redis-1a2b/0"
    assert broker.config()["host_url"] == "emq://localhost:49153/0"
    assert broker.config(vhost=3)["host_url"] == "emq://localhost:49153/3"
    # What pytest-celery passes on: the app's broker_url and the workers' CELERY_BROKER_URL.
    assert CeleryBrokerCluster(broker).config() == {
        "urls": ["emq://redis-1a2b/0"],
        "host_urls": ["emq://localhost:49153/0"],
    }
    broker.teardown()
    assert container.torn_down


def test_emq_url_keeps_tls_and_leaves_other_schemes() -> None:
    assert emq_url("rediss://h:6380/1") == "emqs://h:6380/1"
    assert emq_url("emq://h/1") == "emq://h/1"
