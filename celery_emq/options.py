"""Transport options: one frozen, validated dataclass.

Options are read from Celery's ``broker_transport_options`` (kombu's
``transport_options``). Only the options below belong to celery_emq; kombu's own
Redis options (``socket_timeout``, ``global_keyprefix``, ...) keep their meaning.
"""

from __future__ import annotations

import difflib
import logging
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

from celery_emq.errors import InvalidOptionError

logger = logging.getLogger(__name__)

__all__ = ["EmqOptions"]


#: Transport options that belong to kombu or Celery (its connection retry policy),
#: never taken for a misspelling of ours.
_THEIRS = frozenset(
    {
        "ack_emulation", "body_encoding", "client_name", "confirm_publish",
        "deadletter_queue", "fanout_patterns", "fanout_prefix", "global_keyprefix",
        "health_check_interval", "interval_max", "interval_start", "interval_step",
        "master_name", "max_connections", "max_retries", "min_other_sentinels",
        "polling_interval", "priority_steps", "queue_order_strategy", "retry_on_timeout",
        "sentinel_fanout_compat", "sentinel_kwargs", "sep", "socket_connect_timeout",
        "socket_keepalive", "socket_keepalive_options", "socket_timeout",
        "unacked_index_key", "unacked_key", "unacked_mutex_expire", "unacked_mutex_key",
        "unacked_restore_interval", "unacked_restore_limit", "unacked_restore_throttle",
        "visibility_timeout",
    }
)  # fmt: skip
_warned: set[str] = set()


def _warn_near_misses(topts: Mapping[str, Any], ours: list[str]) -> None:
    """Warn, once per process and name, of an unknown option that looks like one of ours."""
    for name in topts:
        if not isinstance(name, str) or name in ours or name in _THEIRS or name in _warned:
            continue
        close = difflib.get_close_matches(name, ours, n=1, cutoff=0.6)
        if close:
            _warned.add(name)
            logger.warning(
                "celery_emq: unknown transport option %r is ignored; did you mean %r?",
                name,
                close[0],
            )


def _int(
    topts: Mapping[str, Any], name: str, default: int, low: int, high: int, bound: str = ""
) -> int:
    """Read an integer option from ``low`` to ``high``; ``bound`` says what set a bound."""
    value = topts.get(name, default)
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        why = f" ({bound})" if bound else ""
        raise InvalidOptionError(name, value, f"an integer from {low} to {high}{why}")
    return value


#: The default ``max_lapsed`` is this many times ``max_stalled + 1``: generous, as
#: an innocent job lapses unstarted each time a worker holding it prefetched dies.
LAPSES_PER_STALL = 4


@dataclass(frozen=True)
class EmqOptions:
    """The celery_emq transport options, validated.

    Attributes:
        lease_ms: How long a claim holds a job before it counts as lapsed.
        renew_interval_ms: How often a live worker renews the leases it holds;
            defaults to a third of ``lease_ms`` and must be less than half of it.
        claim_batch: Most jobs one claim takes (bounded further by prefetch).
        key_prefix: Prefix of every key; kombu's ``global_keyprefix`` goes in front.
        max_stalled: Stalls a job is forgiven: ``1`` recovers a job once and
            dead-letters it on its second stall, ``0`` dead-letters on the first,
            ``None`` never dead-letters. A task may set its own
            (``emq_max_stalled``).
        max_lapsed: Lapses a job is forgiven before its task ever started (a
            message that kills its worker while it is received or decoded);
            past it the job is dead-lettered as ``never_started``. Defaults to
            ``4 * (max_stalled + 1)``; ``None`` never dead-letters (the default
            when ``max_stalled`` is ``None``).
        sweep_interval_s: How often each consuming worker sweeps its queues;
            defaults to a third of ``lease_ms`` and at most 5 s.
        sweep_batch: Most lapsed jobs one sweep script call examines.
        idle_wait_s: Longest an idle consumer's blocking wait lasts before it
            looks at its queues again (a wake marker lost with a consumer killed
            between its wait and its claim strands a job at most this long). A
            wait ends sooner when the earliest delayed job it knows of is due,
            and stays under kombu's ``socket_timeout`` and within its BRPOP
            health check (``health_check_interval``).
        dead_max_size: Most dead jobs a queue's morgue keeps (0: no bound).
        dead_max_age_s: How long a dead job is kept (0: forever).
        settle_delay_ms: How long, inside a running worker, an ack (or a start
            record the worker writes for a prefork child) may wait for others
            to be sent with it in one round trip; 0 sends each when made.
        wait_replicas: How many replicas must confirm each publish and each
            settle (Redis ``WAIT``) before it counts as done; 0 (default) asks
            none. A publish fewer confirm raises
            :class:`~celery_emq.errors.ReplicasUnconfirmedError`; a settle
            fewer confirm is logged (its task may run again after a failover).
        wait_timeout_ms: How long one ``WAIT`` may block for those replicas.
        command_retries: How many times a Redis command that failed on a
            connection error or a timeout is sent again (at once, on a new
            connection) before the error is raised, by every client of the
            transport (the store's, kombu's, the Cluster's); 0 (default) sends
            each once, so a call costs at most its socket timeout. A Cluster
            also retries errors that cost no timeout (a refused connection,
            ``CLUSTERDOWN``) ten times more. The sentinels are asked once each
            per discovery.
    """

    lease_ms: int = 30_000
    renew_interval_ms: int = 10_000
    claim_batch: int = 64
    key_prefix: str = "emq"
    max_stalled: int | None = 1
    max_lapsed: int | None = 8
    sweep_interval_s: float = 5.0
    sweep_batch: int = 500
    idle_wait_s: float = 8.0
    dead_max_size: int = 10_000
    dead_max_age_s: int = 7 * 86_400
    settle_delay_ms: int = 5
    wait_replicas: int = 0
    wait_timeout_ms: int = 1000
    command_retries: int = 0

    @classmethod
    def from_transport_options(cls, topts: Mapping[str, Any]) -> EmqOptions:
        """Build and validate options from a transport-options mapping.

        Raises:
            InvalidOptionError: an option is outside its accepted range; the
                message names the option.

        An unknown option close to one of these (``lease_msec``) is logged as a
        warning, once, naming the likely one; it is otherwise ignored, as
        options for other transports are.
        """
        _warn_near_misses(topts, [f.name for f in fields(cls)])
        lease_ms = _int(topts, "lease_ms", cls.lease_ms, 500, 86_400_000)
        renew_default = max(lease_ms // 3, 100)
        renew_interval_ms = _int(
            topts,
            "renew_interval_ms",
            renew_default,
            100,
            max(lease_ms // 2 - 1, 100),
            f"less than lease_ms / 2, with lease_ms={lease_ms}: a lease is renewed at least "
            "twice before it lapses",
        )
        claim_batch = _int(topts, "claim_batch", cls.claim_batch, 1, 1000)
        prefix = topts.get("key_prefix", cls.key_prefix)
        if not isinstance(prefix, str) or not prefix or "{" in prefix or "}" in prefix:
            raise InvalidOptionError("key_prefix", prefix, "a non-empty string without '{' or '}'")
        global_prefix = topts.get("global_keyprefix") or ""
        if not isinstance(global_prefix, str) or "{" in global_prefix or "}" in global_prefix:
            # It heads every key: a brace in it would be taken for the hash tag.
            raise InvalidOptionError(
                "global_keyprefix", global_prefix, "a string without '{' or '}'"
            )
        max_stalled = topts.get("max_stalled", cls.max_stalled)
        if max_stalled is not None:
            max_stalled = _int(topts, "max_stalled", 1, 0, 1_000_000)
        lapsed_default = None if max_stalled is None else LAPSES_PER_STALL * (max_stalled + 1)
        max_lapsed = topts.get("max_lapsed", lapsed_default)
        if "max_lapsed" in topts and max_lapsed is not None:
            max_lapsed = _int(topts, "max_lapsed", 1, 1, 1_000_000)
        # A third of the lease keeps the gap between sweeps under half a lease,
        # which is what an outage looks like (see the warning below).
        interval_default = min(cls.sweep_interval_s, lease_ms / 3000)
        interval = topts.get("sweep_interval_s", interval_default)
        if (
            isinstance(interval, bool)
            or not isinstance(interval, int | float)
            or not 0.1 <= interval <= 3600
        ):
            raise InvalidOptionError("sweep_interval_s", interval, "a number from 0.1 to 3600")
        warning = f"sweep_interval_s={interval}/lease_ms={lease_ms}"
        # Compared with a margin: the default (lease_ms / 3000) sits on the bound,
        # and rounding put some leases' default a hair above it.
        if float(interval) * 3000 > lease_ms * (1 + 1e-9) and warning not in _warned:
            _warned.add(warning)
            logger.warning(
                "celery_emq: sweep_interval_s=%s is more than a third of lease_ms=%s: a gap "
                "between sweeps of over half a lease looks like an outage, and a dead worker's "
                "job then waits one more lease (keep sweep_interval_s under lease_ms / 3000)",
                interval,
                lease_ms,
            )
        idle_wait_s = topts.get("idle_wait_s", cls.idle_wait_s)
        if (
            isinstance(idle_wait_s, bool)
            or not isinstance(idle_wait_s, int | float)
            or not 0.1 <= idle_wait_s <= 3600
        ):
            raise InvalidOptionError("idle_wait_s", idle_wait_s, "a number from 0.1 to 3600")
        return cls(
            lease_ms=lease_ms,
            renew_interval_ms=renew_interval_ms,
            claim_batch=claim_batch,
            key_prefix=f"{global_prefix}{prefix}",
            max_stalled=max_stalled,
            max_lapsed=max_lapsed,
            sweep_interval_s=float(interval),
            sweep_batch=_int(topts, "sweep_batch", cls.sweep_batch, 1, 1000),
            idle_wait_s=float(idle_wait_s),
            dead_max_size=_int(topts, "dead_max_size", cls.dead_max_size, 0, 100_000_000),
            dead_max_age_s=_int(topts, "dead_max_age_s", cls.dead_max_age_s, 0, 10 * 365 * 86_400),
            settle_delay_ms=_int(
                topts, "settle_delay_ms", cls.settle_delay_ms, 0, min(1000, lease_ms // 10)
            ),
            wait_replicas=_int(topts, "wait_replicas", cls.wait_replicas, 0, 100),
            # WAIT 0 would block for ever: a bound is required.
            wait_timeout_ms=_int(topts, "wait_timeout_ms", cls.wait_timeout_ms, 1, 60_000),
            command_retries=_int(topts, "command_retries", cls.command_retries, 0, 10),
        )
