"""The store: the EchoMQ model on Redis, and nothing else.

Key names (:mod:`.keys`), how a message is stored (:mod:`.codec`), the Lua
scripts (``lua/``) with their loader (:mod:`.loader`), their calls and replies
(:mod:`.calls`, :mod:`.outcomes`), one typed method per script
(:mod:`.scripts`) and calls sent together (:mod:`.batch`); the job store
(:mod:`.jobstore`: transitions, with its reads in :mod:`.reads` and its queue
registries in :mod:`.registry`), status reads (:mod:`.status`), Flower's
tally on an asyncio client (:mod:`.tally_async`), migration's take-in
(:mod:`.take_in`); reading a broker URL (:mod:`.topology`) and connecting to
one Redis, Sentinel or Cluster (:mod:`.connect`, :mod:`.retries`,
:mod:`.discovery`), and the per-node lanes (:mod:`.nodes`). It imports neither
celery nor kombu, and it is the only place Lua is loaded or run.
"""

from __future__ import annotations

from celery_emq.store.jobstore import JobStore

__all__ = ["JobStore"]
