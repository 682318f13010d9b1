"""Every key a script touches stays in its queue's cluster slot (no cluster needed)."""

from __future__ import annotations

from typing import Any

import pytest
from redis.cluster import key_slot

from celery_emq import InvalidOptionError
from celery_emq.errors import InvalidQueueNameError
from celery_emq.options import EmqOptions
from celery_emq.store.jobstore import JobStore
from celery_emq.store.keys import QueueKeys
from celery_emq.store.scripts import Scripts


def slot(key: str) -> int:
    return key_slot(key.encode())


@pytest.mark.parametrize("name", ["a{b", "a}b", "{q}", "}x{", "x{}"])
def test_a_queue_name_with_a_brace_is_refused(name: str) -> None:
    with pytest.raises(InvalidQueueNameError, match="'\\{' or '\\}'"):
        QueueKeys("emq", name)


@pytest.mark.parametrize("prefix", ["t{", "t}", "{t}:", "x{}:"])
def test_a_global_keyprefix_with_a_brace_is_refused(prefix: str) -> None:
    with pytest.raises(InvalidOptionError, match="global_keyprefix"):
        EmqOptions.from_transport_options({"global_keyprefix": prefix})


@pytest.mark.parametrize("group", ["{x}", "}", "{", "a}{b", "{}"])
def test_a_group_with_braces_keeps_its_lane_in_the_queue_slot(group: str) -> None:
    # The queue's tag comes first in every key, and Redis hashes the first
    # {...} only: nothing after it can move a lane to another slot.
    k = QueueKeys("t:emq", "tasks")
    assert slot(k.lane(group)) == slot(k.pending)


def test_every_script_call_keeps_to_one_slot(
    store: JobStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    seen: dict[str, int] = {}
    run = Scripts.run

    def checked(self: Scripts, name: str, keys: Any, args: Any) -> Any:
        assert len({slot(k) for k in keys}) == 1, (name, keys)
        seen[name] = seen.get(name, 0) + 1
        return run(self, name, keys, args)

    monkeypatch.setattr(Scripts, "run", checked)
    for queue in ("celery", "a.b:c", "x" * 100):
        store.enqueue(queue, "1", "{}", group="{g}")
        store.enqueue(queue, "2", "{}", eta_ms=store.server_ms() + 60_000, task_id="t2")
        store.enqueue(queue, "3", "{}")
        store.promote_tasks(queue, ["t2"])
        claimed = store.claim(queue, "me", 3)
        store.start(queue, "1", 1)
        store.extend(queue, [(c.id, c.token) for c in claimed])
        store.release(queue, "3", 1)
        store.bury(queue, "2", 1, "rejected")
        store.retry(queue, ["2"])
        store.sweep(queue, 1, now_ms=store.server_ms() + 10**7, dead_max_size=1)
        store.reap(queue, now_ms=store.server_ms() + 10**8)
        store.tally(queue, heads=True)
        store.scripts.oldest(store.keys(queue), 0, 10, 0, 10)
        store.give_back(queue)
        store.ack(queue, "1", 1)
        store.purge_dead(queue, ["2"])
        store.purge(queue)
    assert set(seen) >= {
        "enqueue", "promote", "claim", "start", "extend", "release", "bury", "retry",
        "sweep", "reap", "tally", "oldest", "give_back", "ack", "purge_dead", "purge",
    }  # fmt: skip


def test_a_cluster_in_transition_is_a_connection_error_to_celery() -> None:
    # CLUSTERDOWN while a master fails over, TRYAGAIN while slots move: Celery
    # must reconnect and retry, not stop the worker.
    from kombu import Connection
    from redis.exceptions import ClusterDownError, MasterDownError, TryAgainError

    import celery_emq  # noqa: F401  (registers emq://)

    errors = Connection("emq+cluster://127.0.0.1:7000/0").connection_errors
    for error in (ClusterDownError, MasterDownError, TryAgainError):
        assert issubclass(error, errors)
