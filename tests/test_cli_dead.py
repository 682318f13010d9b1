"""``celery emq dead show/retry/purge``: every id must match, and everything takes ``--all``."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import redis
from celery import Celery
from click.testing import CliRunner, Result

from celery_emq.ops import cli_dead
from celery_emq.ops.cli import emq as emq_cli
from celery_emq.store.jobstore import JobStore
from tests.test_morgue import snapshot, two_dead

__all__ = ["two_dead"]  # the fixture the `dead` one builds on


def run(app: Celery, *args: str, input: str | None = None) -> Result:
    return CliRunner().invoke(emq_cli, list(args), obj=SimpleNamespace(app=app), input=input)


@pytest.fixture
def dead(two_dead: tuple[str, str]) -> dict[str, str]:
    """Two dead jobs: ``a`` in queue ``celery``, ``b`` in queue ``other``."""
    return dict(zip("ab", two_dead, strict=True))


@pytest.mark.parametrize("verb", ["retry", "purge", "show"])
@pytest.mark.parametrize("given", [["nope"], ["a", "nope"], ["b", "a", "nada", "nope"]])
def test_an_unknown_id_fails_names_it_and_changes_nothing(
    app: Celery,
    client: redis.Redis,
    prefix: str,
    dead: dict[str, str],
    verb: str,
    given: list[str],
) -> None:
    ids = [dead.get(i, i) for i in given]
    unknown = [i for i in ids if i in ("nope", "nada")]
    before = snapshot(client, prefix)
    done = run(app, "dead", verb, *ids)
    assert done.exit_code == 1, done.output
    assert f"{', '.join(map(repr, unknown))} in any queue's morgue" in done.output
    assert "retried" not in done.output and "purged" not in done.output
    assert snapshot(client, prefix) == before


@pytest.mark.parametrize("verb", ["retry", "purge"])
def test_json_names_the_missing_ids_too(
    app: Celery, client: redis.Redis, prefix: str, dead: dict[str, str], verb: str
) -> None:
    before = snapshot(client, prefix)
    done = run(app, "dead", verb, dead["a"], "nope", "--json")
    assert done.exit_code == 1
    assert json.loads(done.stdout)["missing"] == ["nope"]
    assert snapshot(client, prefix) == before


def test_show_takes_several_ids(app: Celery, dead: dict[str, str]) -> None:
    done = run(app, "dead", "show", dead["a"], dead["b"], "--json")
    assert done.exit_code == 0, done.output
    assert [j["id"] for j in json.loads(done.stdout)] == [dead["a"], dead["b"]]
    one = run(app, "dead", "show", dead["b"], "--json")
    assert json.loads(one.stdout)["queue"] == "other"


@pytest.mark.parametrize("verb", ["retry", "purge"])
def test_a_whole_queue_or_morgue_takes_all(
    app: Celery, client: redis.Redis, prefix: str, dead: dict[str, str], verb: str
) -> None:
    before = snapshot(client, prefix)
    for args in ([], ["--queue", "other"]):
        done = run(app, "dead", verb, *args)
        assert done.exit_code != 0
        assert "--all" in done.output
    assert snapshot(client, prefix) == before
    done = run(app, "dead", verb, "--queue", "other", "--all", "--json", "-f")
    assert done.exit_code == 0, done.output
    remaining = json.loads(run(app, "dead", "ls", "--json").stdout)["jobs"]
    assert [j["id"] for j in remaining] == [dead["a"]]


@pytest.mark.parametrize("verb", ["retry", "purge"])
def test_on_a_terminal_all_asks_first(
    app: Celery,
    client: redis.Redis,
    prefix: str,
    dead: dict[str, str],
    verb: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(cli_dead, "_interactive", lambda: True)
    before = snapshot(client, prefix)
    refused = run(app, "dead", verb, "--all", input="n\n")
    assert refused.exit_code == 1
    assert f"{verb} 2 dead job(s) of every queue?" in refused.output
    assert snapshot(client, prefix) == before
    forced = run(app, "dead", verb, "--all", "-f")
    assert forced.exit_code == 0, forced.output
    assert "?" not in forced.output
    assert json.loads(run(app, "dead", "ls", "--json").stdout)["jobs"] == []


@pytest.mark.parametrize("verb", ["retry", "purge"])
def test_dry_run_says_what_would_happen(
    app: Celery, client: redis.Redis, prefix: str, dead: dict[str, str], verb: str
) -> None:
    before = snapshot(client, prefix)
    done = run(app, "dead", verb, "--all", "--dry-run")
    assert done.exit_code == 0, done.output
    assert f"dry run: would {verb} 2 job(s)" in done.output
    assert dead["a"] in done.output and dead["b"] in done.output
    listed = run(app, "dead", verb, dead["b"], "--dry-run", "--json")
    assert json.loads(listed.stdout) == {"dry_run": True, "jobs": [dead["b"]], "missing": []}
    unknown = run(app, "dead", verb, dead["b"], "nope", "--dry-run")
    assert unknown.exit_code == 1 and "'nope'" in unknown.output
    assert snapshot(client, prefix) == before


def test_known_ids_act_on_those_only(app: Celery, store: JobStore, dead: dict[str, str]) -> None:
    retried = run(app, "dead", "retry", dead["a"], "--json")
    assert json.loads(retried.stdout) == {"retried": [dead["a"]], "missing": []}
    purged = run(app, "dead", "purge", dead["b"], "--json")
    assert json.loads(purged.stdout) == {"purged": 1, "missing": []}
    assert store.counts("celery")["pending"] == 1 and store.counts("other")["dead"] == 0


@pytest.mark.parametrize("how", [["--all"], ["--reason", "stalled"], ["--queue", "other", "--all"]])
def test_purge_without_a_terminal_refuses_unless_forced(
    app: Celery, client: redis.Redis, prefix: str, dead: dict[str, str], how: list[str]
) -> None:
    # `... | tee log` is no terminal: a bulk purge there is refused, as `celery purge` asks.
    before = snapshot(client, prefix)
    refused = run(app, "dead", "purge", *how)
    assert refused.exit_code == 1, refused.output
    assert "-f" in refused.output and "no terminal" in refused.output
    assert "purged" not in refused.output
    assert snapshot(client, prefix) == before
    forced = run(app, "dead", "purge", *how, "-f")
    assert forced.exit_code == 0, forced.output
    assert snapshot(client, prefix) != before


@pytest.mark.parametrize("verb", ["retry", "purge"])
def test_an_unknown_task_id_fails_like_an_unknown_job_id(
    app: Celery, client: redis.Redis, prefix: str, dead: dict[str, str], verb: str
) -> None:
    before = snapshot(client, prefix)
    done = run(app, "dead", verb, "--task-id", "nosuch", "-f")
    assert done.exit_code == 1, done.output
    assert "'nosuch'" in done.output
    assert snapshot(client, prefix) == before
