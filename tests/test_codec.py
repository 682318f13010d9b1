"""How messages are stored: JSON as is, or compressed when that is smaller."""

from __future__ import annotations

import json
import zlib

import pytest
from hypothesis import given
from hypothesis import strategies as st

from celery_emq.store.codec import MIN_COMPRESS, V1, pack, unpack

#: A Celery protocol 2 task message as kombu hands it to a transport.
MESSAGE = json.dumps(
    {
        "body": "W1sxLCAyXSwge30sIHsiY2FsbGJhY2tzIjogbnVsbCwgImVycmJhY2tzIjogbnVsbH1d",
        "content-encoding": "utf-8",
        "content-type": "application/json",
        "headers": {
            "lang": "py",
            "task": "proj.tasks.add",
            "id": "0b6f3a1c-8a59-4c38-9f4e-5d0c1f6f8e21",
            "shadow": None,
            "eta": None,
            "expires": None,
            "group": None,
            "group_index": None,
            "retries": 0,
            "timelimit": [None, None],
            "root_id": "0b6f3a1c-8a59-4c38-9f4e-5d0c1f6f8e21",
            "parent_id": None,
            "argsrepr": "(1, 2)",
            "kwargsrepr": "{}",
            "origin": "gen812@web-1",
            "ignore_result": False,
            "replaced_task_nesting": 0,
            "stamped_headers": None,
            "stamps": {},
        },
        "properties": {
            "correlation_id": "0b6f3a1c-8a59-4c38-9f4e-5d0c1f6f8e21",
            "reply_to": "5e1c8f0b-3f0e-3a5c-9c1f-2b7d0e6a4f13",
            "delivery_mode": 2,
            "delivery_info": {"exchange": "", "routing_key": "celery"},
            "priority": 0,
            "body_encoding": "base64",
        },
    }
)


def test_a_task_message_is_stored_in_under_a_third_of_its_size() -> None:
    stored = pack(MESSAGE)
    assert stored[:1] == V1
    assert len(stored) < len(MESSAGE) / 3
    assert unpack(stored) == MESSAGE.encode()


def test_a_short_message_is_stored_as_is() -> None:
    text = '{"body": "e30="}'
    assert len(text) < MIN_COMPRESS
    assert pack(text) == text.encode()
    assert unpack(pack(text)) == text.encode()


def test_what_compression_would_not_shrink_is_stored_as_is() -> None:
    # Random base64 does not compress below its own size plus the marker.
    text = json.dumps({"body": zlib.compress(bytes(range(256)) * 4).hex()})
    stored = pack(text)
    assert unpack(stored) == text.encode()
    assert len(stored) <= len(text)


def test_a_message_stored_by_an_earlier_version_reads_as_is() -> None:
    assert unpack(MESSAGE) == MESSAGE.encode()
    assert unpack(MESSAGE.encode()) == MESSAGE.encode()


@pytest.mark.parametrize("stored", [V1 + b"\xff\xfe garbage", pack(MESSAGE)[:-8]])
def test_a_corrupt_compressed_message_raises_value_error(stored: bytes) -> None:
    with pytest.raises(ValueError):
        unpack(stored)


@pytest.mark.parametrize("text", ["\x01", "\x00{}", "\x01" + "x" * 300])
def test_a_text_starting_with_a_marker_byte_comes_back(text: str) -> None:
    assert unpack(pack(text)) == text.encode()


@given(st.text(min_size=0, max_size=5000) | st.binary(max_size=2000).map(lambda b: b.hex()))
def test_pack_then_unpack_gives_the_text_back(text: str) -> None:
    assert unpack(pack(text)) == text.encode()
