"""emqs:// against a TLS-only redis-server this test starts (and stops by PID)."""

from __future__ import annotations

import shutil
import socket
import ssl
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
from kombu import Connection, Consumer, Exchange, Producer, Queue

import celery_emq  # noqa: F401

pytestmark = pytest.mark.skipif(
    not (shutil.which("redis-server") and shutil.which("openssl")),
    reason="needs redis-server and openssl on PATH",
)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def openssl(*args: str) -> None:
    subprocess.run(["openssl", *args], check=True, capture_output=True, timeout=60)


@pytest.fixture(scope="module")
def tls_redis(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[int, Path]]:
    d = tmp_path_factory.mktemp("tls")
    ca_key, ca, key, csr, crt = (d / n for n in ("ca.key", "ca.crt", "s.key", "s.csr", "s.crt"))
    openssl(
        "req",
        "-x509",
        "-newkey",
        "rsa:2048",
        "-nodes",
        "-keyout",
        str(ca_key),
        "-out",
        str(ca),
        "-days",
        "2",
        "-subj",
        "/CN=emq-test-ca",
    )
    openssl(
        "req",
        "-newkey",
        "rsa:2048",
        "-nodes",
        "-keyout",
        str(key),
        "-out",
        str(csr),
        "-subj",
        "/CN=127.0.0.1",
    )
    ext = d / "ext.cnf"
    ext.write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n")
    openssl(
        "x509",
        "-req",
        "-in",
        str(csr),
        "-CA",
        str(ca),
        "-CAkey",
        str(ca_key),
        "-CAcreateserial",
        "-out",
        str(crt),
        "-days",
        "2",
        "-extfile",
        str(ext),
    )
    port = free_port()
    proc = subprocess.Popen(
        [
            "redis-server",
            "--port",
            "0",
            "--tls-port",
            str(port),
            "--bind",
            "127.0.0.1",
            "--tls-cert-file",
            str(crt),
            "--tls-key-file",
            str(key),
            "--tls-ca-cert-file",
            str(ca),
            "--tls-auth-clients",
            "no",
            "--save",
            "",
            "--appendonly",
            "no",
            "--dir",
            str(d),
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        client = redis.Redis(host="127.0.0.1", port=port, ssl=True, ssl_ca_certs=str(ca))
        deadline = time.monotonic() + 10
        while True:
            try:
                client.ping()
                break
            except redis.ConnectionError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.1)
        yield port, ca
    finally:
        proc.terminate()
        proc.wait(10)


def test_emqs_roundtrip_with_verified_certificate(tls_redis: tuple[int, Path]) -> None:
    port, ca = tls_redis
    q = Queue("tlsq", Exchange("tlsq", "direct"), "tlsq")
    got: list[str] = []
    with Connection(
        f"emqs://127.0.0.1:{port}/0",
        ssl={"ssl_cert_reqs": ssl.CERT_REQUIRED, "ssl_ca_certs": str(ca)},
    ) as conn:
        Producer(conn.channel()).publish(
            "over tls", exchange=q.exchange, routing_key="tlsq", declare=[q], serializer="json"
        )
        with Consumer(conn.channel(), [q], callbacks=[lambda b, m: (got.append(b), m.ack())]):
            conn.drain_events(timeout=5)
    assert got == ["over tls"]


@pytest.mark.parametrize("scheme", ["emqs", "emq"])
def test_ssl_true_speaks_tls(
    tls_redis: tuple[int, Path], scheme: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # ssl=True (Celery's broker_use_ssl=True) verifies against the default CAs,
    # which OpenSSL reads from SSL_CERT_FILE.
    port, ca = tls_redis
    monkeypatch.setenv("SSL_CERT_FILE", str(ca))
    q = Queue("tlsq-true", Exchange("tlsq-true", "direct"), "tlsq-true")
    got: list[str] = []
    with Connection(f"{scheme}://127.0.0.1:{port}/0", ssl=True, connect_timeout=2) as conn:
        Producer(conn.channel()).publish(
            "over tls", exchange=q.exchange, routing_key=q.routing_key, declare=[q]
        )
        with Consumer(conn.channel(), [q], callbacks=[lambda b, m: (got.append(b), m.ack())]):
            conn.drain_events(timeout=5)
    assert got == ["over tls"]


def test_emqs_refuses_an_unverified_server(tls_redis: tuple[int, Path]) -> None:
    port, _ca = tls_redis
    # No CA given: the default is to verify, and the test CA is unknown to the system.
    with Connection(f"emqs://127.0.0.1:{port}/0") as conn:
        with pytest.raises(Exception, match=r"(?i)certificate|ssl"):
            conn.channel()


def test_plain_emq_cannot_talk_to_a_tls_port(tls_redis: tuple[int, Path]) -> None:
    port, _ca = tls_redis
    with Connection(
        f"emq://127.0.0.1:{port}/0", connect_timeout=2, transport_options={"socket_timeout": 2}
    ) as conn:
        with pytest.raises(Exception):  # noqa: B017  (whatever redis-py raises: no TLS)
            conn.channel()


@pytest.mark.parametrize("verified", [True, False])
def test_open_store_speaks_tls_as_the_channel_does(
    tls_redis: tuple[int, Path], verified: bool
) -> None:
    from celery import Celery

    from celery_emq.ops.appstore import open_store

    port, ca = tls_redis
    use_ssl = {"ssl_cert_reqs": ssl.CERT_REQUIRED}
    if verified:
        use_ssl["ssl_ca_certs"] = str(ca)
    app = Celery("tls", broker=f"emqs://127.0.0.1:{port}/0", set_as_current=False)
    app.conf.broker_use_ssl = use_ssl
    q = Queue("tlsq-ops", Exchange("tlsq-ops", "direct"), "tlsq-ops")
    with Connection(f"emqs://127.0.0.1:{port}/0", ssl={**use_ssl, "ssl_ca_certs": str(ca)}) as conn:
        Producer(conn.channel()).publish("x", exchange=q.exchange, routing_key=q.name, declare=[q])
    with open_store(app) as (store, _options):
        if verified:
            assert store.counts("tlsq-ops")["pending"] >= 1
            store.purge("tlsq-ops")
        else:
            with pytest.raises(redis.ConnectionError, match=r"(?i)certificate|ssl"):
                store.counts("tlsq-ops")
