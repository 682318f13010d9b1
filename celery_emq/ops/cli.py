"""``celery emq``: status, sweep, reap and the morgue, as a Celery subcommand.

Registered through the ``celery.commands`` entry point (as ``celery flower``
is), so it takes ``-A app`` and the app's broker settings::

    celery -A proj emq status [--json]
    celery -A proj emq sweep [--queue Q]... [--json]
    celery -A proj emq reap [--queue Q]... [--json]
    celery -A proj emq dead ls [--queue Q] [--task T] [--reason R] [--since S] [--until U]
    celery -A proj emq dead show ID... [--json]
    celery -A proj emq dead retry (ID... | --all | filters) [--rate N] [-f] [--dry-run]
    celery -A proj emq dead purge (ID... | --all | filters | --older-than S) [-f] [--dry-run]
    celery -A proj emq migrate --from redis://host/db [--queue Q]... [--unacked] [--dry-run]
    celery -A proj emq exporter --port N [--addr 127.0.0.1]

Human output is a table; ``--json`` output is stable for scripts. Errors are
one line on stderr and a non-zero exit. The morgue's commands are
:mod:`celery_emq.ops.cli_dead`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import click

from celery_emq.errors import EmqError
from celery_emq.ops.cli_dead import dead
from celery_emq.ops.command import emit, opened, table
from celery_emq.ops.format import age as _age
from celery_emq.store.server import check_server
from celery_emq.store.status import queue_statuses
from celery_emq.transport.sweeper import Sweeper
from celery_emq.worker.follow_up import CeleryFollowUp

__all__ = ["emq"]

#: Moved job ids a sweep or reap prints for people (``--json`` has them all).
MOVED_SHOWN = 20


@click.group(name="emq")
@click.pass_context
def emq(ctx: click.Context) -> None:
    """celery_emq: queue status, recovery passes and the morgue."""
    if ctx.obj is None or getattr(ctx.obj, "app", None) is None:
        raise click.UsageError("run as `celery -A <app> emq ...`")


@emq.command()
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@click.pass_context
def status(ctx: click.Context, as_json: bool) -> None:
    """Per queue: pending, active, delayed, dead, lanes, ages and counters."""
    with opened(ctx) as (store, _options, _app):
        rows = queue_statuses(store, store.queues())
        try:
            server: dict[str, Any] | None = check_server(store.client).as_dict()
        except Exception:  # INFO refused: the queues still tell
            server = None
    said = [f"warning: {w}" for w in (server or {}).get("warnings", [])]
    said += [f"note: {n}" for n in (server or {}).get("notes", [])]

    def human() -> str:
        if not rows:
            return "\n".join(["no queues yet", *said])
        return table(
            [
                (
                    r["queue"],
                    r["pending"],
                    r["active"],
                    r["delayed"],
                    r["dead"],
                    len(r["lanes"]),
                    _age(r["oldest_lease_age_ms"]),
                    _age(r["oldest_pending_age_ms"]),
                    r["counters"]["completed"],
                    r["counters"]["recovered"],
                    r["counters"]["failed"],
                )
                for r in rows
            ],
            (
                "queue",
                "pending",
                "active",
                "delayed",
                "dead",
                "lanes",
                "oldest lease",
                "oldest pending",
                "completed",
                "recovered",
                "dead-lettered",
            ),
        ) + "".join(f"\n{line}" for line in said)

    emit({"queues": rows, "server": server}, as_json, human)


def _pass(ctx: click.Context, queues: Sequence[str], as_json: bool, reap: bool) -> None:
    with opened(ctx) as (store, options, app):
        reports = [
            r.as_dict() for r in Sweeper(store, options, CeleryFollowUp(app)).run(queues, reap)
        ]

    kinds = ("reaped",) if reap else ("recovered", "dead")

    def human() -> str:
        if reap:
            text = table([(r["queue"], len(r["reaped"])) for r in reports], ("queue", "reaped"))
        else:
            text = table(
                [(r["queue"], len(r["recovered"]), len(r["dead"]), r["trimmed"]) for r in reports],
                ("queue", "recovered", "dead-lettered", "trimmed"),
            )
        moved = [
            f"{kind} from {r['queue']}: {job_id}"
            for r in reports
            for kind in kinds
            for job_id in r[kind]
        ]
        shown = moved[:MOVED_SHOWN]
        if len(moved) > MOVED_SHOWN:
            shown.append(f"... and {len(moved) - MOVED_SHOWN} more (--json lists them all)")
        return "\n".join([text, *shown])

    emit({"queues": reports}, as_json, human)


@emq.command()
@click.option("--queue", "queues", multiple=True, help="Only this queue (repeatable).")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@click.pass_context
def sweep(ctx: click.Context, queues: tuple[str, ...], as_json: bool) -> None:
    """Run one sweep now: count stalls, recover or dead-letter lapsed jobs."""
    _pass(ctx, queues, as_json, reap=False)


@emq.command()
@click.option("--queue", "queues", multiple=True, help="Only this queue (repeatable).")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@click.pass_context
def reap(ctx: click.Context, queues: tuple[str, ...], as_json: bool) -> None:
    """Run one reap now: return every lapsed job to its queue, uncounted."""
    _pass(ctx, queues, as_json, reap=True)


emq.add_command(dead)


@emq.command()
@click.option("--from", "source_url", required=True, help="The stock broker: redis://host:port/db.")
@click.option("--from-keyprefix", default="", help="kombu's global_keyprefix on the source.")
@click.option("--queue", "queues", multiple=True, help="Only this queue (repeatable).")
@click.option(
    "--unacked", is_flag=True, help="Also move delivered, unacked messages (their workers gone)."
)
@click.option("--dry-run", is_flag=True, help="Count what would move; move nothing.")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@click.pass_context
def migrate(
    ctx: click.Context,
    source_url: str,
    from_keyprefix: str,
    queues: tuple[str, ...],
    unacked: bool,
    dry_run: bool,
    as_json: bool,
) -> None:
    """Move tasks waiting on the stock redis:// transport into this app's emq:// broker."""
    from celery_emq.ops.migrate import migrate_app

    try:
        counts = migrate_app(
            ctx.obj.app, source_url, from_keyprefix, queues, unacked=unacked, dry_run=dry_run
        )
    except EmqError as exc:
        raise click.ClickException(str(exc)) from None
    rows = [c.as_dict() for c in counts]

    def human() -> str:
        text = table(
            [
                (
                    r["queue"],
                    r["waiting"],
                    r["unacked"],
                    r["moved"],
                    r["moved_unacked"],
                    r["already"],
                )
                for r in rows
            ],
            ("queue", "waiting", "unacked", "moved", "moved unacked", "already moved"),
        )
        total = sum(r["moved"] + r["moved_unacked"] for r in rows)
        tail = "dry run: nothing moved" if dry_run else f"moved {total} message(s)"
        return f"{text}\n{tail}"

    emit({"dry_run": dry_run, "queues": {r["queue"]: r for r in rows}}, as_json, human)


@emq.command()
@click.option("--port", type=click.IntRange(0, 65535), required=True, help="Port to listen on.")
@click.option("--addr", default="127.0.0.1", show_default=True, help="Address to listen on.")
@click.pass_context
def exporter(ctx: click.Context, port: int, addr: str) -> None:
    """Serve the Prometheus metrics at http://ADDR:PORT/metrics until SIGINT or SIGTERM.

    Each request has a thread of its own: a client that holds a connection
    without sending a request delays no other scrape.
    """
    try:
        from prometheus_client import CollectorRegistry, make_wsgi_app
        from prometheus_client.exposition import ThreadingWSGIServer
    except ImportError:
        raise click.ClickException(
            "the exporter needs prometheus_client: pip install 'celery-emq[metrics]'"
        ) from None
    import signal
    from wsgiref.simple_server import WSGIRequestHandler, make_server

    from celery_emq.ops.metrics import AppStore, EmqCollector

    class QuietHandler(WSGIRequestHandler):
        def log_message(self, format: str, *args: Any) -> None:
            """Scrapes are not logged."""

    source = AppStore(ctx.obj.app)
    registry = CollectorRegistry()
    registry.register(EmqCollector(source))
    server = make_server(
        addr,
        port,
        make_wsgi_app(registry),
        server_class=ThreadingWSGIServer,
        handler_class=QuietHandler,
    )

    def stop(signum: int, _frame: Any) -> None:
        raise SystemExit(0)

    previous = signal.signal(signal.SIGTERM, stop)
    click.echo(f"serving emq metrics on http://{addr}:{server.server_port}/metrics")
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        signal.signal(signal.SIGTERM, previous)
        server.server_close()
        source.reset()
