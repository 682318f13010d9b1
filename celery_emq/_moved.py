"""The modules that moved into the layers' subpackages, still importable by their old paths.

Importing one by its old path (``celery_emq.status``) warns
(``DeprecationWarning``) and gives the module at its new path
(``celery_emq.store.status``): the same module object, so what is patched or
read through either name is the same.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
import warnings
from collections.abc import Sequence
from types import ModuleType

__all__ = ["MOVED", "install"]

#: Old module path -> new module path.
MOVED = {
    "celery_emq.batch": "celery_emq.transport.batch",
    "celery_emq.cli": "celery_emq.ops.cli",
    "celery_emq.cluster": "celery_emq.transport.cluster",
    "celery_emq.codec": "celery_emq.store.codec",
    "celery_emq.discovery": "celery_emq.store.discovery",
    "celery_emq.flower": "celery_emq.ops.flower",
    "celery_emq.jobs": "celery_emq.transport.jobs",
    "celery_emq.keys": "celery_emq.store.keys",
    "celery_emq.lease": "celery_emq.transport.lease",
    "celery_emq.metrics": "celery_emq.ops.metrics",
    "celery_emq.metrics_page": "celery_emq.ops.metrics_page",
    "celery_emq.migrate": "celery_emq.ops.migrate",
    "celery_emq.morgue": "celery_emq.ops.morgue",
    "celery_emq.morgue_page": "celery_emq.ops.morgue_page",
    "celery_emq.nodes": "celery_emq.store.nodes",
    "celery_emq.retries": "celery_emq.store.retries",
    "celery_emq.scripts": "celery_emq.store.scripts",
    "celery_emq.sentinel": "celery_emq.transport.sentinel",
    "celery_emq.server": "celery_emq.store.server",
    "celery_emq.settle": "celery_emq.transport.settle",
    "celery_emq.status": "celery_emq.store.status",
    "celery_emq.sweeper": "celery_emq.transport.sweeper",
    "celery_emq.testing_docker": "celery_emq.testing.docker",
    "celery_emq.topology": "celery_emq.store.topology",
    "celery_emq.worker_state": "celery_emq.worker.state",
}


class _Alias(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname not in MOVED:
            return None
        return importlib.machinery.ModuleSpec(fullname, self)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        new = MOVED[spec.name]
        warnings.warn(
            f"{spec.name} is deprecated: import {new} instead", DeprecationWarning, stacklevel=2
        )
        return importlib.import_module(new)

    def exec_module(self, module: ModuleType) -> None:
        """The module is the one at its new path, already run."""


def install() -> None:
    """Let the old paths be imported (once per process)."""
    if not any(isinstance(finder, _Alias) for finder in sys.meta_path):
        sys.meta_path.append(_Alias())
