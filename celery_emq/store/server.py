"""What the Redis server's own settings mean for the jobs it holds.

Read once by each consuming worker (a warning in its log) and by
``celery emq status``: an eviction policy that may delete any key can delete
jobs without a trace; a server without persistence loses every job on restart.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from redis.cluster import RedisCluster

__all__ = ["ServerCheck", "check_server"]


@dataclass(frozen=True)
class ServerCheck:
    """The settings that decide what a Redis may lose, and what they mean."""

    maxmemory: int | None
    maxmemory_policy: str
    #: "aof", "rdb", "aof+rdb", "none" or "unknown" (CONFIG refused, as on some services).
    persistence: str
    warnings: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def check_server(client: Any) -> ServerCheck:
    """Read ``INFO`` (and ``CONFIG GET save`` where allowed) and judge them.

    On a Redis Cluster, every master is read and the findings merged.
    """
    if isinstance(client, RedisCluster):
        masters = client.get_primaries()  # type: ignore[no-untyped-call]
        return _merged([check_server(client.get_redis_connection(n)) for n in masters])
    info = client.info()
    policy = str(info.get("maxmemory_policy", "unknown"))
    maxmemory = info.get("maxmemory")
    aof = bool(info.get("aof_enabled"))
    rdb: bool | None
    try:
        save = client.config_get("save").get("save", "")
        rdb = bool(str(save).strip())
    except Exception:  # managed services often refuse CONFIG
        rdb = None
    if rdb is None and not aof:
        persistence = "unknown"
    else:
        persistence = "+".join(n for n, on in (("aof", aof), ("rdb", rdb)) if on) or "none"
    warnings, notes = [], []
    if policy.startswith("allkeys-"):
        bites = "" if maxmemory else " once a maxmemory is set"
        warnings.append(
            f"maxmemory-policy is {policy}: under memory pressure{bites} Redis silently "
            "deletes any key, queued and running jobs included. Set maxmemory-policy "
            "noeviction (publishing then fails with a clear error instead)"
        )
    if persistence == "none":
        notes.append(
            "Redis keeps nothing on disk: a restart loses every queued, running and "
            "dead-lettered job and every counter (appendonly yes keeps them)"
        )
    elif persistence == "rdb":
        notes.append(
            "Redis persists by snapshots only: a restart loses what changed since the "
            "last snapshot (appendonly yes with appendfsync everysec or always keeps more)"
        )
    return ServerCheck(
        maxmemory=int(maxmemory) if maxmemory is not None else None,
        maxmemory_policy=policy,
        persistence=persistence,
        warnings=warnings,
        notes=notes,
    )


def _merged(checks: list[ServerCheck]) -> ServerCheck:
    """One check for several masters: each distinct finding once."""
    first = checks[0]
    return ServerCheck(
        maxmemory=first.maxmemory,
        maxmemory_policy="/".join(dict.fromkeys(c.maxmemory_policy for c in checks)),
        persistence="/".join(dict.fromkeys(c.persistence for c in checks)),
        warnings=list(dict.fromkeys(t for c in checks for t in c.warnings)),
        notes=list(dict.fromkeys(t for c in checks for t in c.notes)),
    )
