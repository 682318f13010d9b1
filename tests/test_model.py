"""A stateful model of the job store, checked against the real scripts on a real Redis.

Three workers share one queue while a clock moves (every call names ``now_ms``):
they enqueue (into the default lane or one of two fair lanes, at priorities 0..2,
some jobs with a stall budget of their own), claim (plainly, after popping a wake
marker, or never: a marker popped and lost by a consumer killed between BRPOP and
claim), start, extend, ack, release, bury and charge their claims, freeze (their
claims lapse unless they resume in time), and settle stale claims they held
earlier, while sweeps, reaps, retries, purges and trims run in between. Every
claim ever made is kept, so stale tokens keep being tried. And the server
forgets its last writes: the keys are saved at one step and put back at a later
one (a restart from a snapshot, a failover to a replica that lagged), while the
workers remember every claim they made since.

A Python model says from the rules alone what every call must answer and where
every job must be, and the keys are read back after each step:

* each job is in exactly one of its lane, ``active`` or ``dead``, or gone with
  its row; the row's ``state`` says where it is; a claimed job's ``deliveries``
  and claim id are the model's live claim, its lease deadline and owner are the
  model's;
* no claim id is ever issued twice, not even after the server forgot the claims
  made since the keys were saved (the delivery count then repeats): so of all the
  claims a job ever had, one at most is live and able to settle, start or renew;
* each lane holds its jobs in the model's order: priority, then jobs put back
  (newest batch first, a batch in its own order), then FIFO;
* stall counts (and history entries) are the lapses the model counted: a lapsed
  claim counts only if its task had started, a charge always does;
* a job past its budget is doomed: it stays lapsed in ``active``, counted in its row
  only, until it is retired (to the morgue, or deleted as done); a sweeper that dies
  before it retires one (the script step alone) leaves it for the next pass, which
  counts nothing twice;
* a settle never changes a live claim of another job, and a stale settle none
  (each one is counted in ``metrics:fenced`` by verb when the job is held by
  another claim): a worker whose claim was lost never settles, starts or renews
  the run under way on the job's live claim;
* the counters add up to what the model counted.

Wake markers: a script keeps one marker per claimable job, and only a consumer
that pops a marker and then dies (it never claims) can take one away for
nothing. So ``LLEN(wake) <= claimable`` always, and
``claimable - LLEN(wake) <= markers lost since the queue was last empty``
(when nothing is claimable the list is empty, so the deficit starts from 0).
"""

from __future__ import annotations

import copy
import json
import os
import uuid
from dataclasses import dataclass, replace
from typing import Any

import hypothesis.strategies as st
import redis
from hypothesis import HealthCheck, event, settings
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from celery_emq.store.codec import pack
from celery_emq.store.jobstore import JobStore
from celery_emq.store.outcomes import UNSET, Claimed, Outcome, Swept
from tests.conftest import REDIS_URL, delete_prefix, dump_keys, forget_writes

QUEUE = "q"
LEASE_MS = 1000
OWNERS = ("w0", "w1", "w2")
GROUPS = ("ga", "gb")
#: Most stalls a row's history keeps.
HISTORY = 20
#: The sweep's budget for jobs that carry none of their own.
DEFAULT_BUDGET = 1
#: Lapses before a start the model's sweeps forgive (``max_lapsed``).
MAX_LAPSED = 2
#: Lanes a sweep looks at for a claimable job when the wake list is empty (sweep.lua).
LANES_LOOKED = 8
#: Most suspects one claim passes over (claim.lua's LOOK).
CLAIM_LOOK = 32
METRICS = ("completed", "recovered", "stalled", "failed", "retried")
#: Which claim a settle names (see ``JobStoreModel._claims_of``).
KINDS = ("live", "fenced", "lapsed", "any")
# Hypothesis leans towards the first of sampled values: put the ones that make
# several claims lapse together (and so batches go back together) first.
#: How many jobs one claim asks for.
COUNTS = st.sampled_from([3, 2, 1])
#: How many lapsed claims one sweep or reap examines.
LIMITS = st.sampled_from([500, 2, 1])
#: A job to publish: priority, lane ('' is the default lane) and stall budget (UNSET: default).
#: Half the jobs share priority 0 and the default lane, so batches put back share a lane.
JOBS = st.tuples(
    st.sampled_from([0, 0, 1, 2]),
    st.sampled_from(["", "", *GROUPS]),
    st.sampled_from([UNSET, None, 0, 2]),
)


@dataclass
class Job:
    """What the model knows of one job."""

    id: str
    payload: bytes
    priority: int
    group: str
    budget: Any  # UNSET (the sweep's default), None (never dead-letter) or an int
    state: str = "pending"  # delayed | pending | active | dead | gone
    order: tuple[int, int] = (0, 0)  # (priority, position) in its lane while pending
    deliveries: int = 0
    token: str = ""  # the claim id of its latest claim
    started: str = ""  # the delivery count of the latest claim whose task started
    stalled: int = 0
    stalls: int = 0  # every stall counted, retries included: the history's entries
    owner: str = ""
    deadline: int = 0
    died_ms: int = 0
    completed: bool = False  # an older claim completed it while a newer one held it
    graced: int = 0  # the deadline an outage grace granted its claim
    eta: int = 0  # a delayed job's ETA
    revoked: bool = False  # promoted by a revoke of its task
    lapsed: int = 0  # lapses before a start since its last start: a suspect when > 0
    doomed: str = ""  # the claim id a sweep doomed it under (past its budget)
    dies: str = ""  # the outcome it is retired with unless it succeeded (dead | never_started)
    reason: str = ""  # the reason it is retired with


@dataclass(frozen=True)
class Claim:
    owner: str
    id: str
    token: str


class JobStoreModel(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.client = redis.Redis.from_url(REDIS_URL)
        self.prefix = f"t{uuid.uuid4().hex[:10]}:"
        self.store = JobStore(self.client, self.prefix + "emq", lease_ms=LEASE_MS)
        self.k = self.store.keys(QUEUE)
        self.now = 1_000_000
        self.jobs: dict[str, Job] = {}
        self.claims: list[Claim] = []
        self.holding: dict[str, list[tuple[str, str]]] = {o: [] for o in OWNERS}
        # Claims a frozen worker held: it neither settles nor renews them until it resumes.
        self.frozen: dict[str, list[tuple[str, str]]] = {o: [] for o in OWNERS}
        # Jobs ever published (ids never repeat, even after the server forgot some).
        self.published = 0
        # The saved keys and the model's view of the server then (see remember).
        self.saved: tuple[Any, dict[str, Any]] | None = None
        # Ordering state: tail and head positions, the groups with a lane, the lane served last.
        self.tail = 0
        self.head = 0
        self.lanes: set[str] = set()
        self.cursor = ""
        self.wake = 0
        self.lost = 0
        # Each owner's note of the suspect it was last handed (``<id> <claim id>``).
        self.suspect_notes: dict[str, str] = {}
        self.metrics = dict.fromkeys(METRICS, 0)
        # Per counter, the part of it each reason accounts for (field ``reason:<reason>``).
        self.reasons: dict[str, dict[str, int]] = {name: {} for name in METRICS}
        # When the last sweep ran, and the last gap between sweeps over half a lease.
        self.swept_at: int | None = None
        self.outage: tuple[int, int] | None = None
        # Settles that named a claim other than the job's live one, by verb.
        self.fenced: dict[str, int] = {}

    def teardown(self) -> None:
        delete_prefix(self.client, self.prefix)
        self.client.close()

    # -- the model --------------------------------------------------------------------

    def _in(self, *states: str) -> list[Job]:
        return [j for j in self.jobs.values() if j.state in states]

    def _lane(self, lane: str) -> list[Job]:
        jobs = [j for j in self._in("pending") if j.group == lane]
        return sorted(jobs, key=lambda j: (j.order, j.id))

    def _live(self, c: Claim) -> bool:
        job = self.jobs[c.id]
        return job.state == "active" and job.token == c.token

    def _fences(self, job: Job, token: str, verb: str) -> bool:
        """Whether a settle naming ``token`` is fenced: another claim holds the job."""
        if job.state == "active" and job.token != token:
            self.fenced[verb] = self.fenced.get(verb, 0) + 1
            return True
        return False

    def _take_marker(self) -> None:
        self.wake = max(0, self.wake - 1)

    def _to_front(self, batch: list[Job | None]) -> None:
        """Put a batch back at the front of its lanes, in order (``None`` keeps a place)."""
        n = len(batch)
        for i, job in enumerate(batch):
            if job is not None:
                job.state, job.owner = "pending", ""
                job.order = (job.priority, -(self.head + n - i))
                if job.group:
                    self.lanes.add(job.group)
                self.wake += 1
        self.head += n

    def _drop_empty_lane(self, job: Job) -> None:
        """A group whose lane a job left empty leaves ``lanes`` (ack and bury of pending)."""
        if job.group and not self._lane(job.group):
            self.lanes.discard(job.group)

    def _kill(self, job: Job) -> None:
        job.state, job.owner, job.died_ms = "dead", "", self.now

    def _pop(self, lane: str) -> Job | None:
        jobs = self._lane(lane)
        return jobs[0] if jobs else None

    def _claim_model(
        self, owner: str, count: int, held: int, take_suspect: bool = True, here: bool = True
    ) -> list[Claimed]:
        taken: list[Job] = []
        # Suspects passed over: out of their lane until the call ends, then back in place.
        passed: list[Job] = []
        may_take = take_suspect

        def offer(job: Job) -> bool:
            nonlocal may_take
            job.state = "passing"
            if job.lapsed:
                if not may_take:
                    passed.append(job)
                    return False
                may_take = False
            taken.append(job)
            return True

        if not self.lanes:
            want = count
            while want > 0:
                chunk = self._lane("")[:want]
                if not chunk:
                    break
                for job in chunk:
                    offer(job)
                want = count - len(taken)
                if len(passed) >= CLAIM_LOOK:
                    break
                want = min(want, CLAIM_LOOK - len(passed))
        else:
            # One job at a time over the default lane, then each group in name order.
            last, misses = self.cursor, 0
            while len(taken) < count and misses <= 1 and len(passed) < CLAIM_LOOK:
                after = sorted(g for g in self.lanes if g > last)
                nxt = after[0] if after else None
                lane = last = nxt or ""
                got = False
                while not got and len(passed) < CLAIM_LOOK:
                    job = self._pop(lane)
                    if job is None:
                        break
                    got = offer(job)
                if got:
                    misses = 0
                elif nxt is None:
                    misses += 1
                if nxt is not None and not self._lane(nxt):
                    self.lanes.discard(nxt)
            self.cursor = last
        for job in passed:
            job.state = "pending"
            if job.group:
                self.lanes.add(job.group)
        for job in taken:
            job.state = "active"
        expected = []
        for job in taken:
            job.deliveries += 1
            revoked = job.revoked
            job.owner, job.deadline = owner, self.now + LEASE_MS
            # The claim id is random: it is read from the answer (see _took).
            expected.append(
                Claimed(
                    job.id,
                    pack(job.payload),
                    job.stalled,
                    job.deliveries,
                    "",
                    revoked,
                    job.lapsed > 0,
                )
            )
        for job in taken:
            if job.lapsed:
                # Its claim id is read from the answer (see _took).
                self.suspect_notes[owner] = f"{job.id} ? {int(here)}"
        if not self._in("pending") and not self.lanes:
            self.wake, self.cursor = 0, ""
        else:
            self.wake = max(0, self.wake - max(0, len(taken) - held))
            # A marker popped for a job this call could not take goes back.
            self.wake += max(0, held - len(taken))
        return expected

    def _took(self, owner: str, claimed: list[Claimed], expected: list[Claimed]) -> None:
        """Check a claim's answer against the model and note the claim ids it made."""
        assert [replace(c, token="") for c in claimed] == expected
        for c in claimed:
            count, _, nonce = c.token.partition(".")
            assert count == str(c.deliveries) and len(nonce) == 16
            # Never issued before, to this job or any: the heart of fencing.
            older = [old.token for old in self.claims if old.id == c.id]
            assert c.token not in older
            if any(t.partition(".")[0] == count for t in older):
                # The server forgot a claim, and its delivery count was counted again.
                event("a delivery count issued again after lost writes")
            self.jobs[c.id].token = c.token
            if c.suspect:
                here = self.suspect_notes[owner].rpartition(" ")[2]
                self.suspect_notes[owner] = f"{c.id} {c.token} {here}"
            self.claims.append(Claim(owner, c.id, c.token))
            self.holding[owner].append((c.id, c.token))

    def _ack_model(self, job_id: str, token: str) -> Outcome:
        job = self.jobs[job_id]
        if job.state in ("gone", "delayed"):
            # Delayed: the claim was forgotten with the server's last writes.
            return Outcome.NOT_FOUND
        if self._fences(job, token, "ack"):
            # The only mark a stale ack leaves on a live claim: the job is done.
            job.completed = True
            return Outcome.FENCED
        outcome = {
            "active": Outcome.OK,
            "dead": Outcome.DEAD,
            "pending": Outcome.LEASE_LOST,
        }[job.state]
        was_pending = job.state == "pending"
        if was_pending:
            self._take_marker()
        job.state = "gone"
        if was_pending:
            self._drop_empty_lane(job)
        self.metrics["completed"] += 1
        return outcome

    def _done(self, job: Job) -> None:
        """A completed job leaves its (lost) live claim: deleted, counted completed."""
        job.state = "gone"
        self.metrics["completed"] += 1

    def _count(self, name: str, reason: str) -> None:
        """Count one event on a counter, with its reason."""
        self.metrics[name] += 1
        self.reasons[name][reason] = self.reasons[name].get(reason, 0) + 1

    def _stall(self, job: Job, reason: str) -> Swept:
        """Count one stall on an examined claim: recover or doom it."""
        job.stalled += 1
        job.stalls += 1
        budget = DEFAULT_BUDGET if job.budget is UNSET else job.budget
        if budget is not None and job.stalled > budget:
            return self._doom(job, "dead", reason)
        self._count("stalled", reason)
        self._count("recovered", reason)
        return Swept(job.id, "recovered", job.stalled, pack(job.payload))

    def _doom(self, job: Job, dies: str, reason: str) -> Swept:
        """Past its budget: marked, left lapsed in ``active``, nothing counted yet."""
        job.doomed, job.dies, job.reason = job.token, dies, reason
        event(f"doomed: {dies}")
        return Swept(job.id, "doomed", job.stalled, pack(job.payload))

    def _retire(self, job: Job, succeeded: bool) -> Outcome:
        """What ``retire`` does with a job: dead-letter it, or delete it as done."""
        if job.state != "active" or job.doomed != job.token:
            return Outcome.NOT_FOUND
        if succeeded or job.completed:
            self._done(job)
            return Outcome.COMPLETED
        self._kill(job)
        job.doomed = ""
        if job.reason != "never_started":
            self._count("stalled", job.reason)
        self._count("failed", job.reason)
        return Outcome.OK

    def _retired(self, swept: list[Swept]) -> list[Swept]:
        """A sweep's answer once each job it doomed is retired (``JobStore.sweep``, no verdict)."""
        out = []
        for s in swept:
            if s.outcome == "doomed":
                assert self._retire(self.jobs[s.id], succeeded=False) is Outcome.OK
                s = replace(s, outcome=self.jobs[s.id].dies)
            out.append(s)
        return out

    def _lapsed(self, limit: int) -> list[Job]:
        jobs = [j for j in self._in("active") if j.deadline <= self.now]
        return sorted(jobs, key=lambda j: (j.deadline, j.id))[:limit]

    def _frozen(self, c: Claim) -> bool:
        return (c.id, c.token) in self.frozen[c.owner]

    def _forget(self, c: Claim) -> None:
        for held in (self.holding[c.owner], self.frozen[c.owner]):
            if (c.id, c.token) in held:
                held.remove((c.id, c.token))

    def _claims_of(self, kind: str) -> list[Claim]:
        """``live``: the job's live claim (its worker not frozen); ``fenced``: an
        older claim of a job a newer claim holds; ``lapsed``: an older claim of a job
        now pending or dead; ``any``.
        """
        if kind == "live":
            return [c for c in self.claims if self._live(c) and not self._frozen(c)]
        if kind == "fenced":
            pool = [c for c in self.claims if self.jobs[c.id].state == "active"]
            return [c for c in pool if not self._live(c)]
        if kind == "lapsed":
            return [c for c in self.claims if self.jobs[c.id].state in ("pending", "dead")]
        return self.claims

    def _draw_claim(self, data: st.DataObject, kind: str) -> Claim:
        """Draw a claim of one kind, or any claim when there is none of that kind."""
        return data.draw(st.sampled_from(self._claims_of(kind) or self.claims))

    # -- reading the keys -------------------------------------------------------------

    def _others(self, claims: list[Claim]) -> tuple[list[str], Any]:
        """Read the keys of every live claim but those ``claims`` settle (before the model)."""
        settled = {c.id for c in claims if self._live(c)}
        ids = [j.id for j in self._in("active") if j.id not in settled]
        return ids, self._read_claims(ids)

    def _read_claims(self, ids: list[str]) -> Any:
        """Each job's row, and its score in every set (``None`` where it is not)."""
        if not ids:
            return []
        k = self.k
        with self.client.pipeline(transaction=False) as pipe:
            for key in (k.active, k.pending, k.dead, *(k.lane(g) for g in GROUPS)):
                pipe.zmscore(key, ids)
            for i in ids:
                pipe.hgetall(k.job(i))
            replies = pipe.execute()
        # A fenced ack may mark a live claim's job completed, and nothing else.
        for row in replies[-len(ids) :]:
            row.pop(b"completed", None)
        return replies

    def _untouched(self, before: tuple[list[str], Any]) -> None:
        ids, keys = before
        assert self._read_claims(ids) == keys

    # -- rules ------------------------------------------------------------------------

    # Hypothesis favours small integers: name the lease's edges and a long stride too.
    @rule(ms=st.integers(0, 3000) | st.sampled_from([LEASE_MS - 1, LEASE_MS, LEASE_MS + 1, 3000]))
    def advance(self, ms: int) -> None:
        self.now += ms

    def _enqueue(self, priority: int, group: str, budget: Any, ahead: int = 0) -> None:
        """Publish a job; with ``ahead`` its ETA is that far ahead (a delayed job)."""
        job_id = f"j{self.published:03d}"
        self.published += 1
        payload = f'{{"id": "{job_id}"}}'.encode()
        eta = self.now + ahead if ahead else None
        outcome = self.store.enqueue(
            QUEUE,
            job_id,
            payload,
            priority=priority,
            now_ms=self.now,
            max_stalled=budget,
            group=group,
            eta_ms=eta,
            task_id="t" + job_id if eta else "",
        )
        assert outcome == Outcome.OK
        job = self.jobs[job_id] = Job(job_id, payload, priority, group, budget)
        if eta:
            job.state, job.eta = "delayed", eta
        else:
            self._promote([job])

    @rule(job=JOBS, ahead=st.sampled_from([1, 500, 1500]))
    def enqueue_delayed(self, job: tuple[int, str, Any], ahead: int) -> None:
        self._enqueue(*job, ahead=ahead)

    def _promote(self, jobs: list[Job]) -> None:
        """Jobs join the tail of their lanes (a publish, or a promotion of delayed jobs)."""
        for job in jobs:
            self.tail += 1
            job.state, job.order = "pending", (job.priority, self.tail)
            if job.group:
                self.lanes.add(job.group)
            self.wake += 1

    @precondition(lambda self: self._in("delayed"))
    @rule(limit=LIMITS)
    def promote(self, limit: int) -> None:
        due = sorted(
            (j for j in self._in("delayed") if j.eta <= self.now), key=lambda j: (j.eta, j.id)
        )
        self._promote(due[:limit])
        assert self.store.promote(QUEUE, limit, now_ms=self.now) == len(due[:limit])

    @precondition(lambda self: self._in("delayed"))
    @rule(data=st.data())
    def revoke(self, data: st.DataObject) -> None:
        job = data.draw(st.sampled_from(self._in("delayed")))
        job.revoked = True
        self._promote([job])
        assert self.store.promote_tasks(QUEUE, ["t" + job.id, "tunknown"]) == 1

    @initialize(jobs=st.lists(JOBS, min_size=2, max_size=6))
    def publish_some(self, jobs: list[tuple[int, str, Any]]) -> None:
        for job in jobs:
            self._enqueue(*job)

    @rule(data=st.data(), job=JOBS, n=st.integers(1, 3), again=st.booleans())
    def enqueue(self, data: st.DataObject, job: tuple[int, str, Any], n: int, again: bool) -> None:
        # A burst of one kind of job: claimed together, its jobs lapse and go back together.
        for _ in range(n):
            self._enqueue(*job)
        if again:
            # A publish that reuses the id of a job still held changes nothing.
            held = data.draw(st.sampled_from(self._in("delayed", "pending", "active", "dead")))
            outcome = self.store.enqueue(QUEUE, held.id, b"other", now_ms=self.now, group="gb")
            assert outcome == Outcome.DUPLICATE

    def _run(self, claimed: list[Claimed]) -> None:
        """Start the task of every claim at once, as a worker with nothing prefetched does."""
        for c in claimed:
            assert self.store.start(QUEUE, c.id, c.token) == Outcome.OK
            self.jobs[c.id].started = str(self.jobs[c.id].deliveries)
            self.jobs[c.id].lapsed = 0

    @precondition(lambda self: self._in("pending"))
    @rule(owner=st.sampled_from(OWNERS), count=COUNTS, run=st.booleans(), take=st.booleans())
    def claim(self, owner: str, count: int, run: bool, take: bool) -> None:
        # Owner w0 runs its tasks elsewhere (a prefork worker), the others in-process.
        here = owner != "w0"
        expected = self._claim_model(owner, count, held=0, take_suspect=take, here=here)
        claimed = self.store.claim(
            QUEUE, owner, count, now_ms=self.now, take_suspect=take, runs_here=here
        )
        self._took(owner, claimed, expected)
        if run:
            self._run(claimed)

    @precondition(lambda self: self._in("pending"))
    @rule(owner=st.sampled_from(OWNERS), count=COUNTS, run=st.booleans(), take=st.booleans())
    def claim_woken(self, owner: str, count: int, run: bool, take: bool) -> None:
        marker = self.client.rpop(self.k.wake)
        assert (marker is None) == (self.wake == 0)
        # Without a marker the consumer's wait times out and it claims anyway (its scan).
        held = 0 if marker is None else 1
        self._take_marker()
        here = owner != "w0"
        expected = self._claim_model(owner, count, held=held, take_suspect=take, here=here)
        claimed = self.store.claim(
            QUEUE, owner, count, held=held, now_ms=self.now, take_suspect=take, runs_here=here
        )
        self._took(owner, claimed, expected)
        if run:
            self._run(claimed)

    @precondition(lambda self: any(j.lapsed for j in self._in("pending")))
    @rule(owner=st.sampled_from(OWNERS))
    def claim_beside_a_suspect(self, owner: str) -> None:
        """A worker takes a suspect with the jobs around it, and starts none yet."""
        here = owner != "w0"
        expected = self._claim_model(owner, 3, held=0, here=here)
        claimed = self.store.claim(QUEUE, owner, 3, now_ms=self.now, runs_here=here)
        self._took(owner, claimed, expected)

    # At most two markers go missing at a time, so most wakes still find theirs.
    @precondition(lambda self: self.wake and self.lost < 2)
    @rule()
    def lose_marker(self) -> None:
        """A consumer pops a marker (BRPOP) and is killed before it claims."""
        assert self.client.rpop(self.k.wake) is not None
        self._take_marker()
        self.lost += 1

    @precondition(lambda self: any(self.holding.values()))
    @rule(owner=st.sampled_from(OWNERS))
    def freeze(self, owner: str) -> None:
        """The worker stops (a long pause, SIGSTOP): its claims lapse unless it resumes first."""
        self.frozen[owner] += self.holding[owner]
        self.holding[owner] = []

    @precondition(lambda self: self.claims)
    @rule(data=st.data(), kind=st.sampled_from(["live", "live", "fenced", "any"]))
    def start(self, data: st.DataObject, kind: str) -> None:
        c = self._draw_claim(data, kind)
        before = self._others([c])
        job = self.jobs[c.id]
        if job.state != "active":
            expected = Outcome.NOT_FOUND
        elif self._fences(job, c.token, "start"):
            expected = Outcome.FENCED
        else:
            expected = Outcome.OK
            job.started = str(job.deliveries)
            job.lapsed = 0
        assert self.store.start(QUEUE, c.id, c.token) == expected
        self._untouched(before)

    @precondition(lambda self: any(j.lapsed for j in self._in("active")))
    @rule(data=st.data())
    def receive(self, data: st.DataObject) -> None:
        """A consumer received a suspect whole: its lapses (and its blame) are forgotten."""
        c = data.draw(st.sampled_from([c for c in self.claims if self.jobs[c.id].lapsed]))
        job = self.jobs[c.id]
        if job.state != "active":
            expected = Outcome.NOT_FOUND
        elif self._fences(job, c.token, "start"):
            expected = Outcome.FENCED
        else:
            expected = Outcome.OK
            job.lapsed = 0
        assert self.store.receive(QUEUE, c.id, c.token) == expected

    @precondition(lambda self: any(self.holding.values()) or any(self.frozen.values()))
    @rule(owner=st.sampled_from(OWNERS))
    def extend(self, owner: str) -> None:
        """The worker's lease keeper renews every claim it holds (a frozen worker resumes)."""
        held = self.holding[owner] + self.frozen[owner]
        self.frozen[owner] = []
        lost = []
        for job_id, token in held:
            job = self.jobs[job_id]
            if job.state == "active" and job.token == token:
                job.deadline = self.now + LEASE_MS
            else:
                self._fences(job, token, "extend")
                lost.append((job_id, token))
        assert self.store.extend(QUEUE, held, now_ms=self.now) == lost
        self.holding[owner] = [c for c in held if c not in lost]

    @precondition(lambda self: self.claims)
    @rule(data=st.data(), kind=st.sampled_from(KINDS))
    def ack(self, data: st.DataObject, kind: str) -> None:
        c = self._draw_claim(data, kind)
        before = self._others([c])
        expected = self._ack_model(c.id, c.token)
        assert self.store.ack(QUEUE, c.id, c.token) == expected
        self._untouched(before)
        self._forget(c)

    @precondition(lambda self: self.claims)
    @rule(data=st.data())
    def ack_many(self, data: st.DataObject) -> None:
        # Mostly claims of jobs still held, so that the batch does more than miss.
        held = [c for c in self.claims if self.jobs[c.id].state != "gone"]
        held = [c for c in held if not self._frozen(c)]
        claims = data.draw(st.lists(st.sampled_from(held or self.claims), min_size=1, max_size=3))
        before = self._others(claims)
        expected = [self._ack_model(c.id, c.token) for c in claims]
        assert self.store.ack_many(QUEUE, [(c.id, c.token) for c in claims]) == expected
        self._untouched(before)
        for c in claims:
            self._forget(c)

    @precondition(lambda self: self.claims)
    @rule(data=st.data(), kind=st.sampled_from(KINDS))
    def release(self, data: st.DataObject, kind: str) -> None:
        c = self._draw_claim(data, kind)
        before = self._others([c])
        job = self.jobs[c.id]
        if job.state != "active":
            expected = Outcome.NOT_FOUND
        elif self._fences(job, c.token, "release"):
            expected = Outcome.FENCED
        elif job.completed:
            expected = Outcome.COMPLETED
            self._done(job)
        else:
            expected = Outcome.OK
            self._to_front([job])
        assert self.store.release(QUEUE, c.id, c.token) == expected
        self._untouched(before)
        self._forget(c)

    @precondition(lambda self: self.claims)
    @rule(data=st.data(), kind=st.sampled_from(KINDS))
    def bury(self, data: st.DataObject, kind: str) -> None:
        c = self._draw_claim(data, kind)
        before = self._others([c])
        job = self.jobs[c.id]
        if job.state in ("gone", "dead", "delayed"):
            expected = Outcome.NOT_FOUND
        elif self._fences(job, c.token, "bury"):
            expected = Outcome.FENCED
        elif job.completed:
            expected = Outcome.COMPLETED
            self._done(job)
        else:
            # From the live claim, or from pending after that claim lapsed.
            expected = Outcome.OK
            was_pending = job.state == "pending"
            if was_pending:
                self._take_marker()
            self._kill(job)
            if was_pending:
                self._drop_empty_lane(job)
            self._count("failed", "rejected")
        outcome = self.store.bury(QUEUE, c.id, c.token, "rejected", "no", now_ms=self.now)
        assert outcome == expected
        self._untouched(before)
        self._forget(c)

    @precondition(lambda self: self.claims)
    @rule(data=st.data(), kind=st.sampled_from(KINDS))
    def charge(self, data: st.DataObject, kind: str) -> None:
        c = self._draw_claim(data, kind)
        before = self._others([c])
        expected = None
        self._fences(self.jobs[c.id], c.token, "charge")
        if self._live(c) and self.jobs[c.id].completed:
            job = self.jobs[c.id]
            expected = Swept(job.id, "completed", job.stalled, b"")
            self._done(job)
        elif self._live(c) and self.jobs[c.id].doomed == c.token:
            job = self.jobs[c.id]
            expected = self._retired([Swept(job.id, "doomed", job.stalled, pack(job.payload))])[0]
        elif self._live(c):
            job = self.jobs[c.id]
            expected = self._stall(job, "worker_lost")
            self._to_front([job if expected.outcome == "recovered" else None])
            if expected.outcome == "doomed":
                expected = self._retired([expected])[0]
        swept = self.store.charge(
            QUEUE, c.id, c.token, DEFAULT_BUDGET, "worker_lost", now_ms=self.now
        )
        assert swept == expected
        self._untouched(before)
        self._forget(c)

    @precondition(lambda self: self._lapsed(1))
    @rule(limit=LIMITS, dies=st.booleans())
    def sweep(self, limit: int, dies: bool) -> None:
        """A sweep pass; with ``dies``, its process dies after the script (none retired)."""
        if self.swept_at is not None and self.now - self.swept_at > LEASE_MS / 2:
            self.outage = (self.swept_at, self.now)
        self.swept_at = self.now
        # Due delayed jobs are promoted first, up to the limit, as promote does.
        due = sorted(
            (j for j in self._in("delayed") if j.eta <= self.now), key=lambda j: (j.eta, j.id)
        )[:limit]
        self._promote(due)
        batch = self._lapsed(limit)
        expected: list[Swept] = [Swept(j.id, "promoted", 0, b"") for j in due]
        front: list[Job | None] = []
        blamed: dict[str, tuple[str, bool] | None] = {}
        for job in batch:
            if job.owner not in blamed:
                blamed[job.owner] = self._suspect_of(job.owner)
            if (
                not job.completed
                and self.outage
                and self.outage[0] + LEASE_MS / 2 < job.deadline <= self.outage[1] + LEASE_MS / 2
                and job.graced != job.deadline
            ):
                # Lapsed in an outage: one more lease, no stall, stays where it is.
                job.deadline = job.graced = self.now + LEASE_MS
                expected.append(Swept(job.id, "graced", job.stalled, b""))
                front.append(None)
            elif job.completed:
                expected.append(Swept(job.id, "completed", job.stalled, b""))
                front.append(None)
                self._done(job)
            elif job.doomed == job.token:
                # Doomed by a pass that died: the same candidate, nothing counted twice.
                event("a doomed job found again by a sweep")
                expected.append(Swept(job.id, "doomed", job.stalled, pack(job.payload)))
                front.append(None)
            elif (
                (blame := blamed[job.owner]) is not None
                and blame[0] != job.id
                and (not blame[1] or job.started != str(job.deliveries))
            ):
                # Its owner died holding a suspect that never started: forgiven.
                event("a claim forgiven: its owner held a suspect that never started")
                expected.append(Swept(job.id, "requeued", job.stalled, b""))
                front.append(job)
            elif job.started != str(job.deliveries):
                job.lapsed += 1
                if job.lapsed > MAX_LAPSED:
                    expected.append(self._doom(job, "never_started", "never_started"))
                    front.append(None)
                else:
                    expected.append(Swept(job.id, "requeued", job.stalled, b""))
                    front.append(job)
            else:
                swept = self._stall(job, "lease_expired")
                expected.append(swept)
                front.append(job if swept.outcome == "recovered" else None)
        self._to_front(front)
        self._swept_markers()
        if dies:
            swept = self.store.scripts.sweep(
                self.k, self.now, limit, DEFAULT_BUDGET, "lease_expired", LEASE_MS, (), MAX_LAPSED
            )
            assert swept == expected
            return
        swept = self.store.sweep(
            QUEUE, DEFAULT_BUDGET, limit=limit, now_ms=self.now, max_lapsed=MAX_LAPSED
        )
        assert swept == self._retired(expected)

    def _doomed(self) -> list[Job]:
        return [j for j in self._in("active") if j.doomed == j.token]

    @precondition(lambda self: self._doomed())
    @rule(data=st.data(), succeeded=st.booleans(), other=st.booleans())
    def retire(self, data: st.DataObject, succeeded: bool, other: bool) -> None:
        """A sweeper retires a job a pass that died doomed (``other``: any job)."""
        job = data.draw(st.sampled_from(sorted(self.jobs.values(), key=lambda j: j.id)))
        if not other:
            job = data.draw(st.sampled_from(self._doomed()))
        before = self._others([Claim("", job.id, job.token)])
        expected = self._retire(job, succeeded)
        event(f"retire: {expected.name}")
        assert self.store.retire(QUEUE, job.id, succeeded, now_ms=self.now) == expected
        self._untouched(before)

    def _suspect_of(self, owner: str) -> tuple[str, bool] | None:
        """The suspect ``owner`` holds unstarted, by its note; a stale note is dropped."""
        note = self.suspect_notes.get(owner)
        if not owner or note is None:
            return None
        sid, claim, here = note.split(" ")
        job = self.jobs.get(sid)
        if (
            job is not None
            and job.state != "gone"
            and job.token == claim
            and job.started != claim.partition(".")[0]
            and job.lapsed > 0
            and job.owner == owner
        ):
            return (sid, here != "0")
        del self.suspect_notes[owner]
        return None

    def _swept_markers(self) -> None:
        """What every sweep pass (not a charge) does last to the wake list and cursor."""
        if not self._in("pending") and not self.lanes:
            # A queue with nothing to order loses its markers and cursor, as after a claim.
            self.wake, self.cursor = 0, ""
        elif self.wake == 0 and (
            self._lane("") or any(self._lane(g) for g in sorted(self.lanes)[:LANES_LOOKED])
        ):
            # Jobs wait with no marker (one was lost): the sweep pushes one.
            self.wake = 1

    @precondition(lambda self: self._lapsed(1))
    @rule(limit=LIMITS)
    def reap(self, limit: int) -> None:
        batch = self._lapsed(limit)
        reaped = [j for j in batch if not j.completed]
        for job in batch:
            if job.completed:
                self._done(job)
            elif job.started != str(job.deliveries):
                job.lapsed += 1
        self._to_front([None if j.completed else j for j in batch])
        assert self.store.reap(QUEUE, limit=limit, now_ms=self.now) == [j.id for j in reaped]

    @precondition(lambda self: self._in("dead"))
    @rule(data=st.data(), other=st.booleans())
    def retry(self, data: st.DataObject, other: bool) -> None:
        dead = sorted(j.id for j in self._in("dead"))
        ids = data.draw(st.lists(st.sampled_from(dead), min_size=1, max_size=3, unique=True))
        if other:
            # Another id, dead or not: one that is not dead (any more) is passed over.
            ids.append(data.draw(st.sampled_from(sorted(self.jobs))))
        batch: list[Job | None] = []
        for i in ids:
            job = self.jobs[i]
            if job.state == "dead" and all(job is not b for b in batch):
                job.stalled = job.lapsed = 0
                self.metrics["retried"] += 1
                batch.append(job)
            else:
                batch.append(None)
        self._to_front(batch)
        moved = [j.id for j in batch if j is not None]
        assert self.store.retry(QUEUE, ids, now_ms=self.now) == moved

    @precondition(lambda self: len(self._in("pending")) >= 4)
    @rule()
    def purge(self) -> None:
        pending = self._in("pending", "delayed")
        for job in pending:
            job.state = "gone"
        self.lanes.clear()
        self.wake, self.cursor = 0, ""
        assert self.store.purge(QUEUE) == len(pending)

    @precondition(lambda self: self._in("dead"))
    @rule(data=st.data())
    def purge_dead(self, data: st.DataObject) -> None:
        ids = data.draw(st.lists(st.sampled_from(sorted(self.jobs)), min_size=1, max_size=3))
        gone = 0
        for i in ids:
            if self.jobs[i].state == "dead":
                self.jobs[i].state = "gone"
                gone += 1
        assert self.store.purge_dead(QUEUE, ids) == gone

    @precondition(lambda self: self._in("dead") and not self._lapsed(1))
    @rule(max_size=st.integers(1, 2), max_age_ms=st.sampled_from([0, 2000]))
    def trim(self, max_size: int, max_age_ms: int) -> None:
        """A sweep with no lapsed claim to examine applies only the morgue's retention."""
        if self.swept_at is not None and self.now - self.swept_at > LEASE_MS / 2:
            self.outage = (self.swept_at, self.now)
        self.swept_at = self.now
        dead = sorted(self._in("dead"), key=lambda j: (j.died_ms, j.id))
        doomed = [j for j in dead if max_age_ms and j.died_ms < self.now - max_age_ms]
        doomed += dead[len(doomed) :][: max(0, len(dead) - len(doomed) - max_size)]
        for job in doomed:
            job.state = "gone"
        due = sorted(
            (j for j in self._in("delayed") if j.eta <= self.now), key=lambda j: (j.eta, j.id)
        )
        self._promote(due)
        self._swept_markers()
        swept = self.store.sweep(
            QUEUE,
            DEFAULT_BUDGET,
            limit=1000,
            now_ms=self.now,
            dead_max_age_ms=max_age_ms,
            dead_max_size=max_size,
        )
        assert sorted((s.id, s.outcome) for s in swept) == sorted(
            [(j.id, "trimmed") for j in doomed] + [(j.id, "promoted") for j in due]
        )

    # -- the server forgets its last writes ------------------------------------------

    #: What the server holds (the keys) and the model's view of it; not what the
    #: workers remember (the claims they made and hold) nor the clock.
    SERVER = (
        "jobs", "tail", "head", "lanes", "cursor", "wake", "lost",
        "metrics", "reasons", "swept_at", "outage", "fenced", "suspect_notes",
    )  # fmt: skip

    @rule()
    def remember(self) -> None:
        """The server saves its keys (an RDB snapshot, or what a lagging replica holds)."""
        state = {name: copy.deepcopy(getattr(self, name)) for name in self.SERVER}
        self.saved = (dump_keys(self.client, self.prefix), state)

    @precondition(lambda self: self.saved is not None)
    @rule()
    def forget(self) -> None:
        """The server comes back with the saved keys: every write since is lost."""
        assert self.saved is not None
        dumps, state = self.saved
        forget_writes(self.client, self.prefix, dumps)
        event("the server forgot its last writes")
        jobs = self.jobs
        for name, value in state.items():
            setattr(self, name, copy.deepcopy(value))
        # Jobs published since are gone with their rows (their claims stay remembered).
        for job_id, job in jobs.items():
            if job_id not in self.jobs:
                self.jobs[job_id] = replace(job, state="gone")

    # -- invariants -------------------------------------------------------------------

    @invariant()
    def keys_agree_with_the_model(self) -> None:
        k = self.k
        ids = sorted(i for i, j in self.jobs.items() if j.state != "gone")
        gone = [k.job(i) for i, j in self.jobs.items() if j.state == "gone"]
        gone += [k.msg(i) for i, j in self.jobs.items() if j.state == "gone"]
        places = {"active": k.active, "dead": k.dead, "delayed": k.delayed, "": k.pending}
        places.update({g: k.lane(g) for g in GROUPS})
        with self.client.pipeline(transaction=False) as pipe:
            for i in ids:
                pipe.hgetall(k.job(i))
            for key in places.values():
                pipe.zrange(key, 0, -1, withscores=True)
            pipe.zrange(k.lanes, 0, -1).llen(k.wake).get(k.cursor)
            for name in METRICS:
                pipe.hgetall(k.metrics(name))
            pipe.hgetall(k.metrics("fenced"))
            # No gone job has a row or a message left (one EXISTS for them all).
            if gone:
                pipe.exists(*gone)
            # Every other job has its message.
            if ids:
                pipe.exists(*(k.msg(i) for i in ids))
            replies = pipe.execute()
        rows = {
            i: {f.decode(): v.decode() for f, v in r.items()}
            for i, r in zip(ids, replies[: len(ids)], strict=True)
        }
        zsets = dict(zip(places, replies[len(ids) : len(ids) + len(places)], strict=True))
        lanes, llen, cursor, *counts = replies[len(ids) + len(places) :]
        if ids:
            assert counts.pop() == len(ids)
        if gone:
            assert counts.pop() == 0

        seen: dict[str, list[str]] = {}
        for place, members in zsets.items():
            for member, _ in members:
                seen.setdefault(member.decode(), []).append(place)
        assert set(seen) <= set(self.jobs)
        for i, job in self.jobs.items():
            if job.state == "gone":
                assert i not in seen
                continue
            row = rows[i]
            where = job.group if job.state == "pending" else job.state
            assert seen.get(i) == [where]
            assert row["state"] == job.state
            assert int(row.get("deliveries", 0)) == job.deliveries
            assert int(row.get("stalled", 0)) == job.stalled
            assert len(json.loads(row.get("history", "[]"))) == min(job.stalls, HISTORY)
            assert row.get("started", "") == job.started
            assert row.get("claim", "") == job.token
            assert int(row.get("lapsed", 0)) == job.lapsed
            assert row.get("group", "") == job.group
            assert row.get("completed", "") == ("1" if job.completed else "")
            assert row.get("owner", "") == (job.owner if job.state == "active" else "")

        for place, members in zsets.items():
            got = [(m.decode(), int(s)) for m, s in members]
            if place == "active":
                jobs = sorted(self._in("active"), key=lambda j: (j.deadline, j.id))
                assert got == [(j.id, j.deadline) for j in jobs]
            elif place == "delayed":
                jobs = sorted(self._in("delayed"), key=lambda j: (j.eta, j.id))
                assert got == [(j.id, j.eta) for j in jobs]
            elif place == "dead":
                jobs = sorted(self._in("dead"), key=lambda j: (j.died_ms, j.id))
                assert got == [(j.id, j.died_ms) for j in jobs]
                assert all(int(rows[j.id]["died_ms"]) == j.died_ms for j in jobs)
            else:
                assert [m for m, _ in got] == [j.id for j in self._lane(place)]
        assert {g.decode() for g in lanes} == self.lanes
        assert (cursor or b"").decode() == self.cursor

        claimable = len(self._in("pending"))
        assert llen == self.wake
        assert llen <= claimable
        assert claimable - llen <= self.lost
        if claimable == 0:
            # The queue is empty: the markers lost so far no longer count.
            self.lost = 0

        fenced = {f.decode(): int(v) for f, v in counts.pop().items()}
        assert fenced.pop("count", 0) == sum(self.fenced.values())
        assert {f.removeprefix("reason:"): n for f, n in fenced.items()} == self.fenced
        hashes = [{f.decode(): int(v) for f, v in h.items()} for h in counts]
        assert {n: h.get("count", 0) for n, h in zip(METRICS, hashes, strict=True)} == self.metrics
        # Each counter's reason fields add up to it (retried and completed have none).
        got = {
            n: {f.removeprefix("reason:"): v for f, v in h.items() if f != "count"}
            for n, h in zip(METRICS, hashes, strict=True)
        }
        assert got == self.reasons


TestJobStoreModel = JobStoreModel.TestCase
# CI runs 100 examples of 80 steps (about 20 s); a longer run sets, for example,
# EMQ_MODEL_EXAMPLES=1500 EMQ_MODEL_STEPS=100.
TestJobStoreModel.settings = settings(
    max_examples=int(os.environ.get("EMQ_MODEL_EXAMPLES", "100")),
    stateful_step_count=int(os.environ.get("EMQ_MODEL_STEPS", "80")),
    deadline=None,
    derandomize=False,
    suppress_health_check=[HealthCheck.too_slow],
)
