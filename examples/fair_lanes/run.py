"""Run the fair-lanes example: 30 jobs of tenant-a, then 3 of tenant-b, one worker."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from examples._support import clean, running, wait_for, worker
from examples.fair_lanes.app import log, submit

clean("ex-lanes:")
for i in range(30):
    submit("tenant-a", i)
for i in range(3):
    submit("tenant-b", i)
w = worker("examples.fair_lanes.app", "lanes-worker", "-c", "1")
with running(w):
    done = wait_for(lambda: log.llen("ex-lanes:order") == 33, 60)
    order = [x.decode() for x in log.lrange("ex-lanes:order", 0, -1)]
print("first ten run:", ", ".join(order[:10]))
b_positions = [n for n, job in enumerate(order) if job.startswith("tenant-b")]
print("tenant-b's jobs ran at positions", b_positions, "of", len(order))
clean("ex-lanes:")
sys.exit(0 if done and len(b_positions) == 3 and max(b_positions) < 8 else 1)
