"""Objects the torch ops refer to by id: torch.library ops take tensors and scalars, not objects,
so a Pattern or BlockMask registers itself under a never-reused integer and the op looks it up."""

from __future__ import annotations

import itertools
import weakref
from typing import Any


class Registry:
    def __init__(self, argument: str, kind: str):
        self._argument, self._kind = argument, kind
        self._ids = itertools.count(1)
        self._live: weakref.WeakValueDictionary[int, Any] = weakref.WeakValueDictionary()

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
