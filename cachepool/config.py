"""Pool layout: one frozen config, validated at start-up with messages that say what to change.

A *block* is the pool's unit of memory: `block_bytes` bytes, equal for every group. For an attention
group one block holds `block_size` tokens of K and V for all of that group's layers; a linear-attention
state (all of its group's layers) is split over `state_blocks` whole blocks, the last one padded.
"""
from __future__ import annotations

from dataclasses import dataclass, field

# config -> managers -> specs, one way: the managers validate their own groups' layout, and read the
# config through specs.PoolShape rather than importing this module.
from .managers import manager_class
from .specs import GroupSpec, PoolLayoutError


@dataclass(frozen=True, slots=True)
class PoolConfig:
    """num_blocks: blocks in the shared pool. block_size: tokens per attention block.
    enable_events: record BlockStored/BlockRemoved events for a router's prefix index.
    event_token_ids: BlockStored carries its blocks' token ids (a router rehashes them); off for a
        reader of hashes only.
    hash_seed: parent hash of the first block (namespaces the chain, e.g. per model)."""

    num_blocks: int
    block_size: int
    groups: tuple[GroupSpec, ...]
    enable_events: bool = False
    event_token_ids: bool = True
    hash_seed: int = 0
    block_bytes: int = field(init=False, default=0)

    def __post_init__(self) -> None:
        if self.num_blocks < 1 or self.block_size < 1:
            raise PoolLayoutError(
                f"num_blocks={self.num_blocks}, block_size={self.block_size}: both must be >= 1")
        if not self.groups:
            raise PoolLayoutError("no layer groups: pass at least one GroupSpec")
        names = [g.name for g in self.groups]
        if len(set(names)) != len(names):
            raise PoolLayoutError(f"group names {names} repeat; give each group a unique name")
        pages = {g.name: manager_class(g.kind).page_bytes(g, self.block_size) for g in self.groups}
        block_bytes = max(pages.values())
        if block_bytes <= 0:
            raise PoolLayoutError(
                "no attention group sets kv_bytes_per_token > 0, so the block size in bytes is "
                "undefined; add a full or swa group with kv_bytes_per_token")
        _check_pages_divide(pages, block_bytes)
        object.__setattr__(self, "block_bytes", block_bytes)
        for g in self.groups:
            manager_class(g.kind).validate(g, self)


def _check_pages_divide(pages: dict[str, int], block_bytes: int) -> None:
    """Attention pages must tile a block exactly; a page that does not divide cannot be aligned."""
    bad = {n: p for n, p in pages.items() if p > 0 and block_bytes % p}
    if bad:
        raise PoolLayoutError(
            f"attention page sizes {bad} (bytes = block_size x kv_bytes_per_token x num_layers) do "
            f"not divide the largest page, {block_bytes} bytes; change block_size or the layer "
            f"grouping so every attention page size divides {block_bytes}")
