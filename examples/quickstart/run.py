"""Run the quick start: one worker, a few tasks, their results."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from examples._support import clean, running, worker
from examples.quickstart.app import add

clean("ex-quickstart:")
w = worker("examples.quickstart.app", "quickstart", "-c", "2")
with running(w):
    results = [add.delay(i, i) for i in range(10)]
    values = [r.get(timeout=30) for r in results]
    print("results:", values)
clean("ex-quickstart:")
sys.exit(0 if values == [2 * i for i in range(10)] else 1)
