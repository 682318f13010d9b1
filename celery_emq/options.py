"""Transport options: one frozen, validated dataclass.

Options are read from Celery's ``broker_transport_options`` (kombu's
``transport_options``). Only the options below belong to celery_emq; kombu's own
Redis options (``socket_timeout``, ``global_keyprefix``, ...) keep their meaning.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

from .errors import InvalidOptionError

__all__ = ["EmqOptions"]


def _int(topts: Mapping[str, Any], name: str, default: int, low: int, high: int) -> int:
    value = topts.get(name, default)
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise InvalidOptionError(name, value, f"an integer from {low} to {high}")
    return value


@dataclass(frozen=True)
class EmqOptions:
    """The celery_emq transport options, validated.

    Attributes:
        lease_ms: How long a claim holds a job before it counts as lapsed.
        renew_interval_ms: How often a live worker renews the leases it holds;
            defaults to a third of ``lease_ms`` and must be less than half of it.
        claim_batch: Most jobs one claim takes (bounded further by prefetch).
        key_prefix: Prefix of every key; kombu's ``global_keyprefix`` goes in front.
    """

    lease_ms: int = 30_000
    renew_interval_ms: int = 10_000
    claim_batch: int = 64
    key_prefix: str = "emq"

    @classmethod
    def names(cls) -> tuple[str, ...]:
        """Return the option names this dataclass reads."""
        return tuple(f.name for f in fields(cls))

    @classmethod
    def from_transport_options(cls, topts: Mapping[str, Any]) -> EmqOptions:
        """Build and validate options from a transport-options mapping.

        Raises:
            InvalidOptionError: an option is outside its accepted range; the
                message names the option.
        """
        lease_ms = _int(topts, "lease_ms", cls.lease_ms, 500, 86_400_000)
        renew_default = max(lease_ms // 3, 100)
        renew_interval_ms = _int(
            topts, "renew_interval_ms", renew_default, 100, max(lease_ms // 2 - 1, 100)
        )
        claim_batch = _int(topts, "claim_batch", cls.claim_batch, 1, 1000)
        prefix = topts.get("key_prefix", cls.key_prefix)
        if not isinstance(prefix, str) or not prefix or "{" in prefix or "}" in prefix:
            raise InvalidOptionError("key_prefix", prefix, "a non-empty string without '{' or '}'")
        global_prefix = topts.get("global_keyprefix") or ""
        return cls(
            lease_ms=lease_ms,
            renew_interval_ms=renew_interval_ms,
            claim_batch=claim_batch,
            key_prefix=f"{global_prefix}{prefix}",
        )
