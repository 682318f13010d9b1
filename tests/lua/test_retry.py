"""retry: a dead job comes back as if published at the retry, for the queue's ages."""

from __future__ import annotations

from celery_emq.store.jobstore import JobStore
from celery_emq.store.outcomes import Outcome
from celery_emq.store.status import queue_status

WEEK_MS = 7 * 24 * 3600 * 1000


def test_a_retried_week_old_job_is_as_old_as_its_retry(store: JobStore) -> None:
    store.enqueue("q", "old", b"{}", now_ms=1000)
    assert store.bury("q", "old", 0, "rejected", "", now_ms=2000) is Outcome.OK
    assert store.retry("q", ["old"], now_ms=WEEK_MS) == ["old"]
    row = store.job("q", "old")
    assert (row["enqueued_ms"], row["retried_ms"]) == (str(WEEK_MS), str(WEEK_MS))
    # The oldest pending age is 500 ms, not a week: no backlog alert for a retry.
    assert queue_status(store, "q", now_ms=WEEK_MS + 500)["oldest_pending_age_ms"] == 500
