"""How a hook's shape is checked on the running libraries, without calling it.

Each check is built from a path (``module:Owner.attribute``) and returns what
is wrong with it, or ``""``: absent, not callable, other parameters, or code
that no longer names an attribute (read from the compiled code, so a release
installed without its sources is checked too). The paths themselves, every
one of Celery's internals, are listed in :mod:`celery_emq.worker.hooks`.
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable
from types import CodeType
from typing import Any

__all__ = ["Check", "all_of", "attribute", "find", "mentions", "method"]

#: Returns what is wrong with a hook on the running libraries, or ``""``.
Check = Callable[[], str]

_ABSENT = object()


def find(path: str) -> Any:
    """Import ``module:Attr.attr`` (the part after the colon may be empty)."""
    module, _, attrs = path.partition(":")
    found: Any = importlib.import_module(module)
    for name in filter(None, attrs.split(".")):
        found = getattr(found, name)
    return found


def _code_mentions(code: CodeType, name: str) -> bool:
    """Whether compiled code names ``name`` (an attribute, a variable, a keyword argument)."""
    if name in code.co_names or name in code.co_varnames:
        return True
    for const in code.co_consts:
        if const == name or (isinstance(const, tuple) and name in const):
            return True
        if isinstance(const, CodeType) and _code_mentions(const, name):
            return True
    return False


def method(path: str, name: str, *params: str) -> Check:
    """A check: ``path.name`` is callable and its parameters start with ``params``."""

    def check() -> str:
        found = find(path)
        method = found.get(name) if isinstance(found, dict) else getattr(found, name, None)
        if method is None:
            return "absent"
        if not callable(method):
            return f"not callable: {type(method).__name__}"
        if params:
            # inspect.signature follows __wrapped__: a hook already installed
            # shows the signature of what it wraps.
            got = list(inspect.signature(method).parameters)
            if got[: len(params)] != list(params):
                return f"takes ({', '.join(got)}), not ({', '.join(params)}, ...)"
        return ""

    return check


def attribute(path: str, name: str, kind: str = "") -> Check:
    """A check: ``path`` has ``name`` (with the method ``kind`` if given)."""

    def check() -> str:
        found = getattr(find(path), name, _ABSENT)
        if found is _ABSENT:
            return "absent"
        if kind and not callable(getattr(found, kind, None)):
            return f"{type(found).__name__} has no {kind}()"
        return ""

    return check


def mentions(path: str, *names: str) -> Check:
    """A check: the code of ``path`` (a function, or a class's ``__init__``) names ``names``."""

    def check() -> str:
        found = find(path)
        function = inspect.unwrap(vars(found)["__init__"] if isinstance(found, type) else found)
        code = getattr(function, "__code__", None)
        if code is None:
            return "no code to read"
        missing = [name for name in names if not _code_mentions(code, name)]
        return f"no longer uses {', '.join(missing)}" if missing else ""

    return check


def all_of(*checks: Check) -> Check:
    """A check: every one of ``checks``, in order; the first thing wrong is the answer."""

    def check() -> str:
        for each in checks:
            try:
                problem = each()
            except Exception as exc:
                problem = f"{type(exc).__name__}: {exc}"
            if problem:
                return problem
        return ""

    return check
