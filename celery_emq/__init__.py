"""celery_emq: a Celery/Kombu transport on Redis with leases and counted stall recovery.

Importing this package registers the ``emq://`` and ``emqs://`` (TLS) broker URL
schemes with kombu; nothing else happens at import time.
"""

from __future__ import annotations

import warnings
from typing import Any

from kombu.transport import TRANSPORT_ALIASES

from .errors import (
    BatchFlushError,
    BrokerFullError,
    EmqError,
    InvalidOptionError,
    InvalidQueueNameError,
    ReplicasUnconfirmedError,
    ScriptContractError,
    StalledJobError,
    UnknownJobError,
)
from .morgue import DeadJob, Morgue
from .options import EmqOptions

__all__ = [
    "BatchFlushError",
    "BrokerFullError",
    "DeadJob",
    "EmqError",
    "EmqOptions",
    "InvalidOptionError",
    "InvalidQueueNameError",
    "Morgue",
    "ReplicasUnconfirmedError",
    "ScriptContractError",
    "StalledJobError",
    "UnknownJobError",
    "schedule_sweep",
]


def schedule_sweep(app: Any, every_s: float = 30.0, queues: Any = None) -> dict[str, Any]:
    """Schedule the ``celery_emq.sweep`` task with beat; see :mod:`celery_emq.tasks`."""
    from .tasks import schedule_sweep as schedule

    return schedule(app, every_s, queues)


__version__ = "0.2.0"

_TRANSPORT = "celery_emq.transport:Transport"

# Registering the URL schemes is the one thing importing this package does:
# with kombu always, and with Flower's broker client when Flower is loaded.
# A URL listing alternates ("emq+sentinel://a;emq+sentinel://b") makes kombu
# read the next one whole after a connection error: its scheme is then the
# transport's name, so each form is an alias too.
for _scheme in (
    "emq",
    "emqs",
    *(f"{base}+{kind}" for base in ("emq", "emqs") for kind in ("sentinel", "cluster")),
):
    _existing = TRANSPORT_ALIASES.setdefault(_scheme, _TRANSPORT)
    if _existing != _TRANSPORT:
        warnings.warn(
            f"kombu transport alias {_scheme!r} already names {_existing!r}; "
            f"celery_emq left it as it is (use broker_transport={_TRANSPORT!r})",
            stacklevel=2,
        )

from .flower import register_if_loaded as _register_with_flower  # noqa: E402

_register_with_flower()
