"""Run the batch-publishing example: 2,500 tasks sent in batches, each run once by one worker."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from examples._support import clean, running, wait_for, worker
from examples.batch_publish.app import log, submit_all

N = 2500

clean("ex-batch:")
submit_all(list(range(N)))
w = worker("examples.batch_publish.app", "batch-worker", "-c", "2")
with running(w):
    done = wait_for(lambda: log.hlen("ex-batch:runs") == N, 120)
    runs = {int(k): int(v) for k, v in log.hgetall("ex-batch:runs").items()}
print(f"{len(runs)} of {N} tasks ran; each ran {sorted(set(runs.values()))} time(s)")
clean("ex-batch:")
sys.exit(0 if done and sorted(runs) == list(range(N)) and set(runs.values()) == {1} else 1)
