"""What every ``celery emq`` command shares: the app's store, tables, JSON or text output."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import click
import redis

from celery_emq.errors import EmqError
from celery_emq.ops.tasks import open_store
from celery_emq.options import EmqOptions
from celery_emq.store.jobstore import JobStore

__all__ = ["broker_error", "emit", "opened", "table"]


def table(rows: Sequence[Sequence[Any]], header: Sequence[str]) -> str:
    """Rows under a header, in columns."""
    cells = [[str(c) for c in header]] + [[str(c) for c in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def emit(data: Any, as_json: bool, human: Callable[[], str]) -> None:
    """Print ``data`` as JSON, or ``human()`` for people."""
    if as_json:
        click.echo(json.dumps(data, indent=2, sort_keys=True, default=str))
    else:
        click.echo(human())


@contextmanager
def opened(ctx: click.Context) -> Iterator[tuple[JobStore, EmqOptions, Any]]:
    """Open the store of the command's app; a broker error ends the command in one line."""
    app = ctx.obj.app
    try:
        with open_store(app) as (store, options):
            yield store, options, app
    except EmqError as exc:
        raise click.ClickException(str(exc)) from None
    except Exception as exc:
        said = broker_error(exc)
        if said is not None:
            raise click.ClickException(said) from None
        raise


def broker_error(exc: BaseException) -> str | None:
    """One line saying what the broker's error means, or ``None`` if it is not one."""
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
