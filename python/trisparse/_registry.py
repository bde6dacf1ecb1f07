"""Objects the torch ops refer to by id: torch.library ops take tensors and scalars, not objects,
so a Pattern or BlockMask registers itself under a never-reused integer and the op looks it up."""

from __future__ import annotations

import atexit
import itertools
import weakref
from typing import Any

_registries: list[Registry] = []


@atexit.register
def _release_plans() -> None:
    """Frees the C++ plans of every live object before the interpreter tears the extension down:
    a model kept until exit (a layer's pattern cache, a module-level Pattern) would otherwise
    make nanobind report its plans as leaked. Each registered class names its plan caches in
    ``PLAN_CACHES`` (dicts, cleared here)."""
    for registry in _registries:
        for obj in list(registry._live.values()):
            for name in getattr(obj, "PLAN_CACHES", ()):
                getattr(obj, name).clear()


class Registry:
    def __init__(self, argument: str, kind: str):
        self._argument, self._kind = argument, kind
        self._ids = itertools.count(1)
        self._live: weakref.WeakValueDictionary[int, Any] = weakref.WeakValueDictionary()
        _registries.append(self)

    def add(self, obj: Any) -> int:
        """Registers `obj` (held weakly) and returns its id."""
        key = next(self._ids)
        self._live[key] = obj
        return key

    def get(self, key: int) -> Any:
        """The live object with this id, or None (also for a symbolic id, under torch.compile)."""
        return self._live.get(key) if isinstance(key, int) else None

    def lookup(self, key: int) -> Any:
        """The live object with this id. @raises ValueError if it was freed."""
        obj = self._live.get(key)
        if obj is None:
            raise ValueError(
                f"{self._argument}: no live {self._kind} has id {key} (it was freed); keep it "
                "alive while ops that use it may run, backward included"
            )
        return obj
