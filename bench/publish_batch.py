"""A publish batch's cost: Celery publishes batched and one by one, and the Redis part alone.

    python -m bench.publish_batch --celery --tasks 1000 --rounds 15
    python -m bench.publish_batch --jobs 1000 --rounds 5

``--celery``: in one process, on a private ``redis-server``, each round
publishes ``--tasks`` no-op Celery tasks (``apply_async`` on one producer) one
by one and then inside ``Producer.batch(max_size=--tasks)``, on the stock
transport and on ``emq://`` (their order alternating from round to round, each
in a fresh key prefix). It prints per transport the median rates, the median of
the rounds' batched / one-by-one ratios (each round's pair taken seconds apart,
which keeps a loaded machine's drift out of the ratio) and the batched rate's
ratio to stock's. A batch's time ends once its last flush returned.

Without it: stores ``--jobs`` jobs (a typical Celery task message, stored
compressed) in one round trip each way, alternating which goes first, and
prints per way the median jobs a second the client saw and the Redis server's
CPU per job (its ``commandstats`` microseconds for ``EVALSHA``), on a private
``redis-server`` (its statistics are reset every round).
"""

from __future__ import annotations

import argparse
import statistics
import time
import uuid

import redis

from bench._common import private_redis, scan_delete
from celery_emq.store.codec import pack
from celery_emq.store.jobstore import JobStore
from celery_emq.store.outcomes import NewJob

#: A Celery task message as ``emq://`` stores it (JSON text, 930 bytes).
MESSAGE = (
    b'{"body": "W1tdLCB7fSwgeyJjYWxsYmFja3MiOiBudWxsLCAiZXJyYmFja3MiOiBudWxsLCAiY2hhaW4iOiBudWxs'
    b'LCAiY2hvcmQiOiBudWxsfV0=", "content-encoding": "utf-8", "content-type": "application/json", '
    b'"headers": {"lang": "py", "task": "bench.app.noop", "id": "%s", "shadow": null, '
    b'"eta": null, "expires": null, "group": null, "group_index": null, "retries": 0, '
    b'"timelimit": [null, null], "root_id": "%s", "parent_id": null, "argsrepr": "()", '
    b'"kwargsrepr": "{}", "origin": "gen1234@bench", "ignore_result": true, '
    b'"replaced_task_nesting": 0, "stamped_headers": null, "stamps": {}}, "properties": '
    b'{"correlation_id": "%s", "reply_to": "", "delivery_mode": 2, "delivery_info": '
    b'{"exchange": "", "routing_key": "celery"}, "priority": 0, "body_encoding": "base64"}}'
)


def jobs(n: int) -> list[NewJob]:
    out = []
    for _ in range(n):
        tid = str(uuid.uuid4()).encode()
        out.append(NewJob(uuid.uuid4().hex, MESSAGE % (tid, tid, tid)))
    return out


def pipelined(store: JobStore, queue: str, batch: list[NewJob]) -> None:
    """One ``enqueue`` call per job, all in one pipeline."""
    b = store.scripts.batch()
    k = store.keys(queue)
    for job in batch:
        b.enqueue(k, job.id, pack(job.payload), job.priority, None)
    b.execute()


def many(store: JobStore, queue: str, batch: list[NewJob]) -> None:
    """One ``enqueue_many`` call per 500 jobs, all in one pipeline."""
    b = store.scripts.batch()
    store.queue_enqueue_many(b, queue, batch)
    b.execute()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--jobs", type=int, default=1000)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--celery", action="store_true", help="Celery publishes, stock and emq://")
    ap.add_argument("--tasks", type=int, default=1000, help="tasks per publish (--celery)")
    args = ap.parse_args()
    with private_redis() as url:
        if args.celery:
            run_celery(url, args.tasks, args.rounds)
        else:
            run(redis.Redis.from_url(url), args.jobs, args.rounds)


def run_celery(url: str, n: int, rounds: int) -> None:
    from celery import Celery

    import celery_emq  # noqa: F401  (registers emq://)

    client = redis.Redis.from_url(url)
    schemes = ("redis", "emq")
    single: dict[str, list[float]] = {s: [] for s in schemes}
    batched: dict[str, list[float]] = {s: [] for s in schemes}
    ratio: dict[str, list[float]] = {s: [] for s in schemes}
    #: Per round: client CPU and Redis CPU per task (us), one by one then batched.
    cpu: dict[str, list[tuple[float, float, float, float]]] = {s: [] for s in schemes}
    for r in range(rounds + 1):
        order = schemes if r % 2 else tuple(reversed(schemes))
        for scheme in order:
            prefix = f"benchpb{uuid.uuid4().hex[:8]}:"
            app = Celery("bench", broker=url.replace("redis://", f"{scheme}://", 1))
            app.conf.update(
                broker_transport_options={"global_keyprefix": prefix}, task_ignore_result=True
            )
            noop = app.task(name="bench.app.noop")(_noop)
            try:
                with app.producer_or_acquire() as producer:
                    noop.apply_async(producer=producer)  # connect and declare first
                    client.config_resetstat()
                    c0, t0 = time.process_time(), time.perf_counter()
                    for _ in range(n):
                        noop.apply_async(producer=producer)
                    c1, t1 = time.process_time(), time.perf_counter()
                    server_single = _server_usec(client)
                    client.config_resetstat()
                    c2, t2 = time.process_time(), time.perf_counter()
                    with producer.batch(max_size=n):
                        for _ in range(n):
                            noop.apply_async(producer=producer)
                    c3, t3 = time.process_time(), time.perf_counter()
                    server_batched = _server_usec(client)
            finally:
                app.close()
                scan_delete(client, prefix)
            if r:  # the first round loads scripts and warms both paths
                single[scheme].append(n / (t1 - t0))
                batched[scheme].append(n / (t3 - t2))
                ratio[scheme].append((t1 - t0) / (t3 - t2))
                one = ((c1 - c0) * 1e6 / n, server_single / n)
                cpu[scheme].append((*one, (c3 - c2) * 1e6 / n, server_batched / n))
    med = statistics.median
    for scheme in schemes:
        print(
            f"{scheme + '://':>8} one by one {med(single[scheme]):6.0f}/s, "
            f"batched {med(batched[scheme]):6.0f}/s, "
            f"batched / one by one {med(ratio[scheme]):.2f} "
            f"(rounds {min(ratio[scheme]):.2f}-{max(ratio[scheme]):.2f})"
        )
    print(f"emq / stock, batched: {med(batched['emq']) / med(batched['redis']):.2f}")
    print("CPU per task (us, medians), client + Redis server:")
    for scheme in schemes:
        cs, ss, cb, sb = (med(x[i] for x in cpu[scheme]) for i in range(4))
        print(
            f"{scheme + '://':>8} one by one {cs:5.1f} + {ss:4.1f}, batched {cb:5.1f} + {sb:4.1f}"
        )


#: The benchmark's own commands to the server (statistics), not counted.
_OWN = ("cmdstat_config", "cmdstat_info")


def _server_usec(client: redis.Redis) -> float:
    """Microseconds the Redis server spent in commands since its statistics were reset."""
    stats = client.info("commandstats")
    return float(sum(int(v["usec"]) for k, v in stats.items() if k not in _OWN))


def _noop() -> None:
    return None


def run(client: redis.Redis, n: int, rounds: int) -> None:
    prefix = f"benchpb{uuid.uuid4().hex[:8]}:"
    store = JobStore(client, prefix + "emq", 30_000)
    ways = {"pipeline of enqueue": pipelined, "enqueue_many": many}
    rates: dict[str, list[float]] = {w: [] for w in ways}
    cpu: dict[str, list[float]] = {w: [] for w in ways}
    try:
        for r in range(rounds + 1):
            order = list(ways) if r % 2 else list(reversed(ways))
            for way in order:
                batch = jobs(n)
                client.config_resetstat()
                t0 = time.perf_counter()
                ways[way](store, f"q{r}", batch)
                elapsed = time.perf_counter() - t0
                stats = client.info("commandstats")
                usec = sum(
                    int(stats[name]["usec"])
                    for name in ("cmdstat_evalsha", "cmdstat_eval")
                    if name in stats
                )
                if r:  # the first round loads the scripts
                    rates[way].append(n / elapsed)
                    cpu[way].append(usec / n)
                scan_delete(client, prefix)
    finally:
        scan_delete(client, prefix)
    for way in ways:
        print(
            f"{way:>20}: {statistics.median(rates[way]):8.0f} jobs/s, "
            f"server {statistics.median(cpu[way]):5.1f} us/job"
        )


if __name__ == "__main__":
    main()
