"""Registry: GroupSpec.kind -> manager class. Add a layer type by adding a class here."""
from __future__ import annotations

from types import MappingProxyType

from .attention import FullAttentionManager, SlidingWindowManager
from .linear import LinearStateManager
from .manager_base import GroupManager

REGISTRY = MappingProxyType({
    cls.kind: cls for cls in (FullAttentionManager, SlidingWindowManager, LinearStateManager)
})


def manager_class(kind: str) -> type[GroupManager]:
    try:
        return REGISTRY[kind]
    except KeyError:
        raise ValueError(f"unknown layer group kind {kind!r}; use one of {sorted(REGISTRY)}") from None
