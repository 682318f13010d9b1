"""The chaos run's ledger and its verdict: lost tasks, duplicates and what explains each.

A *run* is one execution of a task body, read from the ledger the tasks write
(see ``bench/chaos_app.py``); it *completed* when its body finished. A task is

- **lost** when its publish was acknowledged and no run of it completed;
- **duplicated** when more than one of its runs completed.

A *rerun* is a run that started after a run of the same job (message) had
completed, or the first run of a second job with the same task id. Every
duplicate comes from a rerun; a rerun that is killed in turn is listed too,
as it ran a finished task again. A rerun is *explained* only by something that
can make a finished task run again:

- ``kill_while_running``: the process that ran the completed run (its whole
  worker, or under prefork its pool child) was SIGKILLed while the body ran;
- ``kill_before_ack``: that process was killed after the body finished and
  before the rerun started (the ack never reached Redis);
- ``redis_restart``: Redis was down at some point between the completed run's
  start and the rerun's start;
- ``publish_retry``: the rerun belongs to another job with the same task id,
  and that task's publish raised and was retried (the first attempt reached
  Redis but its reply did not).
- ``lost_write``: Redis crashed and was restarted from a snapshot (losing
  every write since it was taken: acks, claims, start records) after the
  completed run started and before the rerun started. A claim lost while its run goes on
  makes a rerun that overlaps it.

A publish acknowledged after a snapshot and before the crash that restarted
Redis from it was *taken* by the fault: it is counted apart, and is not lost
(if it never ran, the server forgot it, as documented); every task whose
publish the snapshot held must complete.

Anything else is ``unexplained``. A kill is matched on the worker's node name
(unique per incarnation) and, for a pool child, on the pid; its time is
bracketed by clock reads taken just before and just after the signal.
"""

from __future__ import annotations

import json
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from itertools import pairwise
from pathlib import Path
from typing import Any

KILL_WHILE_RUNNING = "kill_while_running"
KILL_BEFORE_ACK = "kill_before_ack"
REDIS_RESTART = "redis_restart"
PUBLISH_RETRY = "publish_retry"
LOST_WRITE = "lost_write"
UNEXPLAINED = "unexplained"
EXPLANATIONS = (KILL_WHILE_RUNNING, KILL_BEFORE_ACK, REDIS_RESTART, PUBLISH_RETRY, LOST_WRITE)


@dataclass
class Run:
    """One execution of a task body."""

    task: str
    run: str
    start: float
    pid: int
    worker: str
    job: str | None
    token: int | None
    stalled: int = 0
    end: float | None = None


@dataclass
class Kill:
    """One SIGKILL the chaos run sent: a whole worker (its process group) or a pool child."""

    t_before: float
    t_after: float
    kind: str  # "worker" or "child"
    worker: str
    pid: int
    open_runs: int = 0  # runs the ledger showed running in the target when it was killed


@dataclass
class Restart:
    """One Redis restart: down from ``t_down`` (stop signal) until it answered at ``t_up``."""

    t_down: float
    t_up: float


@dataclass
class LostWrites:
    """One restart from a snapshot: taken at ``t_snap``, SIGKILLed at ``t_down``, back at ``t_up``.

    Every write Redis acknowledged in (``t_snap``, ``t_down``) is lost. A publish
    is noted when it returns, which can be just after ``t_down`` for one whose
    reply was read just before the kill; and none succeeds while the server is
    down: so every publish noted in (``t_snap``, ``t_up``) was written before the
    crash, and taken by it.
    """

    t_snap: float
    t_down: float
    t_up: float


@dataclass
class Ledger:
    """The runs read so far from a ledger file, read on from where the last read stopped."""

    path: Path
    runs: dict[str, Run] = field(default_factory=dict)
    completed: set[str] = field(default_factory=set)
    bad_lines: int = 0
    _offset: int = 0
    _partial: bytes = b""

    def poll(self) -> None:
        """Read the lines appended since the last call."""
        try:
            with open(self.path, "rb") as fh:
                fh.seek(self._offset)
                data = fh.read()
        except FileNotFoundError:
            return
        self._offset += len(data)
        data = self._partial + data
        lines = data.split(b"\n")
        self._partial = lines.pop()
        for line in lines:
            self._apply(line)

    def _apply(self, line: bytes) -> None:
        try:
            rec = json.loads(line)
            if rec["e"] == "S":
                self.runs[rec["run"]] = Run(
                    task=rec["task"],
                    run=rec["run"],
                    start=float(rec["t"]),
                    pid=int(rec["pid"]),
                    worker=rec["worker"],
                    job=rec["job"],
                    token=rec["token"],
                    stalled=int(rec["stalled"]),
                )
            elif rec["e"] == "E":
                self.runs[rec["run"]].end = float(rec["t"])
                self.completed.add(rec["task"])
            else:
                self.bad_lines += 1
        except (ValueError, KeyError, TypeError):
            self.bad_lines += 1

    def open_runs(self) -> list[Run]:
        """Runs that started and have not finished (running, or killed)."""
        return [r for r in self.runs.values() if r.end is None]


def _kill_hits(kill: Kill, run: Run) -> bool:
    return kill.worker == run.worker and (kill.kind == "worker" or kill.pid == run.pid)


def _older(run: Run, than: Run) -> bool:
    """Whether ``run`` ran on an older claim of the same job than ``than``."""
    if run.job != than.job or run.token is None or than.token is None:
        return False
    return run.token < than.token


def explain(
    run: Run,
    next_run: Run,
    publish_attempts: int,
    kills: Iterable[Kill],
    restarts: Iterable[Restart],
    lost_writes: Iterable[LostWrites] = (),
) -> list[str]:
    """Return every cause (see the module doc) that explains ``next_run`` after ``run``.

    Ordered by precedence: a kill of the process, a Redis restart, a lost
    write. Empty when nothing explains it.
    """
    if next_run.job != run.job:
        return [PUBLISH_RETRY] if publish_attempts > 1 else []
    assert run.end is not None
    end = run.end
    hits = [k for k in kills if _kill_hits(k, run)]
    causes = []
    # The kill landed between t_before and t_after: it explains the rerun only
    # if that interval meets the window.
    if any(k.t_after >= run.start and k.t_before <= end for k in hits):
        causes.append(KILL_WHILE_RUNNING)
    if any(k.t_after >= end and k.t_before <= next_run.start for k in hits):
        causes.append(KILL_BEFORE_ACK)
    if any(r.t_up >= run.start and r.t_down <= next_run.start for r in restarts):
        causes.append(REDIS_RESTART)
    # Whatever started after the crash was claimed from the snapshot's state.
    if any(run.start <= w.t_down <= next_run.start for w in lost_writes):
        causes.append(LOST_WRITE)
    return causes


def judge(
    published: Mapping[str, int],
    runs: Iterable[Run],
    kills: list[Kill],
    restarts: list[Restart],
    lost_writes: Sequence[LostWrites] = (),
    published_at: Mapping[str, float] | None = None,
) -> dict[str, Any]:
    """Return the verdict over every published task.

    Every *rerun* is listed with its explanation: a run that started after a
    run of the same job had completed, or the first run of a second job
    (message) with the same task id.

    Args:
        published: task id -> publish attempts, for each task whose publish was
            acknowledged.
        runs: every run the ledger holds.
        kills, restarts, lost_writes: what the chaos run did, with times.
        published_at: task id -> when its publish was acknowledged; a publish
            acknowledged between a snapshot and its crash was taken by the fault.
    """
    by_task: dict[str, list[Run]] = defaultdict(list)
    for r in runs:
        by_task[r.task].append(r)
    at = published_at or {}
    taken = {
        t for t in published if t in at and any(w.t_snap < at[t] < w.t_up for w in lost_writes)
    }
    unrun = sorted(t for t in published if not any(r.end is not None for r in by_task.get(t, ())))
    lost = [t for t in unrun if t not in taken]
    reruns: list[dict[str, Any]] = []
    concurrent = 0
    for task, task_runs in by_task.items():
        task_runs.sort(key=lambda r: r.start)
        by_job: dict[str | None, list[Run]] = defaultdict(list)
        for r in task_runs:
            by_job[r.job].append(r)
        pairs: list[tuple[Run, Run]] = []
        for job_runs in by_job.values():
            pairs += [(r, n) for r, n in pairwise(job_runs) if r.end is not None]
        firsts = [job_runs[0] for job_runs in by_job.values()]
        pairs += [(firsts[0], other) for other in firsts[1:]]
        for r, nxt in pairs:
            if r.end is not None and nxt.start < r.end:
                concurrent += 1
            causes = explain(r, nxt, published.get(task, 0), kills, restarts, lost_writes)
            reruns.append(
                {
                    "task": task,
                    "explanation": causes[0] if causes else UNEXPLAINED,
                    "causes": causes,
                    # The rerun ran on a claim older than the completed run's:
                    # a delivery its worker still ran after the job was claimed again.
                    "older_claim": _older(nxt, r),
                    "run": asdict(r),
                    "next_run": asdict(nxt),
                }
            )
    completed_per_task = {t: sum(1 for r in rs if r.end is not None) for t, rs in by_task.items()}
    by_why = {w: 0 for w in (*EXPLANATIONS, UNEXPLAINED)}
    for d in reruns:
        by_why[d["explanation"]] += 1
    return {
        "published": len(published),
        "publish_retried": sum(1 for a in published.values() if a > 1),
        "completed": len(published) - len(unrun),
        "lost": len(lost),
        "lost_tasks": lost,
        "publishes_taken_by_lost_writes": len(taken),
        "taken_and_never_run": [t for t in unrun if t in taken],
        "runs": sum(len(rs) for rs in by_task.values()),
        "runs_interrupted": sum(1 for rs in by_task.values() for r in rs if r.end is None),
        "duplicated_tasks": sum(1 for n in completed_per_task.values() if n > 1),
        "extra_completions": sum(n - 1 for n in completed_per_task.values() if n > 1),
        "reruns": len(reruns),
        "reruns_by_explanation": by_why,
        "unexplained_reruns": by_why[UNEXPLAINED],
        "reruns_a_redis_restart_may_explain": sum(
            1 for d in reruns if REDIS_RESTART in d["causes"]
        ),
        "reruns_a_lost_write_may_explain": sum(1 for d in reruns if LOST_WRITE in d["causes"]),
        "concurrent_runs": concurrent,
        "reruns_on_an_older_claim": sum(1 for d in reruns if d["older_claim"]),
        "most_runs_per_task": max((len(rs) for rs in by_task.values()), default=0),
        "most_completed_runs_per_task": max(completed_per_task.values(), default=0),
        "runs_of_unpublished_tasks": sum(1 for t in by_task if t not in published),
        "recovery_s": recovery(by_task, kills),
        "rerun_details": reruns,
    }


def recovery(by_task: Mapping[str, list[Run]], kills: Sequence[Kill]) -> dict[str, Any]:
    """How long after each whole-worker kill its interrupted tasks were running again.

    For each kill of a worker, the runs the ledger shows open in it at the kill;
    the kill's recovery time is from the signal to the start of the last of
    those tasks' next runs (a kill that interrupted nothing has none).
    """
    times = []
    for k in kills:
        if k.kind != "worker":
            continue
        last = None
        for task_runs in by_task.values():
            for i, r in enumerate(task_runs):
                cut = r.worker == k.worker and r.start <= k.t_before
                if not cut or (r.end is not None and r.end <= k.t_before):
                    continue
                nxt = next((n for n in task_runs[i + 1 :] if n.start > k.t_after), None)
                if nxt is not None:
                    last = max(last or 0.0, nxt.start - k.t_before)
        if last is not None:
            times.append(last)
    times.sort()
    return {
        "kills": len(times),
        "median": round(times[len(times) // 2], 2) if times else None,
        "max": round(times[-1], 2) if times else None,
    }
