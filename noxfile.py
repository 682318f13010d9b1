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

import os
import time

import nox

nox.options.sessions = ["compat"]

#: (celery, kombu, redis-py or None for what kombu's redis extra picks): the oldest
#: pair runs on the floors in pyproject.toml, each other on its line's newest release.
PAIRS = [
    ("5.4.0", "5.4.0", "5.0.0"),
    ("5.5.3", "5.5.4", None),
    ("5.6.3", "5.6.2", None),
    ("5.7.0", "5.7.0", None),
]

TESTS = [
    "tests/transport/test_contract.py",
    "tests/e2e/test_recovery.py",
    "tests/e2e/test_worker.py",
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
        *session.posargs,
        env={"EMQ_TEST_REDIS_URL": url},
    )
    session.log(f"celery {celery} / kombu {kombu}: {time.monotonic() - started:.0f} s")
