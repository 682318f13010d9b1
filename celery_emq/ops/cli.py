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
one line on stderr and a non-zero exit.
"""

from __future__ import annotations

import json
import re
import sys
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from datetime import datetime, timezone
from typing import Any

import click

from celery_emq.errors import EmqError, UnknownJobError
from celery_emq.ops.format import age as _age
from celery_emq.ops.format import when as _when
from celery_emq.ops.morgue import REASONS, DeadJob, Morgue
from celery_emq.options import EmqOptions
from celery_emq.store.jobstore import JobStore
from celery_emq.store.server import check_server
from celery_emq.store.status import queue_statuses
from celery_emq.transport.jobs import accepted_content
from celery_emq.transport.sweeper import Sweeper

__all__ = ["emq"]

#: Moved job ids a sweep or reap prints for people (``--json`` has them all).
MOVED_SHOWN = 20

_DURATION = re.compile(r"^(\d+(?:\.\d+)?)([smhd]?)$")
_UNITS = {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400}


def _parse_time(value: str | None, option: str) -> tuple[int, bool] | None:
    """Read a time option: a duration ago (``90s``, ``30m``, ``2h``, ``7d``) or ISO-8601.

    Returns ``(ms, ago)``: a duration in ms to take from the Redis server's
    clock (``ago``), or a time in ms since the epoch.
    """
    if value is None:
        return None
    m = _DURATION.match(value.strip())
    if m:
        return int(float(m.group(1)) * _UNITS[m.group(2)] * 1000), True
    try:
        when = datetime.fromisoformat(value)
    except ValueError:
        raise click.BadParameter(
            "expected a duration ago (90s, 30m, 2h, 7d) or an ISO-8601 time", param_hint=option
        ) from None
    if when.tzinfo is None:
        when = when.replace(tzinfo=timezone.utc)
    return int(when.timestamp() * 1000), False


def _on_server_clock(args: dict[str, Any], store: JobStore) -> dict[str, Any]:
    """Turn the ``since_ms``/``until_ms`` of :func:`_filter_args` into times.

    A duration ago counts back from the Redis server's clock, which every
    time of death was read on.
    """
    out = dict(args)
    now: int | None = None
    for key in ("since_ms", "until_ms"):
        spec = args.get(key)
        if spec is None:
            continue
        ms, ago = spec
        if ago and now is None:
            now = store.server_ms()
        out[key] = (now or 0) - ms if ago else ms
    return out


def _table(rows: Sequence[Sequence[Any]], header: Sequence[str]) -> str:
    cells = [[str(c) for c in header]] + [[str(c) for c in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def _emit(data: Any, as_json: bool, human: Callable[[], str]) -> None:
    if as_json:
        click.echo(json.dumps(data, indent=2, sort_keys=True, default=str))
    else:
        click.echo(human())


@contextmanager
def _opened(ctx: click.Context) -> Iterator[tuple[JobStore, EmqOptions, Any]]:
    app = ctx.obj.app
    from celery_emq.ops.tasks import open_store

    try:
        with open_store(app) as (store, options):
            yield store, options, app
    except EmqError as exc:
        raise click.ClickException(str(exc)) from None
    except Exception as exc:
        said = _broker_error(exc)
        if said is not None:
            raise click.ClickException(said) from None
        raise


def _broker_error(exc: BaseException) -> str | None:
    """One line saying what the broker's error means, or ``None`` if it is not one."""
    import redis

    seen: BaseException | None = exc
    while seen is not None:  # kombu wraps redis-py's errors
        if isinstance(seen, redis.AuthenticationError) or any(
            word in str(seen) for word in ("WRONGPASS", "NOAUTH", "invalid username-password")
        ):
            return f"the broker refused the credentials: {seen}"
        if isinstance(seen, redis.exceptions.NoPermissionError):
            return f"the broker's ACL does not allow a command celery_emq needs: {seen}"
        if isinstance(seen, redis.ConnectionError | redis.TimeoutError | OSError):
            return f"cannot reach the broker: {seen}"
        seen = seen.__cause__ or seen.__context__
    if type(exc).__module__.startswith(("redis", "kombu")):
        return f"the broker answered with an error: {exc}"
    return None


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
    with _opened(ctx) as (store, _options, _app):
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
        return _table(
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

    _emit({"queues": rows, "server": server}, as_json, human)


def _pass(ctx: click.Context, queues: Sequence[str], as_json: bool, reap: bool) -> None:
    with _opened(ctx) as (store, options, app):
        reports = [r.as_dict() for r in Sweeper(store, options, app=app).run(queues, reap)]

    kinds = ("reaped",) if reap else ("recovered", "dead")

    def human() -> str:
        if reap:
            text = _table([(r["queue"], len(r["reaped"])) for r in reports], ("queue", "reaped"))
        else:
            text = _table(
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

    _emit({"queues": reports}, as_json, human)


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


@emq.group()
def dead() -> None:
    """The morgue: list, show, retry and purge dead-lettered jobs."""


def _filters(f: Callable[..., Any]) -> Callable[..., Any]:
    for opt in reversed(
        [
            click.option("--queue", help="Only this queue."),
            click.option("--task", help="Only this task name."),
            click.option("--task-id", help="Only the job of this Celery task id."),
            click.option("--reason", type=click.Choice(REASONS), help="Only this reason."),
            click.option("--since", help="Died at or after: 30m, 2h, 7d ago, or ISO-8601."),
            click.option("--until", help="Died at or before: 30m, 2h, 7d ago, or ISO-8601."),
        ]
    ):
        f = opt(f)
    return f


def _filter_args(filters: dict[str, Any]) -> dict[str, Any]:
    """Turn the filter options into :meth:`Morgue.ls` arguments."""
    return {
        "queue": filters["queue"],
        "task": filters["task"],
        "task_id": filters["task_id"],
        "reason": filters["reason"],
        "since_ms": _parse_time(filters["since"], "--since"),
        "until_ms": _parse_time(filters["until"], "--until"),
    }


def _dead_rows(jobs: Sequence[DeadJob]) -> str:
    if not jobs:
        return "the morgue is empty (for these filters)"
    return _table(
        [
            (
                j.id,
                j.queue,
                j.task_name or "?",
                j.task_id or "?",
                j.reason,
                j.stalled,
                _when(j.died_ms),
            )
            for j in jobs
        ],
        ("job", "queue", "task", "task id", "reason", "stalls", "died (UTC)"),
    )


@dead.command("ls")
@_filters
@click.option("--limit", type=click.IntRange(min=1), help="At most this many.")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@click.pass_context
def dead_ls(ctx: click.Context, /, limit: int | None, as_json: bool, **filters: Any) -> None:
    """List dead jobs, oldest death first."""
    with _opened(ctx) as (store, _options, _app):
        morgue = Morgue(store, accepted_content(_app))
        jobs = morgue.ls(limit=limit, **_on_server_clock(_filter_args(filters), store))
    _emit({"jobs": [j.as_dict() for j in jobs]}, as_json, lambda: _dead_rows(jobs))


def _show_text(job: DeadJob) -> str:
    lines = [
        f"job        {job.id}",
        f"queue      {job.queue}",
        f"task       {job.task_name} [{job.task_id}]",
        f"args       {job.args!r}",
        f"kwargs     {job.kwargs!r}",
        f"group      {job.group or '-'}",
        f"reason     {job.reason} ({job.last_error})",
        f"error      {job.error}",
        f"stalls     {job.stalled}   deliveries {job.deliveries}",
        f"died       {_when(job.died_ms)} UTC",
        "history:",
    ]
    lines += [
        f"  {_when(h.get('at', 0))}  stall {h.get('stalled')}  {h.get('reason')}  "
        f"owner {h.get('owner') or '-'}"
        for h in job.history
    ] or ["  (none)"]
    if job.decode_error:
        lines.append(f"decode error: {job.decode_error}")
    return "\n".join(lines)


@dead.command("show")
@click.argument("job_ids", metavar="ID...", nargs=-1, required=True)
@click.option("--queue", help="The jobs' queue (default: search every queue).")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@click.pass_context
def dead_show(
    ctx: click.Context, job_ids: tuple[str, ...], queue: str | None, as_json: bool
) -> None:
    """Show dead jobs (by job id or Celery task id): task, error, stall history.

    Every id must name a dead job, or nothing is shown and the command fails.
    ``--json`` prints one object for one id, a list of them for several.
    """
    with _opened(ctx) as (store, _options, _app):
        try:
            jobs = Morgue(store, accepted_content(_app)).select(list(job_ids), queue=queue)
        except UnknownJobError as exc:
            raise click.ClickException(_not_found(exc.missing, queue)) from None
    data: Any = jobs[0].as_dict() if len(job_ids) == 1 else [j.as_dict() for j in jobs]
    _emit(data, as_json, lambda: "\n\n".join(_show_text(j) for j in jobs))


def _not_found(idents: Sequence[str], queue: str | None) -> str:
    where = f"queue {queue!r}" if queue else "any queue's morgue"
    return f"no dead job with job id or Celery task id {', '.join(map(repr, idents))} in {where}"


def _selected(job_ids: Sequence[str], all_: bool, filters: dict[str, Any]) -> dict[str, Any]:
    """Check that ids, ``--all`` or filters chose the jobs; return the Morgue arguments."""
    args = _filter_args(filters)
    chosen = any(v is not None for k, v in args.items() if k != "queue")
    if not job_ids and not all_ and not chosen:
        where = f" of queue {args['queue']!r}" if args["queue"] else ""
        raise click.ClickException(
            f"name job or task ids, give a filter, or pass --all for every dead job{where}"
        )
    if job_ids and (all_ or chosen):
        raise click.ClickException("give job or task ids or --all/filters, not both")
    return args


def _interactive() -> bool:
    """Whether a person is at the keyboard (stdin and stdout are a terminal)."""
    return sys.stdin.isatty() and sys.stdout.isatty()


def _bulk(verb: str, morgue: Morgue, args: dict[str, Any], all_: bool, force: bool) -> None:
    """On a terminal, ask before acting on ``--all`` or filters (``-f`` does not ask)."""
    if force or not _interactive():
        return
    n = len(morgue.select(all=all_, **args))
    where = f"queue {args['queue']!r}" if args["queue"] else "every queue"
    click.confirm(f"{verb} {n} dead job(s) of {where}?", abort=True)


def _act(
    ctx: click.Context,
    verb: str,
    act: Callable[[Morgue, list[str] | None, dict[str, Any]], Any],
    job_ids: Sequence[str],
    all_: bool,
    force: bool,
    dry_run: bool,
    as_json: bool,
    **filters: Any,
) -> None:
    """What ``dead retry`` and ``dead purge`` share: select, check, confirm, act, report."""
    args = _selected(job_ids, all_, filters)
    ids = list(job_ids) if job_ids else None
    with _opened(ctx) as (store, _options, app):
        morgue = Morgue(store, accepted_content(app))
        args = _on_server_clock(args, store)
        kwargs = dict(args) if ids is None else {"queue": args["queue"]}
        if ids is None:
            kwargs["all"] = all_
        try:
            if dry_run:
                jobs = morgue.select(ids, **kwargs)
                done: Any = [j.id for j in jobs]
            else:
                if ids is None:
                    _bulk(verb, morgue, args, all_, force)
                done = act(morgue, ids, kwargs)
        except UnknownJobError as exc:
            if as_json:
                key = "jobs" if dry_run else {"retry": "retried", "purge": "purged"}[verb]
                empty: Any = 0 if key == "purged" else []
                click.echo(json.dumps({key: empty, "missing": exc.missing, **_dry(dry_run)}))
            raise click.ClickException(str(exc)) from None
    if dry_run:
        _emit(
            {"dry_run": True, "jobs": done, "missing": []},
            as_json,
            lambda: "\n".join([f"dry run: would {verb} {len(done)} job(s)", *done]),
        )
        return
    key = {"retry": "retried", "purge": "purged"}[verb]
    count = done if isinstance(done, int) else len(done)
    _emit({key: done, "missing": []}, as_json, lambda: f"{key} {count} job(s)")


def _dry(dry_run: bool) -> dict[str, Any]:
    return {"dry_run": True} if dry_run else {}


def _acting(f: Callable[..., Any]) -> Callable[..., Any]:
    """The options ``dead retry`` and ``dead purge`` share."""
    options: list[Callable[[Callable[..., Any]], Callable[..., Any]]] = [
        click.argument("job_ids", metavar="[ID]...", nargs=-1),
        click.option("--all", "all_", is_flag=True, help="Every dead job (of --queue, if given)."),
        _filters,
        click.option(
            "-f", "--force", is_flag=True, help="Do not ask on a terminal (--all, filters)."
        ),
        click.option("--dry-run", is_flag=True, help="Say which jobs; change nothing."),
    ]
    for opt in reversed(options):
        f = opt(f)
    return f


@dead.command("retry")
@_acting
@click.option(
    "--rate",
    type=click.FloatRange(min=0, min_open=True),
    default=500.0,
    show_default=True,
    help="Most jobs retried a second.",
)
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@click.pass_context
def dead_retry(ctx: click.Context, /, rate: float, **params: Any) -> None:
    """Retry dead jobs (job or Celery task ids): to the front of their queue, stalls reset.

    Every id given must name a dead job, or nothing is retried and the command
    fails naming those that do not. Every dead job (of a queue) takes --all;
    on a terminal, --all and filters ask first (-f does not).
    """
    _act(ctx, "retry", lambda m, ids, kw: m.retry(ids, rate_per_s=rate, **kw), **params)


@dead.command("purge")
@_acting
@click.option("--older-than", type=str, help="Only jobs that died longer ago: 90s, 30m, 2h, 7d.")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@click.pass_context
def dead_purge(ctx: click.Context, /, older_than: str | None, **params: Any) -> None:
    """Delete dead jobs for good (by job or Celery task id, --all or filters).

    Every id given must name a dead job, or nothing is deleted and the command
    fails naming those that do not. Every dead job (of a queue) takes --all;
    on a terminal, --all and filters ask first (-f does not).
    """
    if older_than is not None:
        params["until"] = older_than
    _act(ctx, "purge", lambda m, ids, kw: m.purge(ids, **kw), **params)


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
        text = _table(
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

    _emit({"dry_run": dry_run, "queues": {r["queue"]: r for r in rows}}, as_json, human)


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
