"""SGLang's K/V buffer order -> layer groups (layer-group streaming, `transfer/gates.py`).

KVArgs lists one K/V buffer per layer and kind, in the pool's order, and `kv_layer_ids` (SGLang's
`build_kv_layer_ids`) gives each buffer's global layer id for the pools that report one (hybrid linear
pools: only the full-attention layers); for the others it is empty and the order is positional:

    MHA (MHATokenToKVPool):   [k 0 .. k L-1 | v 0 .. v L-1]        layer of buffer i = i mod L, L = n / 2
    MLA (MLATokenToKVPool):   [kv 0 .. kv L-1]                     layer of buffer i = i
    hybrid (kv_layer_ids):    [k 3, k 7, k 11 | v 3, v 7, v 11]    full-attention layers 3, 7, 11 of a GDN model

A layer group is `layers_per_group` consecutive layers (by id) among those with K/V buffers; its buffers
are every buffer of those layers (K and V), so group g is complete once its last layer's attention ran:

    layers 3 7 11 15 19, 2 per group:  g0 = {3, 7} (after layer 7)   g1 = {11, 15}   g2 = {19}
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class LayerGroup:
    """Group `index`: layer ids `layers` (ascending) and the layout buffer ids of their K/V buffers."""

    index: int
    layers: tuple[int, ...]
    buffer_ids: tuple[int, ...]

    @property
    def last_layer(self) -> int:
        """The layer whose attention completes the group (the forward hook opens its gate after it)."""
        return self.layers[-1]


def kv_buffer_layers(kv_layer_ids: Sequence[int] | None, n_kv: int, is_mla: bool) -> tuple[int, ...]:
    """Layer id of each of the `n_kv` K/V buffers, in KVArgs order."""
    ids = list(kv_layer_ids or ())
    if ids:
        if len(ids) != n_kv:
            raise ValueError(f"kv_layer_ids names {len(ids)} layers for {n_kv} K/V buffers")
        return tuple(int(i) for i in ids)
    per_layer = 1 if is_mla else 2
    if n_kv % per_layer:
        raise ValueError(f"{n_kv} K/V buffers are not K and V of whole layers (MHA pools register both)")
    layers = n_kv // per_layer
    return tuple(i % layers for i in range(n_kv))


def layer_groups(kv_ids: Sequence[int], buffer_layers: Sequence[int], layers_per_group: int) -> tuple[LayerGroup, ...]:
    """Groups of `layers_per_group` consecutive layers; `kv_ids[k]` is the layout id of K/V buffer k,
    whose layer is `buffer_layers[k]`. Every K/V buffer is in exactly one group."""
    if layers_per_group < 1:
        raise ValueError(f"layers_per_group must be >= 1, got {layers_per_group}")
    if len(kv_ids) != len(buffer_layers):
        raise ValueError(f"{len(kv_ids)} K/V buffer ids but {len(buffer_layers)} layer ids")
    layers = sorted(set(buffer_layers))
    groups = []
    for g, start in enumerate(range(0, len(layers), layers_per_group)):
        mine = layers[start: start + layers_per_group]
        members = set(mine)
        ids = tuple(b for b, layer in zip(kv_ids, buffer_layers) if layer in members)
        groups.append(LayerGroup(g, tuple(mine), ids))
    return tuple(groups)


def group_after(groups: Sequence[LayerGroup]) -> dict[int, int]:
    """Layer id -> index of the group that layer completes (the hook's lookup, one entry per group)."""
    return {g.last_layer: g.index for g in groups}
