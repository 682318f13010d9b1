"""The store: the EchoMQ model on Redis, and nothing else.

Key names (:mod:`.keys`), how a message is stored (:mod:`.codec`), the Lua
scripts and their loader (:mod:`.scripts`, ``lua/``), the job store
(:mod:`.jobstore`), status reads (:mod:`.status`), connecting to one Redis,
Sentinel or Cluster (:mod:`.topology`, :mod:`.retries`, :mod:`.discovery`) and
the per-node lanes (:mod:`.nodes`). It imports neither celery nor kombu, and it
is the only place Lua is loaded or run.
"""

from __future__ import annotations

from celery_emq.store.jobstore import JobStore

__all__ = ["JobStore"]
