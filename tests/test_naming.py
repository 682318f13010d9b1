"""Each way of naming the transport, in a fresh interpreter that has not imported celery_emq."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

ROUND_TRIP = """
import sys
from celery import Celery

app = Celery("naming", broker=sys.argv[1])
{config}
app.conf.broker_transport_options = {{"global_keyprefix": sys.argv[2]}}
with app.connection_for_write() as conn:
    with conn.SimpleQueue("naming") as sq:
        sq.put({{"hello": "world"}})
        message = sq.get(timeout=5)
        message.ack()
    print(type(conn.transport).__module__, message.payload["hello"])
print("celery_emq imported:", "celery_emq" in sys.modules)
"""


def run(script: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", script, *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_an_emq_url_without_the_import_fails_with_kombus_bare_key_error(
    broker_url: str, prefix: str
) -> None:
    done = run(ROUND_TRIP.format(config=""), broker_url, prefix)
    assert done.returncode == 1
    # What docs/configuration.md says a user sees.
    scheme = broker_url.split("://", 1)[0]
    assert f"KeyError: 'No such transport: {scheme}'" in done.stderr


def test_broker_transport_names_it_with_any_url_and_no_import(redis_url: str, prefix: str) -> None:
    config = 'app.conf.broker_transport = "celery_emq.transport:Transport"'
    done = run(ROUND_TRIP.format(config=config), redis_url, prefix)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.splitlines() == [
        "celery_emq.transport.transport world",
        # kombu imported it by its name: the app never did.
        "celery_emq imported: True",
    ]
