"""A loopback TCP proxy that delays every byte by a fixed time each way: an emulated network.

    python -m bench.netproxy --target-port 6379 --rtt-ms 1 --max-seconds 600

Listens on a free loopback port (printed as the first line of output, or
``--port``), forwards each connection to ``127.0.0.1:<target-port>``, and holds
what it reads from either side for ``rtt_ms / 2`` before writing it on: a
request and its reply each take half the round trip, and pipelined bytes keep
their order and their spacing (the delay is a queue, not a pause in reading).
Bounded: at most ``--max-connections`` at once (more are refused), and it stops
itself after ``--max-seconds``, or when its standard input closes (the process
that started it went away). Only loopback addresses, in and out.

:func:`delaying_proxy` runs one from Python for the length of a block.
"""

from __future__ import annotations

import argparse
import contextlib
import queue
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from functools import partial

import redis

from bench._common import ROOT

#: Bytes read at a time from either side.
CHUNK = 65536


class Delayer:
    """Forwards connections to ``target_port``, each byte ``delay_s`` later, both ways.

    Two threads per direction of each connection: one reads and stamps each
    chunk with when it is due, one writes it then (``time.sleep`` keeps to tens
    of microseconds; an event loop's timers round to the millisecond).
    """

    def __init__(self, target_port: int, delay_s: float, max_connections: int) -> None:
        self.target_port = target_port
        self.delay_s = delay_s
        self.max_connections = max_connections
        self._open = threading.Semaphore(max_connections)

    def serve(self, listener: socket.socket) -> None:
        """Accept connections for ever (run in a daemon thread)."""
        while True:
            down, _ = listener.accept()
            if not self._open.acquire(blocking=False):
                down.close()
                continue
            try:
                up = socket.create_connection(("127.0.0.1", self.target_port))
            except OSError:
                down.close()
                self._open.release()
                continue
            for s in (down, up):
                s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            done = threading.Barrier(2, action=partial(self._close, down, up))
            for src, dst in ((down, up), (up, down)):
                self._pipe(src, dst, done)

    def _close(self, *socks: socket.socket) -> None:
        for s in socks:
            s.close()
        self._open.release()

    def _pipe(self, src: socket.socket, dst: socket.socket, done: threading.Barrier) -> None:
        """Copy ``src`` to ``dst``, each chunk written ``delay_s`` after it was read."""
        held: queue.SimpleQueue[tuple[float, bytes]] = queue.SimpleQueue()

        def read() -> None:
            while True:
                try:
                    data = src.recv(CHUNK)
                except OSError:
                    data = b""
                held.put((time.monotonic() + self.delay_s, data))
                if not data:
                    return

        def write() -> None:
            while True:
                due, data = held.get()
                if not data:
                    break
                wait = due - time.monotonic()
                if wait > 0:
                    time.sleep(wait)
                try:
                    dst.sendall(data)
                except OSError:
                    break
            with contextlib.suppress(OSError):
                dst.shutdown(socket.SHUT_WR)
            with contextlib.suppress(threading.BrokenBarrierError):
                done.wait()

        threading.Thread(target=read, daemon=True).start()
        threading.Thread(target=write, daemon=True).start()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--target-port", type=int, required=True)
    ap.add_argument("--rtt-ms", type=float, required=True, help="added round trip (ms)")
    ap.add_argument("--port", type=int, default=0, help="port to listen on (0: a free one)")
    ap.add_argument("--max-connections", type=int, default=256)
    ap.add_argument("--max-seconds", type=float, default=3600)
    args = ap.parse_args()
    listener = socket.socket()
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind(("127.0.0.1", args.port))
    listener.listen(128)
    delayer = Delayer(args.target_port, args.rtt_ms / 2000, args.max_connections)
    threading.Thread(target=delayer.serve, args=(listener,), daemon=True).start()
    print(listener.getsockname()[1], flush=True)
    # Stops at end of standard input (the parent closed the pipe or exited) or
    # after max_seconds, whichever comes first; daemon threads end with it.
    stdin = threading.Thread(target=sys.stdin.buffer.read, daemon=True)
    stdin.start()
    stdin.join(args.max_seconds)


@contextlib.contextmanager
def delaying_proxy(target_port: int, rtt_ms: float, max_seconds: float = 3600) -> Iterator[int]:
    """Run a proxy process in front of ``target_port`` for the block; yield its port.

    It is stopped by closing its standard input (and by PID if that is not enough).
    """
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "bench.netproxy",
            "--target-port",
            str(target_port),
            "--rtt-ms",
            str(rtt_ms),
            "--max-seconds",
            str(max_seconds),
        ],
        cwd=ROOT,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        if not line.strip():
            raise RuntimeError(f"the proxy did not start (exit {proc.wait(5)})")
        yield int(line)
    finally:
        if proc.stdin is not None:
            proc.stdin.close()
        try:
            proc.wait(5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)


def measured_rtt_ms(port: int, n: int = 200) -> float:
    """The median ``PING`` round trip through ``port`` (ms)."""
    client = redis.Redis(port=port)
    client.ping()
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        client.ping()
        times.append((time.perf_counter() - t0) * 1000)
    client.close()
    return sorted(times)[n // 2]


if __name__ == "__main__":
    main()
