"""Private ``redis-server`` processes and a TCP proxy for the fault tests.

Each server runs on a loopback port of its own, in a directory of its own, and
is stopped by PID; a restart reuses the port and the directory (so an AOF file
is read back).
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

import redis

#: The server binary: ``EMQ_REDIS_SERVER`` (another Redis, or Valkey) or the one on PATH.
REDIS_SERVER = os.environ.get("EMQ_REDIS_SERVER") or shutil.which("redis-server")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class RedisServer:
    """One ``redis-server`` on ``127.0.0.1:<port>`` in ``workdir``.

    Args:
        workdir: its directory (AOF files, log).
        aof: append-only file with ``appendfsync always`` (else no persistence).
        extra: more ``--name value`` arguments.
    """

    def __init__(self, workdir: Path, aof: bool = False, *extra: str) -> None:
        assert REDIS_SERVER, "no redis-server: put one on PATH or set EMQ_REDIS_SERVER"
        self.dir = workdir
        self.dir.mkdir(parents=True, exist_ok=True)
        self.port = free_port()
        self.aof = aof
        self.extra = extra
        self.proc: subprocess.Popen[bytes] | None = None
        self.starts = 0

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def client(self, **kwargs: Any) -> redis.Redis:
        return redis.Redis(host="127.0.0.1", port=self.port, **kwargs)

    def start(self, timeout: float = 20) -> None:
        assert self.proc is None or self.proc.poll() is not None
        persistence = (
            ["--appendonly", "yes", "--appendfsync", "always"]
            if self.aof
            else ["--appendonly", "no"]
        )
        self.starts += 1
        self.proc = subprocess.Popen(
            [
                str(REDIS_SERVER),
                "--port",
                str(self.port),
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                *persistence,
                "--dir",
                str(self.dir),
                "--logfile",
                str(self.dir / "redis.log"),
                *self.extra,
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + timeout
        c = self.client(socket_timeout=1)
        try:
            while True:
                try:
                    # An AOF still loading answers LOADING: wait for a real reply.
                    c.ping()
                    return
                except (redis.ConnectionError, redis.BusyLoadingError, redis.TimeoutError):
                    if self.proc.poll() is not None or time.monotonic() > deadline:
                        raise AssertionError(
                            f"redis-server on {self.port} did not start: "
                            + (self.dir / "redis.log").read_text(errors="replace")[-2000:]
                        ) from None
                    time.sleep(0.05)
        finally:
            c.close()

    def restart_from_snapshot(self) -> None:
        """SIGKILL the server and start it again from its last ``SAVE`` (``dump.rdb``).

        Every write after that snapshot is lost, as when Redis, persisting by RDB
        snapshots only (its default), crashes between two of them.
        """
        assert not self.aof, "an AOF server restarts from its AOF, not a snapshot"
        self.stop()
        self.start()

    def writes(self) -> list[list[bytes]]:
        """Every write in the AOF so far, in the order the server made them."""
        return [args for _offset, args in _commands(_aof_file(self.dir).read_bytes())]

    def restart_before(self, command: list[bytes]) -> int:
        """SIGKILL the server and start it again from its AOF cut just before ``command``.

        The server comes back as it was the moment before it ran the first write
        that begins with ``command`` (or before the ``MULTI`` a script's writes
        are wrapped in, when it is one of them), as after a crash that lost that
        write and every one after it: a restart from a snapshot taken then, AOF
        ``everysec`` losing its last second, or a failover to a replica the
        write had not reached. Returns how many bytes of the AOF were cut.
        """
        assert self.aof, "only an AOF server keeps the writes to cut"
        self.stop()
        aof = _aof_file(self.dir)
        data = aof.read_bytes()
        cut = _offset_of(data, command)
        aof.write_bytes(data[:cut])
        self.start()
        return len(data) - cut

    def stop(self, sig: int = signal.SIGKILL) -> None:
        """Stop the server (SIGKILL by default: a crash) and wait for it."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(sig)
            self.proc.wait(20)

    def __enter__(self) -> RedisServer:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _aof_file(workdir: Path) -> Path:
    """The file an AOF server appends its writes to (Redis 7's incremental one, or 6.2's)."""
    incr = sorted((workdir / "appendonlydir").glob("*.incr.aof"))
    assert len(incr) <= 1, f"an AOF rewrite left several files: {incr}"
    return incr[0] if incr else workdir / "appendonly.aof"


def _commands(data: bytes) -> list[tuple[int, list[bytes]]]:
    """Split an AOF's RESP text into its commands, each with the offset it starts at."""
    out: list[tuple[int, list[bytes]]] = []
    at = 0
    while at < len(data):
        start = at
        end = data.index(b"\r\n", at)
        assert data[at : at + 1] == b"*", f"not a command at byte {at}"
        n = int(data[at + 1 : end])
        at = end + 2
        args = []
        for _ in range(n):
            end = data.index(b"\r\n", at)
            size = int(data[at + 1 : end])
            args.append(data[end + 2 : end + 2 + size])
            at = end + 2 + size + 2
        out.append((start, args))
    return out


def _offset_of(data: bytes, command: list[bytes]) -> int:
    """Where the first write beginning with ``command`` starts (its ``MULTI``, if wrapped)."""
    multi: int | None = None
    for offset, args in _commands(data):
        verb = args[0].upper()
        if verb == b"MULTI":
            multi = offset
        elif verb == b"EXEC":
            multi = None
        elif [args[0].upper(), *args[1:]][: len(command)] == command:
            return offset if multi is None else multi
    raise AssertionError(f"no write {command!r} in the AOF")


class StallingProxy:
    """A loopback TCP proxy to ``target_port`` that can leave its links half-open, or move them.

    After :meth:`freeze`, every connection open at that moment stays open but no
    byte crosses it again either way: the peer looks alive and never answers
    (as after a failover, a NAT drop or a pulled cable). Connections made later
    are forwarded as usual.
    """

    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self._listener = socket.socket()
        self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._listener.bind(("127.0.0.1", 0))
        self._listener.listen(64)
        self.port = int(self._listener.getsockname()[1])
        self._closed = threading.Event()
        self._links: list[tuple[socket.socket, socket.socket, threading.Event]] = []
        self._lock = threading.Lock()
        threading.Thread(target=self._accept, daemon=True).start()

    @property
    def connections(self) -> int:
        with self._lock:
            return len(self._links)

    def freeze(self) -> int:
        """Stop forwarding on every open connection, for good; return how many."""
        with self._lock:
            for _down, _up, frozen in self._links:
                frozen.set()
            return len(self._links)

    def _accept(self) -> None:
        self._listener.settimeout(0.2)
        while not self._closed.is_set():
            try:
                down, _ = self._listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            up = socket.create_connection(("127.0.0.1", self.target_port))
            frozen = threading.Event()
            with self._lock:
                self._links.append((down, up, frozen))
            for a, b in ((down, up), (up, down)):
                threading.Thread(target=self._pipe, args=(a, b, frozen), daemon=True).start()

    def _pipe(self, src: socket.socket, dst: socket.socket, frozen: threading.Event) -> None:
        src.settimeout(0.2)
        while not self._closed.is_set():
            if frozen.is_set():
                time.sleep(0.05)
                continue
            try:
                data = src.recv(65536)
            except TimeoutError:
                continue
            except OSError:
                break
            if not data:
                break
            if frozen.is_set():
                continue  # swallowed: the link is dead
            try:
                dst.sendall(data)
            except OSError:
                break
        if not frozen.is_set():
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def retarget(self, target_port: int) -> int:
        """Forward to ``target_port`` from now on; close every open link, return how many.

        The clients reconnect through the proxy and reach the other server, as
        when a name or a virtual IP moves to another master.
        """
        with self._lock:
            self.target_port = target_port
            links, self._links = self._links, []
        for down, up, _frozen in links:
            for s in (down, up):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
                s.close()
        return len(links)

    def close(self) -> None:
        self._closed.set()
        self._listener.close()
        with self._lock:
            for down, up, _frozen in self._links:
                down.close()
                up.close()
