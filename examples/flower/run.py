"""Run the Flower example: a worker, Flower, and what Flower's API reports."""

import json
import socket
import sys
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from examples._support import Process, clean, running, wait_for, worker
from examples.flower.app import add


def api(port: int, path: str) -> object:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as r:
            return json.loads(r.read())
    except OSError:
        return None


with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
clean("ex-flower:")
w = worker("examples.flower.app", "flower-worker", "-c", "1")
flower = Process(
    "examples.flower.app",
    "flower",
    "flower",
    f"--port={port}",
    "--address=127.0.0.1",
    env={"FLOWER_UNAUTHENTICATED_API": "true"},
)
with running(w, flower):
    wait_for(lambda: api(port, "/api/queues/length"), 30, interval=0.5)
    results = [add.delay(i, i) for i in range(5)]
    [r.get(timeout=30) for r in results]
    tasks = (
        wait_for(
            lambda: len(api(port, "/api/tasks") or {}) >= 5 and api(port, "/api/tasks"),
            20,
            interval=0.5,
        )
        or {}
    )
    queues = api(port, "/api/queues/length")
    print(f"Flower on http://127.0.0.1:{port}")
    print("queues:", json.dumps(queues))
    print("tasks:", sorted({t["state"] for t in tasks.values()}), len(tasks))
clean("ex-flower:")
sys.exit(0 if queues and len(tasks) == 5 else 1)
