"""Which Redis deployment a broker URL names: one server, Sentinel or Cluster.

kombu splits ``emq+sentinel://h:26379/0`` at the ``+`` into the transport
(``emq``) and a host that is itself a URL (``sentinel://h:26379/0``), and
``;`` separates alternates. Left to kombu, a host URL it does not know is
dropped and the channel connects to ``localhost:6379``: :func:`target_of`
reads every form the transport serves and refuses any other by name.

Forms served (``emqs`` in place of ``emq`` for TLS):

- ``emq://host:port/db`` and ``emq+socket:///path.sock``: one server;
- ``emq+sentinel://s1:26379;emq+sentinel://s2:26379/db``: the master of the
  transport option ``master_name``, found through those sentinels;
- ``emq+cluster://node:7000;emq+cluster://node2:7000/0``: a Redis Cluster,
  reached through any of those seed nodes (database 0 only).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any
from urllib.parse import unquote, urlsplit

from celery_emq.errors import InvalidBrokerURLError

__all__ = ["FORMS", "BrokerTarget", "target_of"]

#: Every URL form the transport serves, as its error messages list them.
FORMS = (
    "emq://host:port/db, emq+socket:///path.sock, "
    "emq+sentinel://host:26379;emq+sentinel://host2:26379/db (with master_name), "
    "emq+cluster://host:7000/0 (emqs for TLS in each)"
)

_KINDS = {"sentinel": "sentinel", "cluster": "cluster", "socket": "single"}


@dataclass(frozen=True)
class BrokerTarget:
    """What a broker URL points at."""

    #: ``single``, ``sentinel`` or ``cluster``.
    kind: str
    tls: bool
    #: The sentinels or the cluster's seed nodes, in URL order (empty for ``single``).
    nodes: tuple[tuple[str, int], ...] = ()
    db: int = 0
    username: str | None = None
    password: str | None = None


def target_of(conninfo: Any) -> BrokerTarget:
    """Read a kombu ``Connection``'s URL; raise :class:`InvalidBrokerURLError` if not served."""
    scheme = conninfo.transport_cls if isinstance(conninfo.transport_cls, str) else ""
    # After a connection error kombu switches to the URL's next alternate and
    # reads it whole: the transport is then "emq+sentinel" and the host plain.
    base, _, switched = scheme.partition("+")
    tls = base == "emqs"
    prefix = base if switched else getattr(conninfo, "uri_prefix", None)
    host = conninfo.hostname or ""
    if switched and switched != "socket":
        urls = list(conninfo.alt) or [f"{scheme}://{host}:{conninfo.port}"]
    elif not prefix or "://" not in host:
        return BrokerTarget("single", tls)
    else:
        urls = list(conninfo.alt) or [f"{prefix}+{host}"]
    kinds, nodes = set(), []
    db: int | None = None
    username = password = None
    for url in urls:
        inner = url.split("+", 1)[1] if "+" in url.split("://", 1)[0] else url
        parts = urlsplit(inner)
        kind = _KINDS.get(parts.scheme)
        if kind is None:
            raise InvalidBrokerURLError(
                f"broker URL {_redacted(url)!r}: celery_emq does not serve "
                f"'{prefix}+{parts.scheme}://'; it serves {FORMS}"
            )
        kinds.add(parts.scheme)
        if parts.scheme == "socket":
            continue
        try:
            port = parts.port
        except ValueError as exc:
            raise InvalidBrokerURLError(f"broker URL {_redacted(url)!r}: {exc}") from None
        nodes.append((parts.hostname or "127.0.0.1", port or _default_port(parts.scheme)))
        path = parts.path.strip("/")
        if path:
            if not path.isdigit():
                raise InvalidBrokerURLError(
                    f"broker URL {_redacted(url)!r}: the database must be a number, not {path!r}"
                )
            db = int(path)
        username = username or (unquote(parts.username) if parts.username else None)
        password = password or (unquote(parts.password) if parts.password else None)
    if len(kinds) > 1:
        raise InvalidBrokerURLError(
            f"broker URL mixes {' and '.join(sorted(kinds))} alternates; "
            f"list one kind of node; celery_emq serves {FORMS}"
        )
    kind = _KINDS[kinds.pop()]
    if kind == "single":
        return BrokerTarget("single", tls)
    if kind == "cluster" and db not in (None, 0):
        raise InvalidBrokerURLError(
            f"broker URL names database {db}: a Redis Cluster has database 0 only"
        )
    return BrokerTarget(
        kind,
        tls,
        tuple(nodes),
        db or 0,
        username or conninfo.userid or None,
        password or conninfo.password or None,
    )


def _default_port(scheme: str) -> int:
    return 26379 if scheme == "sentinel" else 6379


def _redacted(url: str) -> str:
    """The URL with any password replaced by ``**``."""
    parts = urlsplit(url.split("+", 1)[1] if "+" in url.split("://", 1)[0] else url)
    if parts.password:
        return url.replace(f":{parts.password}@", ":**@", 1)
    return url
