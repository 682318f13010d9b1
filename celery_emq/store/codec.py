"""How a message is stored: JSON, compressed when that makes it smaller.

A job's message lives in its own key (``<p>:{q}:msg:<id>``), apart from the
job's small fields, so that the row stays a compact listpack. Most of a Celery
message is the same from task to task (its header names, ``null`` defaults,
properties), so it is compressed with raw DEFLATE primed with a fixed
dictionary of that common text: a typical task message of about 900 bytes is
stored in about 200.

Stored forms, told apart by the first byte:

- ``{``: the message's JSON as is (short messages, messages stored by earlier
  versions, and any message compression would not shrink);
- ``\\x01``: raw DEFLATE (window 2**12) with the dictionary :data:`DICT_V1`;
- ``\\x00``: the text that follows as is (only for a text that itself starts
  with one of these two bytes, which no kombu message does).

The dictionary of a form never changes once released: a new dictionary is a
new first byte, and every older form stays readable.
"""

from __future__ import annotations

import zlib

__all__ = ["pack", "unpack"]

#: Messages shorter than this are stored as they are.
MIN_COMPRESS = 128

#: First byte of a message compressed with :data:`DICT_V1`.
V1 = b"\x01"
#: First byte of a text stored as is although it starts with a marker byte.
RAW = b"\x00"
_WBITS = -12  # raw DEFLATE, 4 KiB window
_MEM_LEVEL = 4

#: Text common to Celery's task messages (protocol 2, kombu's envelope), most
#: frequent last: DEFLATE finds the nearest match first.
DICT_V1 = (
    b'"stamped_headers": null, "stamps": {}}, "properties": {"correlation_id": "", "reply_to": "", '
    b'"delivery_mode": 2, "delivery_info": {"exchange": "", "routing_key": "celery"}, '
    b'"priority": 0, "body_encoding": "base64"}}{"body": "", "content-encoding": "utf-8", '
    b'"content-type": "application/json", "headers": {"lang": "py", "task": "", "id": "", '
    b'"shadow": null, "eta": null, "expires": null, "group": null, "group_index": null, '
    b'"retries": 0, "timelimit": [null, null], "root_id": "", "parent_id": null, '
    b'"argsrepr": "()", "kwargsrepr": "{}", "origin": "", "ignore_result": false, '
    b'"replaced_task_nesting": 0, '
)


def pack(text: str | bytes) -> bytes:
    """Return the stored form of a message's JSON text (compressed if that is shorter)."""
    data = text.encode() if isinstance(text, str) else text
    if len(data) >= MIN_COMPRESS:
        c = zlib.compressobj(6, zlib.DEFLATED, _WBITS, _MEM_LEVEL, zdict=DICT_V1)
        packed = V1 + c.compress(data) + c.flush()
        if len(packed) < len(data):
            return packed
    return RAW + data if data[:1] in (RAW, V1) else data


def unpack(stored: bytes | str) -> bytes:
    """Return a message's JSON text (bytes) from its stored form.

    Raises:
        ValueError: the stored bytes are neither JSON text nor a known
            compressed form, or do not decompress.
    """
    data = stored.encode() if isinstance(stored, str) else stored
    if data[:1] == RAW:
        return data[1:]
    if data[:1] != V1:
        return data
    d = zlib.decompressobj(_WBITS, zdict=DICT_V1)
    try:
        text = d.decompress(data[1:]) + d.flush()
    except zlib.error as exc:
        raise ValueError(f"a compressed message does not decompress: {exc}") from exc
    if not d.eof:
        raise ValueError("a compressed message is truncated")
    return text
