"""Reading queues without changing them: counts, lanes, ages, counters and one job."""

from __future__ import annotations

from collections.abc import Sequence

from celery_emq.store.base import METRICS, StoreBase
from celery_emq.store.calls import text
from celery_emq.store.codec import unpack

__all__ = ["ACTIVE_PAGE", "LANE_PAGE", "OLDEST_LANE_PAGE", "Reads"]

#: Most lanes one ``tally`` script call reads.
LANE_PAGE = 10_000
#: Most fair lanes one ``oldest`` script call reads (a call per priority band in use each).
OLDEST_LANE_PAGE = 1000
#: Most active jobs one ``oldest`` script call reads.
ACTIVE_PAGE = 5000


class Reads(StoreBase):
    """The job store's reads (see :class:`~celery_emq.store.jobstore.JobStore`)."""

    def metrics(self, queue: str) -> dict[str, int]:
        """Return the queue's counters: completed, recovered, stalled, failed, retried."""
        k = self.keys(queue)
        with self.client.pipeline(transaction=False) as pipe:
            for name in METRICS:
                pipe.hget(k.metrics(name), "count")
            values = pipe.execute()
        return {name: int(v or 0) for name, v in zip(METRICS, values, strict=True)}

    def fenced(self, queue: str) -> dict[str, int]:
        """Return how many settles named a claim that was not the live one, by verb.

        Verbs: ``ack``, ``extend``, ``release``, ``bury``, ``charge``, ``start``.
        Such a settle changes nothing of the live claim (a fenced ack only marks
        the job completed); each one means two runs of a job overlapped, most
        often after the server lost its last writes.
        """
        counts = self.client.hgetall(self.keys(queue).metrics("fenced"))
        return {
            text(f).removeprefix("reason:"): int(v)
            for f, v in counts.items()
            if text(f).startswith("reason:")
        }

    def size(self, queue: str) -> int:
        """Return how many jobs are pending, lanes included (kombu's queue size)."""
        return self.counts(queue)["pending"]

    def lanes(self, queue: str) -> dict[str, int]:
        """Return each fair lane's pending count, by group."""
        return self.tally(queue)[1]

    def counts(self, queue: str) -> dict[str, int]:
        """Return the number of pending (lanes included), active, delayed and dead jobs."""
        counts = self.tally(queue)[0]
        del counts["lanes"]
        return counts

    def tally(
        self, queue: str, heads: bool = False
    ) -> tuple[dict[str, int], dict[str, int], list[int]]:
        """Return a queue's counts, its lanes' sizes and (with ``heads``) their heads' ages.

        One script call per :data:`LANE_PAGE` lanes (one for most queues): the
        counts are ``pending`` (lanes included), ``active``, ``delayed``, ``dead``
        and ``lanes`` (how many); the lanes map each group with pending jobs to
        their number; the heads are the ``enqueued_ms`` of each lane's next job.
        """
        counts, page = self.scripts.tally(self.keys(queue), 0, LANE_PAGE, heads)
        return self._lanes_read(queue, counts, page, heads)

    def tallies(
        self, queues: Sequence[str], heads: bool = False
    ) -> list[tuple[dict[str, int], dict[str, int], list[int]]]:
        """Return :meth:`tally` of each of ``queues``, in one round trip for them all.

        One more round trip per queue for each further :data:`LANE_PAGE` lanes
        it has (none for most queues).
        """
        if not queues:
            return []
        batch = self.scripts.batch()
        handles = [batch.tally(self.keys(q), 0, LANE_PAGE, heads) for q in queues]
        batch.execute()
        out = []
        for queue, handle in zip(queues, handles, strict=True):
            counts, page = batch.result(handle)
            out.append(self._lanes_read(queue, counts, page, heads))
        return out

    def gauges(
        self, queues: Sequence[str]
    ) -> list[tuple[dict[str, int], dict[str, int], int | None, int | None]]:
        """Return each queue's counts and lanes (as :meth:`tally`) and its two oldest times.

        The times are the least ``enqueued_ms`` of its pending jobs (read at the
        head of each priority band of each lane, see ``oldest.lua``) and the
        least ``claimed_ms`` of its active jobs (``None`` when there are none).
        One round trip for every queue, and one more for every queue past the
        first :data:`OLDEST_LANE_PAGE` lanes or :data:`ACTIVE_PAGE` active jobs
        (a script call for each further page of either).
        """
        if not queues:
            return []
        batch = self.scripts.batch()
        handles = [
            (
                batch.tally(self.keys(q), 0, LANE_PAGE),
                batch.oldest(self.keys(q), 0, OLDEST_LANE_PAGE, 0, ACTIVE_PAGE),
            )
            for q in queues
        ]
        batch.execute()
        # The pages past the first, of every queue, in one more round trip.
        more = self.scripts.batch()
        rows = []
        for queue, (tally, oldest) in zip(queues, handles, strict=True):
            counts, page = batch.result(tally)
            counts, lanes, _ = self._lanes_read(queue, counts, page, False)
            pages = []
            lanes_at, active_at = OLDEST_LANE_PAGE, ACTIVE_PAGE
            while lanes_at < counts["lanes"] or active_at < counts["active"]:
                lane_limit = OLDEST_LANE_PAGE if lanes_at < counts["lanes"] else 0
                active_limit = ACTIVE_PAGE if active_at < counts["active"] else 0
                k = self.keys(queue)
                pages.append(more.oldest(k, lanes_at, lane_limit, active_at, active_limit))
                lanes_at += OLDEST_LANE_PAGE
                active_at += ACTIVE_PAGE
            rows.append((counts, lanes, batch.result(oldest), pages))
        more.execute()
        out = []
        for counts, lanes, (enqueued, claimed), pages in rows:
            for handle in pages:
                page_enqueued, page_claimed = more.result(handle)
                enqueued, claimed = _least(enqueued, page_enqueued), _least(claimed, page_claimed)
            out.append((counts, lanes, enqueued, claimed))
        return out

    def _lanes_read(
        self,
        queue: str,
        counts: dict[str, int],
        page: list[tuple[str, int, int | None]],
        heads: bool,
    ) -> tuple[dict[str, int], dict[str, int], list[int]]:
        """Finish a tally from its first page: read the further lane pages, add the lanes up."""
        rows = list(page)
        while len(rows) < counts["lanes"] and len(page) == LANE_PAGE:
            page = self.scripts.tally(self.keys(queue), len(rows), LANE_PAGE, heads)[1]
            rows += page
        lanes = {g: n for g, n, _ in rows if n}
        counts["pending"] += sum(lanes.values())
        return counts, lanes, [h for _, _, h in rows if h is not None]

    def exists(self, queue: str) -> bool:
        """Return whether the queue holds any pending, delayed or active job."""
        k = self.keys(queue)
        return bool(self.client.exists(k.pending, k.active, k.lanes, k.delayed))

    def job(self, queue: str, job_id: str) -> dict[str, str]:
        """Return one job as text: its row, with what the row leaves implied.

        ``payload`` is the message's JSON text, ``queue`` the queue, and
        ``stalled`` and ``deliveries`` are ``"0"`` until first used. Empty when
        there is no such job.
        """
        k = self.keys(queue)
        with self.client.pipeline(transaction=False) as pipe:
            row, stored = pipe.hgetall(k.job(job_id)).get(k.msg(job_id)).execute()
        if not row:
            return {}
        job = {"queue": queue, "stalled": "0", "deliveries": "0", "priority": "0"}
        job.update({text(f): text(v) for f, v in row.items()})
        if stored is not None:
            try:
                job["payload"] = text(unpack(stored))
            except ValueError:
                job["payload"] = ""
        return job


def _least(a: int | None, b: int | None) -> int | None:
    return b if a is None else a if b is None else min(a, b)
