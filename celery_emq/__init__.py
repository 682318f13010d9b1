"""celery_emq: a Celery/Kombu transport on Redis with leases and counted stall recovery.

Importing this package registers the ``emq://`` and ``emqs://`` (TLS) broker URL
schemes with kombu, and asks to hear when a Celery worker initialises or a
transport starts (to install the worker's hooks there, and to teach a loaded
Flower the schemes); nothing else happens at import time.
"""

from __future__ import annotations

import warnings
from typing import Any

from kombu.transport import TRANSPORT_ALIASES

from celery_emq.errors import (
    BatchFlushError,
    BatchMessage,
    BrokerFullError,
    EmqError,
    InvalidOptionError,
    InvalidQueueNameError,
    ReplicasUnconfirmedError,
    ScriptContractError,
    StalledJobError,
    UnknownJobError,
)
from celery_emq.options import EmqOptions

__all__ = [
    "BatchFlushError",
    "BatchMessage",
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


def __getattr__(name: str) -> Any:
    # The morgue is read on demand: importing the package stays light.
    if name in ("DeadJob", "Morgue"):
        from celery_emq.ops import morgue

        return getattr(morgue, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def schedule_sweep(app: Any, every_s: float = 30.0, queues: Any = None) -> dict[str, Any]:
    """Schedule the ``celery_emq.sweep`` task with beat; see :mod:`celery_emq.tasks`."""
    from celery_emq.ops.tasks import schedule_sweep as schedule

    return schedule(app, every_s, queues)


__version__ = "0.2.0"

_TRANSPORT = "celery_emq.transport:Transport"

# The URL schemes, registered with kombu. A URL listing alternates
# ("emq+sentinel://a;emq+sentinel://b") makes kombu read the next one whole
# after a connection error: its scheme is then the transport's name, so each
# form is an alias too.
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

# What runs in a Celery worker is told of the worker (and its hooks installed
# there, only there), and Flower of the schemes, as a transport starts.
from celery_emq.ops.flower import register_if_loaded as _register_with_flower  # noqa: E402
from celery_emq.transport.process import on_transport_start as _on_transport_start  # noqa: E402
from celery_emq.worker.follow_up import register as _register_follow_up  # noqa: E402
from celery_emq.worker.state import attach as _attach_worker  # noqa: E402

_attach_worker()
_register_follow_up()
_on_transport_start(_register_with_flower)
_register_with_flower()
