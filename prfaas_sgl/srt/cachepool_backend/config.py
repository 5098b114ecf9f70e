"""The backend's one frozen config (built once per scheduler process from SGLang's server args)."""
from __future__ import annotations

import os
from dataclasses import dataclass

BLOCK = 16  # tokens per index block unless a kind asks otherwise
CHECK_ENV = "PRFAAS_CACHEPOOL_CHECK"  # "1": check_integrity() after every release (debug, O(pool))


@dataclass(frozen=True, slots=True)
class BackendConfig:
    """block_size: tokens per index block (hash granularity; a hit is a multiple of it).
    checkpoint_interval: tokens between linear-attention (GDN / KDA / Lightning) state checkpoints. SGLang's `no_buffer` Mamba
        strategy holds a request's state only at the end of each prefill chunk, so this is the
        chunked-prefill size: chunk ends land exactly on the checkpoint grid.
    num_blocks: size of the index's (virtual) block pool; must exceed what SGLang can hold.
    check_integrity: run HybridCachePool.check_integrity() + the mirror checks after each release.
    role: SGLang's --disaggregation-mode ("null" colocated, "prefill", "decode"). On a prefill server
        every request's KV leaves for a decode server: its uncached tail is transfer-cache, held
        until the transfer completes (SGLang releases the request then).
    swa_window: tokens a sliding-window layer reads, the current one included (SGLang's
        sliding_window_size + 1: its mask keeps k >= q - sliding_window_size); 0 for a model
        without sliding-window layers."""

    block_size: int
    checkpoint_interval: int
    num_blocks: int
    check_integrity: bool = False
    role: str = "null"
    swa_window: int = 0

    def __post_init__(self) -> None:
        if self.block_size < 1:
            raise ValueError(f"prfaas_hybrid: block_size={self.block_size}; use >= 1")
        c = self.checkpoint_interval
        if c <= 0 or c % self.block_size:
            raise ValueError(
                f"prfaas_hybrid: --chunked-prefill-size {c} must be a positive multiple of "
                f"{self.block_size} tokens (state checkpoints are taken at chunk ends); "
                f"pass e.g. --chunked-prefill-size {8 * self.block_size}")


def from_server(chunked_prefill_size: int | None, kv_tokens: int, mamba_slots: int,
                block_size: int = BLOCK, role: str = "null", swa_window: int = 0) -> BackendConfig:
    """kv_tokens / mamba_slots: SGLang's pool sizes (for a sliding-window model, its full and SWA
    slots together). The virtual pool gets twice the blocks they could ever fill, plus room for
    per-request working states, so it never evicts on its own."""
    num_blocks = 2 * (kv_tokens // block_size + mamba_slots) + 4096
    # no state checkpoints on decode (KV only) or for a sliding-window model (no linear layers):
    # the grid is unused there, any chunk size is fine
    interval = block_size if role == "decode" or swa_window else chunked_prefill_size or 0
    return BackendConfig(block_size, interval, num_blocks,
                         os.environ.get(CHECK_ENV) == "1", role, swa_window)
