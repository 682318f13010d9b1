"""Publish benchmark tasks from a process of their own; print the seconds it took.

Run by the harness with a round's environment (see ``bench/app.py``), so both
transports pay the same import and connection costs outside the timed loop:

    python -m bench.publish tick 2000
    python -m bench.publish noop 1000 --countdown 3600
    python -m bench.publish stamp 2000 --rate 200      # paced: 200 tasks/s
    python -m bench.publish nap 1000 --arg 300
    python -m bench.publish drained 2000 --no-store    # Celery's and kombu's part alone
    python -m bench.publish noop 2000 --batch 1000     # inside Producer.batch(max_size=1000)

``--batch N`` publishes inside kombu 5.7's ``Producer.batch(max_size=N)``; the
timed part ends once the batch's last flush returned (every task stored).
``--no-store`` replaces the transport's ``_put`` (the one call that stores a
message in Redis) with one that stores nothing: what is left is the publish's
cost outside the transport's own work (``bench/publish_parts.py``).
"""

from __future__ import annotations

import argparse
import time
from contextlib import nullcontext


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("task", choices=("tick", "noop", "drained", "stamp", "nap"))
    ap.add_argument("n", type=int)
    ap.add_argument("--countdown", type=float, default=None)
    ap.add_argument("--rate", type=float, default=0, help="tasks a second (0: as fast as it can)")
    ap.add_argument("--arg", type=float, default=None, help="the task's one argument")
    ap.add_argument(
        "--no-store", action="store_true", help="the transport stores nothing (see above)"
    )
    ap.add_argument(
        "--batch", type=int, default=0, help="publish inside Producer.batch(max_size=N) (0: not)"
    )
    args = ap.parse_args()

    import bench.app as b

    if args.no_store:
        _store_nothing()

    task = getattr(b, args.task)
    options = {} if args.countdown is None else {"countdown": args.countdown}
    with b.app.producer_or_acquire() as producer:
        # Connect (and declare) before the clock starts.
        task.apply_async(args=_args(args), producer=producer, **options)
        batch = producer.batch(max_size=args.batch) if args.batch else nullcontext()
        t0 = time.perf_counter()
        with batch:
            for i in range(1, args.n):
                if args.rate:
                    wait = t0 + i / args.rate - time.perf_counter()
                    if wait > 0:
                        time.sleep(wait)
                task.apply_async(args=_args(args), producer=producer, **options)
        elapsed = time.perf_counter() - t0
    print(elapsed, flush=True)


def _store_nothing() -> None:
    """Make both transports' ``_put`` a no-op (everything before it still runs)."""
    from kombu.transport import redis as kombu_redis

    from celery_emq.transport import channel as transport

    def put(self: object, queue: str, message: dict[str, object], **kwargs: object) -> None:
        return None

    kombu_redis.Channel._put = put
    transport.Channel._put = put


def _args(args: argparse.Namespace) -> tuple[float, ...]:
    if args.task == "stamp":
        return (time.time(),)
    if args.arg is not None:
        return (args.arg,)
    return ()


if __name__ == "__main__":
    main()
