"""Fixtures of the transport contract tests."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest
from kombu import Connection

ConnFactory = Callable[..., Connection]


@pytest.fixture
def connect(broker_url: str, prefix: str) -> Iterator[ConnFactory]:
    """Open connections under the test's key prefix (to ``url``, the suite's broker by default)."""
    opened: list[Connection] = []

    def factory(url: str = broker_url, **topts: Any) -> Connection:
        conn = Connection(url, transport_options={"global_keyprefix": prefix, **topts})
        opened.append(conn)
        return conn

    yield factory
    for conn in opened:
        conn.release()
