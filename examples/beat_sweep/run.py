"""Run the beat example: a job whose worker vanished is recovered by the scheduled sweep."""

import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from celery_emq.tasks import open_store
from examples._support import Process, clean, running, wait_for, worker
from examples.beat_sweep.app import add, app

clean("ex-beat:")
result = add.delay(20, 22)
with open_store(app) as (store, _options):
    # Claim and start it as a worker that then vanished: its lease lapsed a minute ago.
    [job] = store.claim("celery", "vanished-worker", now_ms=int(time.time() * 1000) - 60_000)
    store.start("celery", job.id, job.token)
    print(f"job {job.id} leased by a worker that is gone")
    w = worker(
        "examples.beat_sweep.app", "beat-worker", "-c", "1", env={"EX_WORKER_SWEEP_S": "3600"}
    )
    schedule = Path(tempfile.mkdtemp()) / "beat-schedule"
    beat = Process("examples.beat_sweep.app", "beat", "beat", "-l", "info", "-s", str(schedule))
    with running(w, beat):
        value = result.get(timeout=30)
        print(f"recovered by the beat-scheduled sweep and run: add(20, 22) = {value}")
        sent = wait_for(lambda: "Sending due task celery_emq.sweep" in beat.text(), 10)
        print("beat log:", "sends celery_emq.sweep" if sent else "no sweep sent")
        recovered = store.metrics("celery")["recovered"]
clean("ex-beat:")
sys.exit(0 if value == 42 and sent and recovered == 1 else 1)
