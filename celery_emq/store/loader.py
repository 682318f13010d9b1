"""Loads ``lua/*.lua`` once per client and runs a script by name.

A script is sent as ``EVALSHA``; one the server lost (a restart, a failover,
``SCRIPT FLUSH``) is loaded and run again.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from importlib import resources
from typing import Any

from redis.exceptions import ConnectionError, NoScriptError, RedisClusterException

__all__ = ["SCRIPT_NAMES", "Loaded", "script_source"]

SCRIPT_NAMES: tuple[str, ...] = (
    "enqueue",
    "enqueue_many",
    "claim",
    "start",
    "ack",
    "release",
    "extend",
    "bury",
    "purge",
    "reap",
    "sweep",
    "retry",
    "purge_dead",
    "retire",
    "give_back",
    "budget",
    "promote",
    "tally",
    "oldest",
    "look",
)


#: A line ``--@include <name>`` in a script is replaced by ``lua/lib/<name>.lua``:
#: a fragment several scripts share (a local function) is written once.
INCLUDE = re.compile(r"^--@include (\w+)$", re.M)


def _lua(path: str) -> str:
    return (
        resources.files(__package__ or "celery_emq.store").joinpath("lua").joinpath(path)
    ).read_text("utf-8")


def script_source(name: str) -> str:
    """Return the Lua source of one script shipped in ``celery_emq/store/lua``,
    its ``--@include`` lines replaced by the fragments they name."""
    return INCLUDE.sub(lambda m: _lua(f"lib/{m[1]}.lua").rstrip("\n"), _lua(f"{name}.lua"))


class Loaded:
    """Every script of :data:`SCRIPT_NAMES`, registered on one redis-py client.

    Args:
        client: a redis-py client (or ``RedisCluster``).
    """

    def __init__(self, client: Any) -> None:
        self.client = client
        #: name -> redis-py ``Script`` (its ``sha`` and its text).
        self.registered = {
            name: client.register_script(script_source(name)) for name in SCRIPT_NAMES
        }

    def run(self, name: str, keys: Sequence[str], args: Sequence[Any]) -> Any:
        """Run one script; return its reply.

        Raises:
            redis.ConnectionError: also when no node of a cluster answers.
        """
        script = self.registered[name]
        try:
            # The common case in one call: the script is already loaded.
            return self.client.evalsha(script.sha, len(keys), *keys, *args)
        except RedisClusterException as exc:
            # No node of a cluster answers (or none serves the slot): not a
            # RedisError, but the same as a connection that failed.
            raise ConnectionError(f"Redis Cluster: {exc}") from exc
        except NoScriptError:
            # Loads it (after a restart or SCRIPT FLUSH) and runs it again.
            return script(keys=list(keys), args=list(args), client=self.client)
