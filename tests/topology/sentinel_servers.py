"""A Sentinel deployment on loopback: one master, one replica, three sentinels.

Every process is a ``redis-server`` (the sentinels with ``--sentinel`` and a
generated config) on a free loopback port, in a temporary directory of its
own; :meth:`SentinelTopology.stop` stops each by PID and removes the
directory. Failover is quick (``down-after-milliseconds`` 1000 by default) so a
test can kill the master and see the replica promoted within seconds.

Run as a script it starts the deployment, prints its broker URL and the
master's URL, and waits (the ``sentinel`` nox session uses it from Python).
"""

from __future__ import annotations

import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

import redis

from tests.faults.servers import REDIS_SERVER, RedisServer, free_port

MASTER_NAME = "emqmaster"


class Sentinel:
    """One ``redis-server --sentinel`` watching ``master_name`` at ``master_port``."""

    def __init__(
        self,
        workdir: Path,
        master_name: str,
        master_port: int,
        down_after_ms: int,
        failover_timeout_ms: int,
    ) -> None:
        assert REDIS_SERVER, "no redis-server: put one on PATH or set EMQ_REDIS_SERVER"
        self.dir = workdir
        self.dir.mkdir(parents=True, exist_ok=True)
        self.port = free_port()
        self.config = self.dir / "sentinel.conf"
        # Sentinel rewrites its config file (it must be writable and its own).
        self.config.write_text(
            "\n".join(
                [
                    f"port {self.port}",
                    "bind 127.0.0.1",
                    f"dir {self.dir}",
                    f"logfile {self.dir / 'sentinel.log'}",
                    f"sentinel monitor {master_name} 127.0.0.1 {master_port} 2",
                    f"sentinel down-after-milliseconds {master_name} {down_after_ms}",
                    f"sentinel failover-timeout {master_name} {failover_timeout_ms}",
                    f"sentinel parallel-syncs {master_name} 1",
                    "",
                ]
            )
        )
        self.proc: subprocess.Popen[bytes] | None = None
        #: SIGSTOPped by :meth:`pause` (the topology's own queries skip it).
        self.paused = False

    def client(self, **kwargs: Any) -> redis.Redis:
        return redis.Redis(host="127.0.0.1", port=self.port, **kwargs)

    def pause(self) -> None:
        """SIGSTOP the sentinel: it accepts connections and answers nothing."""
        assert self.proc is not None
        self.proc.send_signal(signal.SIGSTOP)
        self.paused = True

    def resume(self) -> None:
        if self.proc is not None and self.paused:
            self.proc.send_signal(signal.SIGCONT)
        self.paused = False

    def start(self) -> None:
        self.proc = subprocess.Popen(
            [str(REDIS_SERVER), str(self.config), "--sentinel"],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )

    def log(self) -> str:
        path = self.dir / "sentinel.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.resume()
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(20)


class SentinelTopology:
    """A master, a replica of it and three sentinels, started and stopped together.

    Args:
        down_after_ms: how long the master may be silent before a sentinel
            deems it down (``down-after-milliseconds``).
        failover_timeout_ms: Sentinel's ``failover-timeout``.
    """

    def __init__(
        self,
        master_name: str = MASTER_NAME,
        down_after_ms: int = 1000,
        failover_timeout_ms: int = 5000,
        sentinels: int = 3,
    ) -> None:
        self.master_name = master_name
        self.dir = Path(tempfile.mkdtemp(prefix="emq-sentinel-"))
        self.master = RedisServer(self.dir / "master")
        self.replica = RedisServer(
            self.dir / "replica", False, "--replicaof", "127.0.0.1", str(self.master.port)
        )
        self.sentinels = [
            Sentinel(
                self.dir / f"sentinel{i}",
                master_name,
                self.master.port,
                down_after_ms,
                failover_timeout_ms,
            )
            for i in range(sentinels)
        ]

    # -- addresses -------------------------------------------------------

    def broker_url(self, db: int = 0, scheme: str = "emq") -> str:
        """The ``emq+sentinel://`` URL listing every sentinel."""
        return ";".join(f"{scheme}+sentinel://127.0.0.1:{s.port}" for s in self.sentinels) + (
            f"/{db}"
        )

    def master_url(self, db: int = 0) -> str:
        """A direct URL of the server that is master when the topology starts."""
        return f"redis://127.0.0.1:{self.master.port}/{db}"

    def master_address(self) -> tuple[str, int] | None:
        """The master's address as the first sentinel that answers names it (none paused)."""
        for s in self.sentinels:
            if s.paused:
                continue
            c = s.client(socket_timeout=1, decode_responses=True)
            try:
                addr = c.execute_command("SENTINEL", "get-master-addr-by-name", self.master_name)
            except redis.RedisError:
                continue
            finally:
                c.close()
            if addr:
                return (str(addr[0]), int(addr[1]))
        return None

    # -- life cycle ------------------------------------------------------

    def start(self, timeout: float = 60) -> SentinelTopology:
        """Start every process; return once each sentinel knows the replica and its peers."""
        try:
            self.master.start()
            self.replica.start()
            for s in self.sentinels:
                s.start()
            self._wait_ready(timeout)
        except BaseException:
            self.stop()
            raise
        return self

    def _wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        peers = len(self.sentinels) - 1
        pending = list(self.sentinels)
        replica = self.replica.client(socket_timeout=1, decode_responses=True)
        try:
            while pending or replica.info("replication").get("master_link_status") != "up":
                if time.monotonic() > deadline:
                    logs = "\n".join(s.log()[-1500:] for s in self.sentinels)
                    raise AssertionError(f"the sentinel topology did not come up:\n{logs}")
                for s in list(pending):
                    if s.proc is not None and s.proc.poll() is not None:
                        raise AssertionError(f"sentinel on {s.port} exited:\n{s.log()[-2000:]}")
                    if self._sees_all(s, peers):
                        pending.remove(s)
                time.sleep(0.1)
        finally:
            replica.close()

    def _sees_all(self, s: Sentinel, peers: int) -> bool:
        c = s.client(socket_timeout=1, decode_responses=True)
        try:
            replicas = c.execute_command("SENTINEL", "REPLICAS", self.master_name)
            others = c.execute_command("SENTINEL", "SENTINELS", self.master_name)
        except redis.RedisError:
            return False
        finally:
            c.close()
        up = [r for r in replicas if "disconnected" not in str(_field(r, "flags"))]
        return len(up) >= 1 and len(others) >= peers

    def kill_master(self) -> tuple[str, int]:
        """SIGKILL the current master; return the address it had."""
        addr = self.master_address()
        assert addr is not None, "no sentinel names a master"
        for server in (self.master, self.replica):
            if server.port == addr[1]:
                server.stop(signal.SIGKILL)
                return addr
        raise AssertionError(f"the master {addr} is none of this topology's servers")

    def wait_promoted(self, old: tuple[str, int], timeout: float = 30) -> tuple[str, int]:
        """Wait until the sentinels name a master other than ``old``; return it."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            addr = self.master_address()
            if addr is not None and addr != old:
                return addr
            time.sleep(0.02)
        raise AssertionError(f"no replica was promoted within {timeout} s")

    def stop(self) -> None:
        """Stop every process by PID and remove the directory."""
        for s in self.sentinels:
            s.stop()
        self.replica.stop()
        self.master.stop()
        shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self) -> SentinelTopology:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _field(reply: Any, name: str) -> Any:
    """Read a field of a SENTINEL reply: a dict (RESP3, redis-py parsing) or a flat list."""
    if isinstance(reply, dict):
        return reply.get(name)
    items = list(reply)
    return dict(zip(items[::2], items[1::2], strict=False)).get(name)


def main() -> None:  # pragma: no cover - manual use
    with SentinelTopology() as topo:
        print(topo.broker_url(), topo.master_url(), flush=True)
        try:
            while True:
                time.sleep(3600)
        except KeyboardInterrupt:
            pass


if __name__ == "__main__":  # pragma: no cover
    main()
