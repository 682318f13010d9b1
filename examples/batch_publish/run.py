"""Run the batch-publishing example: 2,500 tasks sent in batches, each run once by one worker.

One flush's reply is lost on the way back (as when the connection drops just
after Redis ran it): the flush fails with its jobs stored but of unknown
outcome, ``submit_all`` sends them again with their job ids, and none runs twice.
"""

import sys
from pathlib import Path

import redis

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from celery_emq.store.batch import Batch
from examples._support import clean, running, wait_for, worker
from examples.batch_publish.app import log, submit_all

N = 2500

sent_through = Batch.execute
lost: list[int] = []


def lose_the_second_reply(self: Batch, *args: object, **kwargs: object) -> None:
    """Send the flush, then (the second time only) fail as if the reply were lost."""
    sent_through(self, *args, **kwargs)
    lost.append(1)
    if len(lost) == 2:
        raise redis.ConnectionError("reply lost (simulated)")


clean("ex-batch:")
Batch.execute = lose_the_second_reply  # type: ignore[method-assign]
submit_all(list(range(N)))
Batch.execute = sent_through  # type: ignore[method-assign]
w = worker("examples.batch_publish.app", "batch-worker", "-c", "2")
with running(w):
    done = wait_for(lambda: log.hlen("ex-batch:runs") == N, 120)
    runs = {int(k): int(v) for k, v in log.hgetall("ex-batch:runs").items()}
print(f"{len(runs)} of {N} tasks ran; each ran {sorted(set(runs.values()))} time(s)")
print(f"{len(lost)} flushes sent, the reply of one lost and its tasks sent again")
clean("ex-batch:")
ok = len(lost) >= 4 and sorted(runs) == list(range(N)) and set(runs.values()) == {1}
sys.exit(0 if done and ok else 1)
