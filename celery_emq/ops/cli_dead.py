"""``celery emq dead``: list, show, retry and purge the morgue's jobs.

::

    celery -A proj emq dead ls [--queue Q] [--task T] [--reason R] [--since S] [--until U]
    celery -A proj emq dead show ID... [--json]
    celery -A proj emq dead retry (ID... | --all | filters) [--rate N] [-f] [--dry-run]
    celery -A proj emq dead purge (ID... | --all | filters | --older-than S) [-f] [--dry-run]
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable, Sequence
from typing import Any

import click

from celery_emq.errors import UnknownJobError
from celery_emq.ops.command import emit, opened, table
from celery_emq.ops.format import parse_time
from celery_emq.ops.format import when as _when
from celery_emq.ops.morgue import REASONS, DeadJob, Morgue
from celery_emq.store.jobstore import JobStore
from celery_emq.transport.jobs import accepted_content

__all__ = ["dead"]


def _parse_time(value: str | None, option: str) -> tuple[int, bool] | None:
    """Read a time option (see :func:`~celery_emq.ops.format.parse_time`)."""
    if value is None:
        return None
    try:
        return parse_time(value)
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint=option) from None


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


@click.group()
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
    return table(
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
    with opened(ctx) as (store, _options, _app):
        morgue = Morgue(store, accepted_content(_app))
        jobs = morgue.ls(limit=limit, **_on_server_clock(_filter_args(filters), store))
    emit({"jobs": [j.as_dict() for j in jobs]}, as_json, lambda: _dead_rows(jobs))


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
    with opened(ctx) as (store, _options, _app):
        try:
            jobs = Morgue(store, accepted_content(_app)).select(list(job_ids), queue=queue)
        except UnknownJobError as exc:
            raise click.ClickException(_not_found(exc.missing, queue)) from None
    data: Any = jobs[0].as_dict() if len(job_ids) == 1 else [j.as_dict() for j in jobs]
    emit(data, as_json, lambda: "\n\n".join(_show_text(j) for j in jobs))


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
    """On a terminal, ask before acting on ``--all`` or filters (``-f`` does not ask).

    With no terminal to ask (a script, ``| tee log``), a purge is refused unless
    given ``-f``; a retry, which destroys nothing, goes ahead.
    """
    if force:
        return
    if not _interactive():
        if verb == "purge":
            raise click.ClickException(
                "refusing to purge dead jobs by --all or filters with no terminal to ask; "
                "pass -f/--force to purge without asking"
            )
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
    with opened(ctx) as (store, _options, app):
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
                done_: Any = len(exc.done) if key == "purged" else exc.done
                click.echo(json.dumps({key: done_, "missing": exc.missing, **_dry(dry_run)}))
            raise click.ClickException(str(exc)) from None
    if dry_run:
        emit(
            {"dry_run": True, "jobs": done, "missing": []},
            as_json,
            lambda: "\n".join([f"dry run: would {verb} {len(done)} job(s)", *done]),
        )
        return
    key = {"retry": "retried", "purge": "purged"}[verb]
    count = done if isinstance(done, int) else len(done)
    emit({key: done, "missing": []}, as_json, lambda: f"{key} {count} job(s)")


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
