"""Run the dead-letter example: a poison task, its budget, the handler's alert."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from celery_emq import StalledJobError
from examples._support import clean, running, wait_for, worker
from examples.dead_letter_handler.app import crash, sink

clean("ex-dlh:")
w = worker("examples.dead_letter_handler.app", "dlh-worker", "-c", "1")
with running(w):
    result = crash.delay(7)
    try:
        result.get(timeout=60)
        failed = False
    except StalledJobError as exc:
        print("AsyncResult.get() raised:", exc)
        failed = True
    alert = wait_for(lambda: sink.lrange("ex-dlh:alerts", 0, -1), 10) or []
    for line in alert:
        print("alert:", line.decode())
clean("ex-dlh:")
sys.exit(0 if failed and len(alert) == 1 else 1)
