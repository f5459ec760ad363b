"""Names a package loads from their modules on first use (PEP 562), so importing the package imports none of them.

The top-level package and :mod:`clusterlm.data` use it: ``import clusterlm`` and a process that only checks files or
reads a plan (the launcher of ``clusterlm train --nproc N``) import neither torch nor transformers for them.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Mapping
from typing import Any

__all__ = ["lazy_exports"]


def lazy_exports(package: str, exports: Mapping[str, str]) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """The module-level ``__getattr__`` and ``__dir__`` of ``package`` for ``exports`` (public name -> the module
    that defines it); a name is imported once, then found in the package's namespace like any other.

    Raises (from ``__getattr__``):
        AttributeError: a name that is neither in the namespace nor in ``exports``.
    """
    namespace = sys.modules[package].__dict__

    def __getattr__(name: str) -> Any:
        if name in exports:
            value = getattr(importlib.import_module(exports[name]), name)
            namespace[name] = value  # later lookups skip this function
            return value
        raise AttributeError(f"module {package!r} has no attribute {name!r}")

    def __dir__() -> list[str]:
        return sorted(set(namespace) | set(exports))

    return __getattr__, __dir__
