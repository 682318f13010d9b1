"""The chaos run's verdict: what counts as lost, as a duplicate, and what explains a rerun."""

from __future__ import annotations

import json
from pathlib import Path

from bench.chaos_verdict import Kill, Ledger, LostWrites, Restart, Run, judge


def run(
    task: str,
    start: float,
    end: float | None,
    worker: str = "w1.1@chaos",
    pid: int = 100,
    job: str = "j1",
    name: str = "",
) -> Run:
    return Run(task, name or f"{task}-{start}", start, pid, worker, job, 1, 0, end)


def test_a_task_with_no_completed_run_is_lost() -> None:
    runs = [run("a", 1.0, 1.1), run("b", 1.0, None)]
    v = judge({"a": 1, "b": 1, "c": 1}, runs, [], [])
    assert v["lost_tasks"] == ["b", "c"]
    assert v["completed"] == 1
    assert v["runs_interrupted"] == 1


def test_a_killed_run_then_a_completed_one_is_no_duplicate() -> None:
    runs = [run("a", 1.0, None), run("a", 5.0, 5.1)]
    v = judge({"a": 1}, runs, [], [])
    assert v["lost"] == 0
    assert v["duplicated_tasks"] == 0
    assert v["reruns"] == 0
    assert v["most_runs_per_task"] == 2


def test_a_rerun_with_nothing_to_explain_it_is_unexplained() -> None:
    runs = [run("a", 1.0, 1.1), run("a", 5.0, 5.1)]
    # A kill of another pool child of the same worker, and of another worker.
    kills = [
        Kill(1.05, 1.05, "child", "w1.1@chaos", 999),
        Kill(1.05, 1.05, "worker", "w2.1@chaos", 200),
    ]
    v = judge({"a": 1}, runs, kills, [Restart(6.0, 7.0)])
    assert v["duplicated_tasks"] == 1
    assert v["extra_completions"] == 1
    assert v["unexplained_reruns"] == 1
    assert v["rerun_details"][0]["causes"] == []


def test_a_kill_of_the_process_explains_the_rerun() -> None:
    runs = [run("a", 1.0, 1.1), run("a", 5.0, 5.1)]
    during = judge({"a": 1}, runs, [Kill(1.05, 1.06, "child", "w1.1@chaos", 100)], [])
    assert during["rerun_details"][0]["explanation"] == "kill_while_running"
    after = judge({"a": 1}, runs, [Kill(2.0, 2.0, "worker", "w1.1@chaos", 1)], [])
    assert after["rerun_details"][0]["explanation"] == "kill_before_ack"
    assert after["unexplained_reruns"] == 0
    # A kill after the rerun started explains nothing.
    late = judge({"a": 1}, runs, [Kill(5.01, 5.02, "worker", "w1.1@chaos", 1)], [])
    assert late["unexplained_reruns"] == 1


def test_a_redis_restart_between_the_runs_explains_the_rerun() -> None:
    runs = [run("a", 1.0, 1.1), run("a", 5.0, 5.1)]
    v = judge({"a": 1}, runs, [], [Restart(0.5, 1.02)])
    assert v["rerun_details"][0]["causes"] == ["redis_restart"]
    assert v["reruns_a_redis_restart_may_explain"] == 1
    before = judge({"a": 1}, runs, [], [Restart(0.1, 0.9)])
    assert before["unexplained_reruns"] == 1


def test_a_second_message_is_explained_only_by_a_retried_publish() -> None:
    runs = [run("a", 1.0, 1.1, job="j1"), run("a", 1.5, 1.6, job="j2")]
    once = judge({"a": 1}, runs, [], [])
    assert once["unexplained_reruns"] == 1
    retried = judge({"a": 2}, runs, [], [])
    assert retried["rerun_details"][0]["explanation"] == "publish_retry"
    assert retried["duplicated_tasks"] == 1


def test_a_rerun_that_overlaps_its_completed_run_is_counted_concurrent() -> None:
    runs = [run("a", 1.0, 3.0), run("a", 2.0, 2.5, worker="w2.1@chaos")]
    v = judge({"a": 1}, runs, [], [])
    assert v["concurrent_runs"] == 1
    assert v["unexplained_reruns"] == 1


def test_the_ledger_reads_lines_split_across_reads(tmp_path: Path) -> None:
    path = tmp_path / "ledger.jsonl"
    start = {
        "e": "S",
        "task": "a",
        "run": "r1",
        "t": 1.0,
        "pid": 7,
        "worker": "w",
        "job": "j",
        "token": 1,
        "stalled": 0,
    }
    line = (json.dumps(start) + "\n").encode()
    path.write_bytes(line[:10])
    ledger = Ledger(path)
    ledger.poll()
    assert ledger.runs == {}
    with open(path, "ab") as fh:
        fh.write(line[10:] + b'{"e":"E","task":"a","run":"r1","t":2.0}\n')
    ledger.poll()
    assert ledger.runs["r1"].end == 2.0
    assert ledger.completed == {"a"}
    assert ledger.bad_lines == 0


def test_a_rerun_on_an_older_claim_is_flagged() -> None:
    newer = Run("a", "r2", 1.0, 100, "w1.1@chaos", "j1", 2, 0, 1.1)
    older = Run("a", "r1", 2.0, 200, "w2.1@chaos", "j1", 1, 0, 2.1)
    v = judge({"a": 1}, [newer, older], [], [])
    assert v["reruns_on_an_older_claim"] == 1
    assert v["rerun_details"][0]["older_claim"] is True
    assert (
        judge({"a": 1}, [run("a", 1.0, 1.1), run("a", 2.0, 2.1)], [], [])[
            "reruns_on_an_older_claim"
        ]
        == 0
    )


def test_a_restart_from_a_snapshot_explains_a_rerun_across_it() -> None:
    fault = LostWrites(t_snap=0.9, t_down=2.0, t_up=2.5)
    across = judge({"a": 1}, [run("a", 1.0, 1.1), run("a", 5.0, 5.1)], [], [], [fault])
    assert across["rerun_details"][0]["causes"] == ["lost_write"]
    assert across["unexplained_reruns"] == 0
    # A rerun that started before the restart, or a first run that started after it.
    before = judge({"a": 1}, [run("a", 1.0, 1.1), run("a", 1.5, 1.6)], [], [], [fault])
    after = judge({"a": 1}, [run("a", 3.0, 3.1), run("a", 5.0, 5.1)], [], [], [fault])
    assert (before["unexplained_reruns"], after["unexplained_reruns"]) == (1, 1)
    # An AOF restart is not a lost write, nor the other way round.
    aof = judge({"a": 1}, [run("a", 1.0, 1.1), run("a", 5.0, 5.1)], [], [Restart(2.0, 2.5)])
    assert aof["rerun_details"][0]["causes"] == ["redis_restart"]


def test_a_claim_lost_while_its_run_goes_on_is_a_concurrent_rerun_a_lost_write_explains() -> None:
    runs = [run("a", 1.0, 4.0), run("a", 3.0, 3.5, worker="w2.1@chaos")]
    v = judge({"a": 1}, runs, [], [], [LostWrites(0.5, 2.0, 2.5)])
    assert v["concurrent_runs"] == 1
    assert v["rerun_details"][0]["explanation"] == "lost_write"
    assert v["unexplained_reruns"] == 0


def test_publishes_a_lost_write_took_are_counted_apart_from_the_lost() -> None:
    published = {"held": 1, "held-unrun": 1, "taken-ran": 1, "taken": 1, "later": 1}
    at = {"held": 0.5, "held-unrun": 0.6, "taken-ran": 1.2, "taken": 1.5, "later": 3.0}
    runs = [
        run("held", 2.6, 2.7, job="j1"),
        run("taken-ran", 1.3, 1.4, job="j2"),
        run("later", 3.1, 3.2, job="j3"),
    ]
    fault = LostWrites(1.0, 2.0, 2.5)
    v = judge(published, runs, [], [], [fault], published_at=at)
    # Every task whose publish the snapshot held ran; the fault took two publishes
    # (acknowledged after the snapshot, before the crash), one of which had run.
    assert v["lost_tasks"] == ["held-unrun"]
    assert v["publishes_taken_by_lost_writes"] == 2
    assert v["taken_and_never_run"] == ["taken"]
    assert v["completed"] == 3
    plain = judge(published, runs, [], [], published_at=at)
    assert plain["lost_tasks"] == ["held-unrun", "taken"]
    assert plain["publishes_taken_by_lost_writes"] == 0


def test_a_publish_seen_to_return_after_the_crash_was_acknowledged_before_it() -> None:
    # The publisher notes a publish's time once it returns; the crash's time is
    # noted once the killed server has exited. A reply read just before the kill
    # can be noted after it: while the server is down no publish succeeds, so
    # one that returned before the server was back was written before the crash.
    published = {"at-the-crash": 1, "after": 1}
    at = {"at-the-crash": 2.001, "after": 2.6}
    runs = [run("after", 2.7, 2.8, job="j1")]
    v = judge(published, runs, [], [], [LostWrites(1.0, 2.0, 2.5)], published_at=at)
    assert v["lost_tasks"] == []
    assert v["taken_and_never_run"] == ["at-the-crash"]


def test_a_worker_kills_recovery_is_until_its_last_interrupted_task_runs_again() -> None:
    runs = [
        run("a", 10.0, None, worker="w1"),  # cut by the kill at 12: again at 15.5
        run("a", 15.5, 16.0, worker="w2"),
        run("b", 11.0, None, worker="w1"),  # cut too: again at 14
        run("b", 14.0, 14.5, worker="w2"),
        run("c", 11.0, 11.5, worker="w1"),  # finished before the kill
        run("d", 11.0, None, worker="w3"),  # another worker's
        run("d", 20.0, 21.0, worker="w3"),
    ]
    kills = [Kill(12.0, 12.1, "worker", "w1", 1), Kill(13.0, 13.1, "child", "w3", 7)]
    verdict = judge({t: 1 for t in "abcd"}, runs, kills, [])
    assert verdict["recovery_s"] == {"kills": 1, "median": 3.5, "max": 3.5}
