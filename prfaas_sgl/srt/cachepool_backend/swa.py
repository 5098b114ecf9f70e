"""Window pages of a sliding-window (SWA) hybrid under prfaas_hybrid (docs/cachepool-swa.md).

SGLang's `SWATokenToKVPoolAllocator` gives every full-attention slot an SWA peer
(`full_to_swa_index_mapping[full] = swa`, 0 = none); a row of `req_to_token` names full slots only,
and SWA layers read their peers. So a cached block's window pages are the peers of its full slots,
and the mirror's rule is

    hash in the SWA index  <=>  its full-attention entry's slots all have live peers the tree owns

which makes the SWA index a subset of the full one (a full entry's removal takes its SWA entry
along) and tells the mirror which allocator call gives a removed block back: both sides, the full
side only, or the window side only.
"""
from __future__ import annotations

from typing import Any

import torch

SWA = "swa"  # group name in the pool config


class SwaMemory:
    """The four calls the backend makes on SGLang's SWA allocator (page size 1)."""

    def __init__(self, allocator: Any) -> None:
        self.allocator = allocator

    def alive(self, slots: torch.Tensor) -> torch.Tensor:
        """Per full slot: does it still have an SWA peer (bool, same shape)."""
        return self.allocator.full_to_swa_index_mapping[slots.to(torch.int64)] > 0

    def free_both(self, slots: torch.Tensor) -> None:
        if slots.numel():
            self.allocator.free(slots)

    def free_full(self, slots: torch.Tensor) -> None:
        """Full side of slots whose peers are already gone."""
        if slots.numel():
            self.allocator.free_full(slots)

    def free_window(self, slots: torch.Tensor) -> None:
        """SWA peers only (mapping cleared); the full slots stay."""
        if slots.numel():
            self.allocator.free_swa(slots)
