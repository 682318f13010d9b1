"""The morgue: list, show, retry and purge dead-lettered jobs.

The CLI's ``celery emq dead ...`` commands are a thin layer over :class:`Morgue`::

    from celery_emq import Morgue

    morgue = Morgue.from_app(app)
    for job in morgue.ls(task="proj.tasks.resize", reason="worker_lost"):
        print(job.id, job.task_name, job.died_ms)
    morgue.retry(task="proj.tasks.resize")          # back to the front of their queues
    morgue.retry([result.id])                       # a Celery task id works as a job id does
    morgue.purge(older_than_s=7 * 86400)
    morgue.purge(queue="images", all=True)          # a whole queue's morgue: all=True

A job is named by its job id (the morgue's own) or by its Celery task id (what
``AsyncResult``, the worker's log and Flower show). Job ids are looked up
directly; a task id is found by reading the dead jobs' message headers (5,000
dead jobs in about 0.2 s).

Nothing is acted on by accident: every id given must name a dead job, or
:class:`~celery_emq.errors.UnknownJobError` names those that do not and
nothing changes (a job that leaves the morgue after that check, in another
operator's call or a retention trim, is named in the error's ``missing`` and
every other id is acted on, listed in its ``done``, for any number of ids);
an empty list acts on nothing; and a call with neither ids nor a filter
(``queue`` alone is not a filter) needs ``all=True``.
"""

from __future__ import annotations

import heapq
import itertools
import json
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from typing import Any

from celery_emq.errors import UnknownJobError
from celery_emq.ops.appstore import open_store
from celery_emq.store.jobstore import JobStore
from celery_emq.transport.jobs import DEFAULT_ACCEPT, accepted_content, describe

__all__ = ["REASONS", "DeadJob", "Morgue"]

#: Rows read per round trip while listing.
PAGE = 500

#: Every reason a dead job can carry (``reason``), and ``stalled`` (``last_error``
#: of every job that died of its stalls): the values :meth:`Morgue.ls` filters on.
REASONS: tuple[str, ...] = (
    "worker_lost",  # its pool process died under it (or the worker was killed)
    "lease_expired",  # its lease lapsed (the worker vanished or stopped renewing)
    "malformed",  # the message could not be decoded
    "content_disallowed",  # its content type is not one the app accepts
    "unknown_task",  # no worker knows its task name
    "invalid_task",  # Celery refused the message as a task
    "unknown_message",  # not a task message
    "rejected",  # a consumer rejected it without requeue
    "never_started",  # it lapsed again and again before its task started
    "stalled",  # any death by stalls (lease_expired or worker_lost)
)


@dataclass(frozen=True)
class DeadJob:
    """One job in a morgue, with what is known of its task and its death."""

    id: str
    queue: str
    task_name: str | None
    task_id: str | None
    args: Any
    kwargs: Any
    group: str | None
    stalled: int
    reason: str
    last_error: str
    error: str
    died_ms: int
    deliveries: int
    history: list[dict[str, Any]] = field(default_factory=list)
    decode_error: str | None = None

    def as_dict(self) -> dict[str, Any]:
        """Return the fields as a JSON-friendly dict (the CLI's ``--json`` form)."""
        return asdict(self)


class Morgue:
    """The dead-lettered jobs of every registered queue of one store.

    Args:
        store: the job store.
        accept: the content types whose bodies may be decoded to show a job's
            arguments (MIME types; JSON only by default). Pickle is decoded
            only when the app accepts it.
    """

    def __init__(self, store: JobStore, accept: frozenset[str] = DEFAULT_ACCEPT) -> None:
        self.store = store
        self.accept = accept

    @classmethod
    @contextmanager
    def from_app(cls, app: Any) -> Iterator[Morgue]:
        """Open the Celery app's broker and yield its morgue (a context manager)."""
        with open_store(app) as (store, _options):
            yield cls(store, accepted_content(app))

    def queues(self, queue: str | None = None) -> list[str]:
        """Return the queues to look at: ``[queue]`` or every registered one."""
        return [queue] if queue else self.store.queues()

    def ls(
        self,
        queue: str | None = None,
        task: str | None = None,
        reason: str | None = None,
        since_ms: int | None = None,
        until_ms: int | None = None,
        limit: int | None = None,
        task_id: str | None = None,
    ) -> list[DeadJob]:
        """List dead jobs, oldest death first, matching every filter given.

        Args:
            queue: only this queue.
            task: only this task name.
            task_id: only the job of this Celery task id.
            reason: only this reason (``worker_lost``, ``lease_expired``,
                ``malformed``, ``rejected``...), or ``last_error`` (``stalled``).
            since_ms: died at or after this time (ms since the epoch).
            until_ms: died at or before this time.
            limit: at most this many.
        """
        # Every queue's morgue is read in order of death, a page at a time, and merged:
        # with a limit and no filter on the rows, that is `limit` ids from each queue
        # and `limit` rows, whatever the morgue holds.
        sifted = task is not None or task_id is not None or reason is not None
        page = PAGE if sifted or limit is None else max(1, min(PAGE, limit))
        order = heapq.merge(
            *(self._ids(q, since_ms, until_ms, page) for q in self.queues(queue)),
            key=lambda entry: entry[0],
        )
        found: list[DeadJob] = []
        while limit is None or len(found) < limit:
            batch = list(itertools.islice(order, page))
            if not batch:
                break
            by_queue: dict[str, list[str]] = {}
            for _score, q, job_id in batch:
                by_queue.setdefault(q, []).append(job_id)
            read = {(j.queue, j.id): j for q, ids in by_queue.items() for j in self._read(q, ids)}
            for _score, q, job_id in batch:
                job = read[(q, job_id)]
                if task is not None and job.task_name != task:
                    continue
                if task_id is not None and job.task_id != task_id:
                    continue
                if reason is not None and reason not in (job.reason, job.last_error):
                    continue
                found.append(job)
        return found[:limit] if limit is not None else found

    def show(self, ident: str, queue: str | None = None) -> DeadJob | None:
        """Return one dead job by job id or Celery task id (``None`` if neither).

        Searched in every queue unless ``queue`` is given.
        """
        found, _missing = self.find([ident], queue)
        return found.get(ident)

    def find(
        self, idents: Sequence[str], queue: str | None = None
    ) -> tuple[dict[str, DeadJob], list[str]]:
        """Look dead jobs up by job id or Celery task id.

        Returns the jobs found, keyed by the id they were asked for, and the
        ids that name no dead job, in the order given.
        """
        queues = self.queues(queue)
        found: dict[str, DeadJob] = {}
        wanted = list(dict.fromkeys(idents))
        # Job ids first: one ZSCORE per id and queue, in one round trip.
        with self.store.client.pipeline(transaction=False) as pipe:
            for ident in wanted:
                for q in queues:
                    pipe.zscore(self.store.keys(q).dead, ident)
            scores = pipe.execute()
        for i, ident in enumerate(wanted):
            for j, q in enumerate(queues):
                if scores[i * len(queues) + j] is not None:
                    found[ident] = self._read(q, [ident])[0]
                    break
        # The rest may be Celery task ids: read the dead jobs' headers.
        rest = {ident for ident in wanted if ident not in found}
        for q in queues:
            if not rest:
                break
            for job in self._scan(q, None, None):
                if job.task_id in rest:
                    found[job.task_id] = job
                    rest.discard(job.task_id)
        return found, [ident for ident in wanted if ident not in found]

    def select(
        self,
        job_ids: Sequence[str] | None = None,
        *,
        all: bool = False,
        **filters: Any,
    ) -> list[DeadJob]:
        """Return the dead jobs a :meth:`retry` or :meth:`purge` with these arguments acts on.

        Args:
            job_ids: job or Celery task ids; every one must name a dead job
                (``queue`` may narrow the search). An empty list selects
                nothing. ``None``: select by ``filters`` instead.
            all: needed to select by ``queue`` alone or by nothing at all.
            filters: as :meth:`ls`.

        Raises:
            UnknownJobError: an id, or the ``task_id`` filter, names no dead job.
            ValueError: neither ids nor a filter without ``all``, or ids with
                ``all`` or a filter.
        """
        chosen = any(v is not None for k, v in filters.items() if k != "queue")
        if job_ids is None:
            if not (chosen or all):
                raise ValueError(
                    "name job ids, give a filter, or pass all=True to act on every dead job"
                    + (f" of queue {filters['queue']!r}" if filters.get("queue") else "")
                )
            jobs = self.ls(**filters)
            if not jobs and filters.get("task_id") is not None:
                # A task id names one job, as a job id does: naming none is an error.
                raise UnknownJobError([filters["task_id"]], filters.get("queue"))
            return jobs
        if isinstance(job_ids, str):
            raise TypeError("job_ids is a list of ids, not one id")
        if all or chosen:
            raise ValueError("give job ids or all=True/filters, not both")
        found, missing = self.find(job_ids, filters.get("queue"))
        if missing:
            raise UnknownJobError(missing, filters.get("queue"))
        return list({j.id: j for j in found.values()}.values())

    def retry(
        self,
        job_ids: Sequence[str] | None = None,
        rate_per_s: float | None = 500.0,
        *,
        all: bool = False,
        **filters: Any,
    ) -> list[str]:
        """Retry dead jobs: by job or task id, or every job matching ``filters`` (see :meth:`ls`).

        Each goes back to the front of its queue or lane with its stall count
        reset. A large replay is paced at ``rate_per_s`` jobs a second (``None``:
        as fast as possible). Which jobs: as :meth:`select` (an unknown id
        raises :class:`~celery_emq.errors.UnknownJobError` and retries
        nothing). Returns the ids retried.
        """
        retried: list[str] = []
        missing: list[str] = []
        for queue, ids in self._targets(self.select(job_ids, all=all, **filters)).items():
            for start in range(0, len(ids), 100):
                chunk = ids[start : start + 100]
                t0 = time.monotonic()
                done, absent = self.store.retry_each(queue, chunk)
                retried += done
                missing += absent
                if rate_per_s:
                    pause = len(chunk) / rate_per_s - (time.monotonic() - t0)
                    if pause > 0 and start + 100 < len(ids):
                        time.sleep(pause)
        if missing and job_ids is not None:
            raise UnknownJobError(missing, filters.get("queue"), retried)
        return retried

    def purge(
        self,
        job_ids: Sequence[str] | None = None,
        older_than_s: float | None = None,
        *,
        all: bool = False,
        **filters: Any,
    ) -> int:
        """Delete dead jobs: by job or task id, or every job matching ``filters`` (see :meth:`ls`).

        ``older_than_s`` keeps jobs that died more recently than that (a
        filter). Which jobs: as :meth:`select` (an unknown id raises
        :class:`~celery_emq.errors.UnknownJobError` and deletes nothing).
        Returns how many were deleted.
        """
        if older_than_s is not None:
            filters["until_ms"] = self.store.server_ms() - int(older_than_s * 1000)
        done: list[str] = []
        missing: list[str] = []
        for queue, ids in self._targets(self.select(job_ids, all=all, **filters)).items():
            absent = self.store.purge_each(queue, ids)
            missing += absent
            done += [i for i in ids if i not in set(absent)]
        if missing and job_ids is not None:
            raise UnknownJobError(missing, filters.get("queue"), done)
        n = len(done)
        return n

    @staticmethod
    def _targets(jobs: Sequence[DeadJob]) -> dict[str, list[str]]:
        targets: dict[str, list[str]] = {}
        for job in jobs:
            targets.setdefault(job.queue, []).append(job.id)
        return targets

    def _ids(
        self, queue: str, since_ms: int | None, until_ms: int | None, page: int
    ) -> Iterator[tuple[float, str, str]]:
        """Yield ``(died_ms, queue, id)`` of a queue's dead jobs in order of death,
        reading ``page`` ids per round trip, only as far as the caller goes."""
        key = self.store.keys(queue).dead
        low = "-inf" if since_ms is None else since_ms
        high = "+inf" if until_ms is None else until_ms
        offset = 0
        while True:
            entries = self.store.client.zrange(
                key, low, high, byscore=True, offset=offset, num=page, withscores=True
            )
            for job_id, score in entries:
                yield score, queue, job_id.decode()
            if len(entries) < page:
                return
            offset += page

    def _scan(self, queue: str, since_ms: int | None, until_ms: int | None) -> Iterator[DeadJob]:
        key = self.store.keys(queue).dead
        low = "-inf" if since_ms is None else since_ms
        high = "+inf" if until_ms is None else until_ms
        offset = 0
        while True:
            ids = self.store.client.zrange(key, low, high, byscore=True, offset=offset, num=PAGE)
            if not ids:
                return
            yield from self._read(queue, [i.decode() for i in ids])
            if len(ids) < PAGE:
                return
            offset += PAGE

    def _read(self, queue: str, ids: list[str]) -> list[DeadJob]:
        k = self.store.keys(queue)
        fields = (
            "payload",
            "stalled",
            "reason",
            "last_error",
            "error",
            "died_ms",
            "deliveries",
            "history",
        )
        with self.store.client.pipeline(transaction=False) as pipe:
            for job_id in ids:
                pipe.hmget(k.job(job_id), fields)
                pipe.get(k.msg(job_id))
            replies = pipe.execute()
        jobs = []
        for i, job_id in enumerate(ids):
            row, stored = replies[2 * i], replies[2 * i + 1]
            text = {
                f: (v.decode() if isinstance(v, bytes) else v)
                for f, v in zip(fields, row, strict=True)
                if f != "payload"
            }
            # Rows written before messages had a key of their own hold it as `payload`.
            message = stored if stored is not None else row[0]
            reason = text["reason"] or text["last_error"] or ""
            info = describe(message or "", queue, job_id, reason=reason, accept=self.accept)
            jobs.append(
                DeadJob(
                    id=job_id,
                    queue=queue,
                    task_name=info.task_name,
                    task_id=info.task_id,
                    args=info.args,
                    kwargs=info.kwargs,
                    group=info.group,
                    stalled=int(text["stalled"] or 0),
                    reason=reason,
                    last_error=text["last_error"] or "",
                    error=text["error"] or "",
                    died_ms=int(text["died_ms"] or 0),
                    deliveries=int(text["deliveries"] or 0),
                    history=json.loads(text["history"]) if text["history"] else [],
                    decode_error=info.decode_error,
                )
            )
        return jobs
