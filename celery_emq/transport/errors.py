"""The errors the transport raises through kombu: celery_emq's, and kombu's too.

Each is a subclass of its :mod:`celery_emq.errors` namesake and of kombu's
error for the case, so ``except celery_emq.BrokerFullError`` and ``except
kombu.exceptions.OperationalError`` both catch it. The store, which knows no
kombu, raises the plain ones; the transport raises these.
"""

from __future__ import annotations

from kombu import exceptions as kombu_exceptions
from kombu.exceptions import KombuError, OperationalError

from celery_emq import errors

__all__ = ["BatchFlushError", "BatchPublishError", "BrokerFullError", "ReplicasUnconfirmedError"]

#: kombu's error for a publish batch whose flush failed (kombu 5.7+); on older
#: kombu, whose producers have no batches, its base.
BatchPublishError: type[KombuError] = getattr(kombu_exceptions, "BatchPublishError", KombuError)


class BrokerFullError(errors.BrokerFullError, OperationalError):
    """:class:`celery_emq.errors.BrokerFullError`, and a kombu ``OperationalError``."""


class ReplicasUnconfirmedError(errors.ReplicasUnconfirmedError, OperationalError):
    """:class:`celery_emq.errors.ReplicasUnconfirmedError`, and a kombu ``OperationalError``."""

    @classmethod
    def of(cls, exc: errors.ReplicasUnconfirmedError) -> ReplicasUnconfirmedError:
        """The same error, as the transport raises it."""
        return cls(exc.queue, exc.job_id, exc.confirmed, exc.wanted, exc.timeout_ms)


class BatchFlushError(errors.BatchFlushError, BatchPublishError):  # type: ignore[misc,valid-type]
    """:class:`celery_emq.errors.BatchFlushError`, and kombu's ``BatchPublishError``."""
