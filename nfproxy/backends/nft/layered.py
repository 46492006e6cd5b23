"""A read-only mapping as a base plus a small layer of changes: how a partial sync's ruleset
shares the previous ruleset's big maps instead of copying them.

A partial sync must leave the previous ruleset intact (a refused transaction keeps believing it),
so the maps it changes were copied: at 10 000 services x 10 endpoints the hairpin reference
counts alone are 100 000 entries, a copy of which cost more than the rest of the sync. A
`Layered` map shares its base with the map it evolved from and holds only what changed since;
once the layer grows past a fraction of the base it is folded into a new base, so a chain of
partial syncs costs each one O(change) amortised, and a lookup at most two dict probes.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Generic, TypeVar

K = TypeVar("K")
V = TypeVar("V")

_GONE: object = object()  # in a layer: the key is deleted from the base


class Layered(Mapping[K, V], Generic[K, V]):
    """`base` with `layer` on top (values, or _GONE for a deleted key). Immutable."""

    __slots__ = ("_base", "_layer", "_len")

    def __init__(self, base: Mapping[K, V], layer: Mapping[K, object] | None = None, length: int | None = None) -> None:
        self._base = base
        self._layer: Mapping[K, object] = layer or {}
        self._len = len(base) if length is None else length

    def __getitem__(self, key: K) -> V:
        v = self._layer.get(key, self)
        if v is self:
            return self._base[key]
        if v is _GONE:
            raise KeyError(key)
        return v  # type: ignore[return-value]

    def __contains__(self, key: object) -> bool:
        v = self._layer.get(key, self)  # type: ignore[call-overload]
        return key in self._base if v is self else v is not _GONE

    def __iter__(self) -> Iterator[K]:
        layer = self._layer
        if not layer:
            yield from self._base
            return
        for key in self._base:
            if layer.get(key, self) is not _GONE:
                yield key
        for key, v in layer.items():
            if v is not _GONE and key not in self._base:
                yield key

    def __len__(self) -> int:
        return self._len

    def evolve(self, changes: Mapping[K, object]) -> Layered[K, V]:
        """A new map: this one with `changes` (a value, or `GONE` to delete) applied. Costs the
        changes and the layer, not the base; folds the layer into a new base when it has grown
        past an eighth of the base (a copy, amortised over the syncs that grew it)."""
        length = self._len
        for key, v in changes.items():
            had, has = key in self, v is not _GONE
            length += has - had
        layer = {**self._layer, **changes}
        if len(layer) <= max(64, len(self._base) // 8):
            return Layered(self._base, layer, length)
        base = dict(self._base)
        for key, v in layer.items():
            if v is _GONE:
                base.pop(key, None)
            else:
                base[key] = v  # type: ignore[assignment]
        return Layered(base, None, length)


GONE = _GONE


def layered(m: Mapping[K, V]) -> Layered[K, V]:
    """`m` as a Layered map (itself when it already is one)."""
    return m if isinstance(m, Layered) else Layered(m)


class Counts(Generic[K]):
    """Reference counts being changed over a Layered map during one partial sync."""

    __slots__ = ("base", "changes")

    def __init__(self, base: Mapping[K, int]) -> None:
        self.base = layered(base)
        self.changes: dict[K, int] = {}

    def add(self, key: K, delta: int) -> None:
        now = self.changes.get(key)
        if now is None:
            now = self.base.get(key, 0)
        self.changes[key] = now + delta

    def result(self) -> Layered[K, int]:
        return self.base.evolve({k: (n if n else GONE) for k, n in self.changes.items()})
