"""A private Redis Cluster for the tests: three masters, one replica each.

Six ``redis-server --cluster-enabled yes`` processes on free loopback ports,
each in a directory of its own under /tmp, joined by ``redis-cli --cluster
create``; stopped by PID. Run as a script it starts one and prints its seed URL
(``python -m tests.topology.cluster_servers start``), so a nox session can run
the suite against it and stop it afterwards (``... stop <dir>``).

With ``tls=True`` (``start --tls``) every node listens on TLS only, the
cluster bus and replication included, with a certificate for 127.0.0.1 signed
by a CA generated in the cluster's directory (:attr:`Cluster.ca`).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import redis

REDIS_SERVER = os.environ.get("EMQ_REDIS_SERVER") or shutil.which("redis-server")
REDIS_CLI = os.environ.get("EMQ_REDIS_CLI") or shutil.which("redis-cli")

OPENSSL = shutil.which("openssl")

#: How long a node may be silent before its replica is promoted.
NODE_TIMEOUT_MS = 1000


def _free_ports(n: int) -> list[int]:
    """``n`` distinct free loopback ports whose cluster bus ports (+10000) are free too."""
    ports: list[int] = []
    for _ in range(200):
        if len(ports) == n:
            break
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = int(s.getsockname()[1])
        if port + 10000 > 65535 or port in ports:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port + 10000))
            except OSError:
                continue
        ports.append(port)
    if len(ports) < n:
        raise RuntimeError("no free loopback ports for a cluster")
    return ports


class Certificates:
    """A CA and a server certificate for 127.0.0.1 it signed, made by ``openssl`` in ``dir``."""

    def __init__(self, workdir: Path) -> None:
        self.dir = workdir
        self.ca = workdir / "ca.crt"
        self.cert = workdir / "server.crt"
        self.key = workdir / "server.key"

    def make(self) -> Certificates:
        assert OPENSSL, "no openssl: put it on PATH"
        self.dir.mkdir(parents=True, exist_ok=True)
        ca_key, csr, ext = self.dir / "ca.key", self.dir / "server.csr", self.dir / "ext.cnf"
        ext.write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n")
        self._openssl(
            "req",
            "-x509",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-keyout",
            ca_key,
            "-out",
            self.ca,
            "-days",
            "2",
            "-subj",
            "/CN=emq-test-ca",
        )
        self._openssl(
            "req",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-keyout",
            self.key,
            "-out",
            csr,
            "-subj",
            "/CN=127.0.0.1",
        )
        self._openssl(
            "x509",
            "-req",
            "-in",
            csr,
            "-CA",
            self.ca,
            "-CAkey",
            ca_key,
            "-CAcreateserial",
            "-out",
            self.cert,
            "-days",
            "2",
            "-extfile",
            ext,
        )
        return self

    @staticmethod
    def _openssl(*args: object) -> None:
        assert OPENSSL
        subprocess.run([OPENSSL, *map(str, args)], check=True, capture_output=True, timeout=60)

    def server_args(self) -> list[str]:
        """``redis-server`` arguments for TLS on every link (clients need no certificate)."""
        return [
            "--tls-cert-file",
            str(self.cert),
            "--tls-key-file",
            str(self.key),
            "--tls-ca-cert-file",
            str(self.ca),
            "--tls-auth-clients",
            "no",
        ]


class Node:
    """One cluster node: a ``redis-server`` on ``127.0.0.1:<port>`` in ``dir``.

    With ``tls`` the port is a TLS port and the node has no plain one.
    """

    def __init__(
        self,
        port: int,
        workdir: Path,
        tls: Certificates | None = None,
        config: tuple[str, ...] = (),
    ) -> None:
        self.port = port
        self.dir = workdir
        self.tls = tls
        #: More ``redis-server`` arguments (``--cluster-require-full-coverage no``).
        self.config = config
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        assert REDIS_SERVER, "no redis-server: put one on PATH or set EMQ_REDIS_SERVER"
        self.dir.mkdir(parents=True, exist_ok=True)
        log = open(self.dir / "redis.log", "ab")
        if self.tls is None:
            listen = ["--port", str(self.port)]
        else:
            listen = ["--port", "0", "--tls-port", str(self.port), *self.tls.server_args()]
            listen += ["--tls-cluster", "yes", "--tls-replication", "yes"]
        self.proc = subprocess.Popen(
            [
                REDIS_SERVER,
                *listen,
                "--bind",
                "127.0.0.1",
                "--dir",
                str(self.dir),
                "--cluster-enabled",
                "yes",
                "--cluster-config-file",
                "nodes.conf",
                "--cluster-node-timeout",
                str(NODE_TIMEOUT_MS),
                "--save",
                "",
                "--appendonly",
                "no",
                *self.config,
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        log.close()

    def client(self, **kwargs: object) -> redis.Redis:
        if self.tls is not None:
            kwargs = {"ssl": True, "ssl_ca_certs": str(self.tls.ca), **kwargs}
        return redis.Redis(host="127.0.0.1", port=self.port, socket_timeout=5, **kwargs)  # type: ignore[arg-type]

    def kill(self) -> None:
        """SIGKILL the node (a crash: no shutdown, no failover hand-off)."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(10)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None


class Cluster:
    """Three masters with one replica each, on loopback (TLS only with ``tls=True``)."""

    def __init__(
        self, masters: int = 3, replicas: int = 1, tls: bool = False, config: tuple[str, ...] = ()
    ) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix="emq-cluster-", dir="/tmp"))
        count = masters * (1 + replicas)
        self.replicas = replicas
        self.tls = Certificates(self.dir / "tls") if tls else None
        self.nodes = [Node(p, self.dir / str(p), self.tls, config) for p in _free_ports(count)]

    @property
    def ca(self) -> Path:
        """The CA certificate the nodes' certificate chains to (TLS clusters only)."""
        assert self.tls is not None, "not a TLS cluster"
        return self.tls.ca

    @property
    def ports(self) -> list[int]:
        return [n.port for n in self.nodes]

    @property
    def url(self) -> str:
        """The broker URL naming every node as a seed (``emqs+cluster://`` over TLS)."""
        scheme = "emq+cluster" if self.tls is None else "emqs+cluster"
        return ";".join(f"{scheme}://127.0.0.1:{p}" for p in self.ports) + "/0"

    def start(self, timeout: float = 60) -> None:
        assert REDIS_CLI, "no redis-cli: put one on PATH or set EMQ_REDIS_CLI"
        tls_args: list[str] = []
        if self.tls is not None:
            self.tls.make()
            tls_args = ["--tls", "--cacert", str(self.tls.ca)]
        for node in self.nodes:
            node.start()
        self._wait(lambda n: n.client().ping(), timeout, "nodes to answer")
        subprocess.run(
            [
                REDIS_CLI,
                *tls_args,
                "--cluster",
                "create",
                *(f"127.0.0.1:{p}" for p in self.ports),
                "--cluster-replicas",
                str(self.replicas),
                "--cluster-yes",
            ],
            check=True,
            capture_output=True,
            timeout=timeout,
        )
        self.wait_ok(timeout)
        self.wait_synced(timeout)

    def wait_ok(self, timeout: float = 60) -> None:
        """Wait until every live node reports ``cluster_state:ok`` and knows its role."""

        def ok(node: Node) -> bool:
            info = node.client().cluster("info")
            return bool(info.get("cluster_state") == "ok")

        self._wait(ok, timeout, "cluster_state:ok")

    def _wait(self, check: object, timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        pending = [n for n in self.nodes if n.alive]
        while pending:
            still = []
            for node in pending:
                try:
                    if not check(node):  # type: ignore[operator]
                        still.append(node)
                except (redis.RedisError, OSError):
                    still.append(node)
            pending = still
            if not pending:
                return
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"cluster: waited {timeout} s for {what}: {[n.port for n in pending]}"
                )
            time.sleep(0.1)

    def master_of(self, key: str) -> Node:
        """The node serving ``key``'s slot as master now."""
        live = next(n for n in self.nodes if n.alive)
        slot = int(live.client().cluster("keyslot", key))
        for start, end, master, *_ in live.client().execute_command("CLUSTER SLOTS"):
            if int(start) <= slot <= int(end):
                port = int(master[1])
                return next(n for n in self.nodes if n.port == port)
        raise LookupError(f"no master serves slot {slot}")

    def role(self, node: Node) -> str:
        return str(node.client().info("replication")["role"])

    def replica_of(self, master: Node) -> Node:
        """A live replica of ``master``."""
        for node in self.nodes:
            if node is master or not node.alive:
                continue
            info = node.client().info("replication")
            if info["role"] == "slave" and int(info["master_port"]) == master.port:
                return node
        raise LookupError(f"no replica of {master.port}")

    def wait_synced(self, timeout: float = 60) -> None:
        """Wait until every replica's link to its master is up."""

        def synced(node: Node) -> bool:
            info = node.client().info("replication")
            return info["role"] == "master" or info.get("master_link_status") == "up"

        self._wait(synced, timeout, "replicas in sync")

    def stop(self) -> None:
        for node in self.nodes:
            node.stop()
        shutil.rmtree(self.dir, ignore_errors=True)

    def save(self) -> Path:
        """Write the nodes' ports and PIDs to ``<dir>/cluster.json`` (for ``stop``)."""
        path = self.dir / "cluster.json"
        pids = [n.proc.pid for n in self.nodes if n.proc is not None]
        path.write_text(json.dumps({"ports": self.ports, "pids": pids, "url": self.url}))
        return path


def tls_unsupported() -> str | None:
    """Why a TLS cluster cannot run here (``None`` if it can).

    Starts one TLS-only node and asks it ``PING`` through ``redis-cli --tls``: a
    build without TLS refuses the options or does not answer.
    """
    missing = [
        n
        for n, p in (("redis-server", REDIS_SERVER), ("redis-cli", REDIS_CLI), ("openssl", OPENSSL))
        if p is None
    ]
    if missing:
        return f"needs {', '.join(missing)} on PATH"
    assert REDIS_CLI
    workdir = Path(tempfile.mkdtemp(prefix="emq-tls-probe-", dir="/tmp"))
    node = Node(_free_ports(1)[0], workdir / "node", Certificates(workdir / "tls"))
    try:
        assert node.tls is not None
        node.tls.make()
        node.start()
        probe = [REDIS_CLI, "--tls", "--cacert", str(node.tls.ca), "-p", str(node.port), "ping"]
        reply = ""
        deadline = time.monotonic() + 10
        while node.alive and time.monotonic() < deadline:
            done = subprocess.run(probe, capture_output=True, text=True, timeout=10)
            reply = (done.stdout + done.stderr).strip()
            if reply == "PONG":
                return None
            time.sleep(0.1)
        log = (node.dir / "redis.log").read_text(errors="replace")[-300:]
        return f"redis-server/redis-cli without TLS: {reply[-200:]!r} {log!r}"
    except (subprocess.SubprocessError, OSError) as exc:
        return f"no TLS node could start: {exc!r}"
    finally:
        node.stop()
        shutil.rmtree(workdir, ignore_errors=True)


def stop_saved(workdir: str) -> None:
    """Stop the nodes a ``start`` run left, by the PIDs it wrote."""
    path = Path(workdir) / "cluster.json"
    for pid in json.loads(path.read_text())["pids"]:
        try:
            os.kill(pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + 10
    for pid in json.loads(path.read_text())["pids"]:
        while time.monotonic() < deadline:
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                break
            time.sleep(0.05)
    shutil.rmtree(workdir, ignore_errors=True)


def main(argv: list[str]) -> int:
    if argv[:1] == ["start"] and argv[1:] in ([], ["--tls"]):
        cluster = Cluster(tls=argv[1:] == ["--tls"])
        cluster.start()
        cluster.save()
        shown = {"dir": str(cluster.dir), "url": cluster.url}
        if cluster.tls is not None:
            shown["ca"] = str(cluster.tls.ca)
        print(json.dumps(shown))
        return 0
    if argv[:1] == ["stop"] and len(argv) == 2:
        stop_saved(argv[1])
        return 0
    print("usage: cluster_servers.py start [--tls] | stop <dir>", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
