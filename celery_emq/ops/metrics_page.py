"""The emq metrics inside Flower, behind Flower's authentication: ``GET /emq/metrics``.

Flower serves its own ``/metrics`` to anyone. When Flower has authentication
(``--basic-auth`` or ``--auth``), the emq series are served only here, where
Flower lets in the users it lets into ``/emq``; without authentication they are
served here and on ``/metrics`` alike (see :func:`celery_emq.ops.flower.attach`).
"""

from __future__ import annotations

import tornado.web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from celery_emq.ops.morgue_page import EmqHandler

__all__ = ["MetricsPage"]


class MetricsPage(EmqHandler):
    """``GET /emq/metrics``: the emq series in Prometheus's text format."""

    @tornado.web.authenticated
    async def get(self) -> None:
        registry = self.application.emq_metrics
        text = await self.blocking(generate_latest, registry)
        self.set_header("Content-Type", CONTENT_TYPE_LATEST)
        self.write(text)
