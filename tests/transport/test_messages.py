"""A kombu message as the job it is stored as (``messages.new_job``)."""

from __future__ import annotations

import json
import uuid
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime, timezone
from decimal import Decimal
from typing import Any

from kombu.utils import json as kombu_json

from celery_emq.transport.messages import JOB_ID_PROPERTY, new_job


def message(**headers: Any) -> dict[str, Any]:
    return {
        "body": "e30=",
        "content-encoding": "utf-8",
        "content-type": "application/json",
        "headers": {"task": "t", "id": "tid", "eta": None, **headers},
        "properties": {
            "delivery_tag": "tag-1",
            "priority": 0,
            "body_encoding": "base64",
            "delivery_info": {"exchange": "", "routing_key": "celery"},
        },
    }


def test_the_payload_is_kombus_json_of_the_message_less_the_keyed_properties() -> None:
    # Header values only kombu's encoder knows how to write.
    extra = {
        "when": datetime(2026, 1, 2, 3, 4, 5, tzinfo=timezone.utc),
        "uid": uuid.UUID(int=7),
        "amount": Decimal("1.50"),
        "raw": b"bytes",
        "text": "caf\u00e9",
    }
    m = message(**extra)
    job, is_task = new_job(m, 0)
    assert is_task
    assert job.id == "tag-1"
    expected = {**m, "properties": {k: v for k, v in m["properties"].items()}}
    del expected["properties"]["delivery_tag"]
    del expected["properties"][JOB_ID_PROPERTY]
    assert job.payload == kombu_json.dumps(expected).encode()
    stored = json.loads(job.payload)
    assert "delivery_tag" not in stored["properties"]
    assert kombu_json.loads(job.payload)["headers"]["uid"] == uuid.UUID(int=7)


def test_messages_encoded_in_threads_at_once_come_out_whole() -> None:
    def one(i: int) -> bytes:
        m = message(n=i, nested={"i": [i, {"j": i}]})
        m["properties"]["delivery_tag"] = f"tag-{i}"
        return new_job(m, 0)[0].payload

    with ThreadPoolExecutor(4) as pool:
        payloads = list(pool.map(one, range(400)))
    for i, payload in enumerate(payloads):
        got = json.loads(payload)
        assert got["headers"]["n"] == i
        assert got["headers"]["nested"] == {"i": [i, {"j": i}]}
