"""Deprecated import paths: a module that moved keeps answering at its old name, with a warning."""

from __future__ import annotations

import warnings
from collections.abc import Callable
from types import ModuleType
from typing import Any

__all__ = ["moved"]


def moved(old: str, *targets: ModuleType) -> Callable[[str], Any]:
    """A module ``__getattr__`` for ``old``: each name is found in ``targets``, with a
    ``DeprecationWarning`` that names where to import it from now."""

    def __getattr__(name: str) -> Any:
        for target in targets:
            if hasattr(target, name):
                warnings.warn(
                    f"{old} is deprecated; import {name} from {target.__name__}.",
                    DeprecationWarning,
                    stacklevel=2,
                )
                return getattr(target, name)
        raise AttributeError(f"module {old!r} has no attribute {name!r}")

    return __getattr__
