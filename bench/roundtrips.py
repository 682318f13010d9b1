"""Count this process's client round trips to Redis, for the benchmarks.

API: ``install(record_url: str, key: str) -> None``. Call it once per process,
as early as possible (at import, or when a worker starts). From then on every
call of redis-py's ``AbstractConnection.send_packed_command`` counts one round
trip: that is where one command (``send_command``) or a whole pipeline, MULTI/EXEC
or not, is written to the socket before its replies are read, so a pipeline of
any length counts one. A connection's own handshake (``HELLO``/``AUTH``/``SELECT``/
``CLIENT SETNAME``) and a health-check ``PING`` each count too: each waits for a
reply. A ``BRPOP`` sent now and read later counts one.

The count is added to ``INCRBY key`` on ``record_url``, through a connection that
is itself not counted: every ``FLUSH_EVERY_S`` from a daemon thread, at interpreter
exit (``atexit``), and at Celery's ``worker_process_shutdown`` (a prefork child
leaves through ``os._exit``, which skips ``atexit``). A forked child starts from
zero with a flush thread of its own; what a child killed by SIGKILL counted since
its last flush is lost (at most ``FLUSH_EVERY_S`` of it).

``uncounted(client)`` exempts one redis-py client (the benchmark's own
bookkeeping, such as the drain timer a task writes) from the count; call it
before the client opens a connection.

With ``BENCH_ROUNDTRIPS_URL`` and ``BENCH_ROUNDTRIPS_KEY`` in the environment,
importing this module installs it; without them, importing it does nothing.
With ``BENCH_ROUNDTRIPS_DETAIL=1`` as well, each round trip is also counted by
the name of the first command it sends (``EVALSHA <sha[:8]>`` for a script) in
the hash ``<key>:detail``, to see where the round trips go.
"""

from __future__ import annotations

import atexit
import os
import threading
from typing import Any

import redis
from redis.connection import AbstractConnection

__all__ = ["FLUSH_EVERY_S", "count", "flush", "install", "uncounted"]

#: How often the flush thread adds the count so far to the record key.
FLUSH_EVERY_S = 0.5

_lock = threading.Lock()
_count = 0
_record: redis.Redis | None = None
_key = ""
_original_send: Any = None
_thread: threading.Thread | None = None
_detail: dict[str, int] | None = None


def count() -> int:
    """Return the round trips counted in this process and not yet flushed."""
    return _count


def _label(command: Any) -> str:
    """Name the first command of a packed command (RESP bytes, or a list of chunks)."""
    head = command if isinstance(command, bytes | str) else (command[0] if command else b"")
    if isinstance(head, str):
        head = head.encode()
    parts = bytes(head[:200]).split(b"\r\n")
    # *N, $len, NAME, $len, ARG1, ...
    name = parts[2].decode(errors="replace").upper() if len(parts) > 2 else "?"
    if name == "EVALSHA" and len(parts) > 4:
        name += " " + parts[4][:8].decode(errors="replace")
    return name


def _counted_send(self: Any, command: Any, check_health: bool = True) -> Any:
    global _count
    if not getattr(self, "_bench_uncounted", False):
        with _lock:
            _count += 1
            if _detail is not None:
                label = _label(command)
                _detail[label] = _detail.get(label, 0) + 1
    return _original_send(self, command, check_health)


def _uncounted_pool(pool: Any) -> None:
    """Make the connections ``pool`` opens from now on bypass the count."""
    base = pool.connection_class
    if getattr(base, "_bench_uncounted", False):
        return
    pool.connection_class = type(f"Uncounted{base.__name__}", (base,), {"_bench_uncounted": True})


def uncounted(client: redis.Redis) -> redis.Redis:
    """Exempt ``client``'s connections from the count; return the client."""
    _uncounted_pool(client.connection_pool)
    for conn in list(getattr(client.connection_pool, "_available_connections", ())):
        conn._bench_uncounted = True
    return client


def flush() -> None:
    """Add the count so far to the record key (nothing if the record is unreachable)."""
    global _count
    if _record is None:
        return
    with _lock:
        n, _count = _count, 0
        detail = dict(_detail) if _detail else {}
        if _detail:
            _detail.clear()
    if not n:
        return
    try:
        with _record.pipeline(transaction=False) as pipe:
            pipe.incrby(_key, n)
            for label, m in detail.items():
                pipe.hincrby(_key + ":detail", label, m)
            pipe.execute()
    except redis.RedisError:
        with _lock:
            _count += n


def _flush_loop() -> None:
    event = threading.Event()
    while not event.wait(FLUSH_EVERY_S):
        flush()


def _start_thread() -> None:
    global _thread
    _thread = threading.Thread(target=_flush_loop, name="bench-roundtrips", daemon=True)
    _thread.start()


def _after_fork_in_child() -> None:
    # The parent's count is the parent's to flush; the flush thread did not
    # survive the fork, and the record's connections belong to the parent.
    global _count, _lock
    _lock = threading.Lock()
    _count = 0
    if _detail is not None:
        _detail.clear()
    if _record is not None:
        _record.connection_pool.reset()
        _start_thread()


def _on_process_shutdown(**kwargs: Any) -> None:
    flush()


def install(record_url: str, key: str) -> None:
    """Count every round trip this process makes from now on; ``INCRBY key`` the total.

    Args:
        record_url: a ``redis://`` URL of the server (and db) that holds the counter.
        key: the counter's key; each process adds its own count to it.

    Calling it again in the same process changes nothing.
    """
    global _record, _key, _original_send, _detail
    if _record is not None:
        return
    if os.environ.get("BENCH_ROUNDTRIPS_DETAIL") == "1":
        _detail = {}
    record = redis.Redis.from_url(record_url)
    uncounted(record)
    _record, _key = record, key
    _original_send = AbstractConnection.send_packed_command
    AbstractConnection.send_packed_command = _counted_send  # type: ignore[method-assign]
    atexit.register(flush)
    os.register_at_fork(after_in_child=_after_fork_in_child)
    try:
        from celery.signals import worker_process_shutdown
    except ImportError:
        pass
    else:
        worker_process_shutdown.connect(
            _on_process_shutdown, weak=False, dispatch_uid="bench.roundtrips"
        )
    _start_thread()


if os.environ.get("BENCH_ROUNDTRIPS_URL") and os.environ.get("BENCH_ROUNDTRIPS_KEY"):
    install(os.environ["BENCH_ROUNDTRIPS_URL"], os.environ["BENCH_ROUNDTRIPS_KEY"])
