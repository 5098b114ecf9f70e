"""BlockStorage: owns the pool's tensor and applies index lists from the bookkeeping.

One byte buffer [num_blocks, block_bytes] (uint8) shared by all groups, the layout of SGLang's
unified memory pool. An attention group sees its block as [num_layers, block_size, kv_bytes_per_token]
(its page may be smaller than a block: the rest is padding). A linear state of S blocks is the state's
bytes cut into S slices of block_bytes, the last one padded. Callers reinterpret bytes with
`.view(dtype)`. torch is imported here only, and only when a BlockStorage is built.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

from .allocation import StateAllocation
from .config import PoolConfig
from .managers import manager_class
from .specs import GroupSpec

if TYPE_CHECKING:
    import torch


class BlockStorage:
    def __init__(self, cfg: PoolConfig, device: str = "cpu") -> None:
        import torch

        self.cfg = cfg
        self.buffer = torch.zeros(cfg.num_blocks, cfg.block_bytes, dtype=torch.uint8, device=device)
        self._specs = {g.name: g for g in cfg.groups}
        self._torch = torch

    # -- attention pages -----------------------------------------------------------------------
    def page_view(self, group: str) -> "torch.Tensor":
        """[num_blocks, num_layers, block_size, kv_bytes_per_token] uint8 view of a group's pages."""
        g = self._specs[group]
        page = manager_class(g.kind).page_bytes(g, self.cfg.block_size)
        return self.buffer[:, :page].view(self.cfg.num_blocks, g.num_layers, self.cfg.block_size,
                                          g.kv_bytes_per_token)

    def write_tokens(self, group: str, block_table: Sequence[int], start: int, kv: "torch.Tensor") -> None:
        """Write kv [num_layers, T, kv_bytes_per_token] as tokens [start, start+T).

        token t lives in block_table[t // bs] at slot t % bs:
            tokens  [start ........................ start+T)
            slots   block_table[start//bs][start%bs] ... block_table[(start+T-1)//bs][(start+T-1)%bs]
        """
        t = self._torch
        bs = self.cfg.block_size
        pos = t.arange(start, start + kv.shape[1], device=self.buffer.device)
        blocks = t.as_tensor(list(block_table), dtype=t.int64, device=self.buffer.device)[pos // bs]
        self.page_view(group)[blocks, :, pos % bs] = kv.transpose(0, 1)

    def read_tokens(self, group: str, block_table: Sequence[int], start: int, end: int) -> "torch.Tensor":
        """Tokens [start, end) as [num_layers, end-start, kv_bytes_per_token]."""
        t = self._torch
        bs = self.cfg.block_size
        pos = t.arange(start, end, device=self.buffer.device)
        blocks = t.as_tensor(list(block_table), dtype=t.int64, device=self.buffer.device)[pos // bs]
        return self.page_view(group)[blocks, :, pos % bs].transpose(0, 1)

    def gather_blocks(self, block_ids: Sequence[int]) -> "torch.Tensor":
        """Whole blocks [len(block_ids), block_bytes], contiguous (what a sender puts on the wire)."""
        return self.buffer[self._index(block_ids)]

    def scatter_blocks(self, block_ids: Sequence[int], data: "torch.Tensor") -> None:
        """Inverse of gather_blocks: data [len(block_ids), block_bytes] into those blocks."""
        self.buffer[self._index(block_ids)] = data

    def copy_blocks(self, src: Sequence[int], dst: Sequence[int]) -> None:
        """buffer[dst[i]] = buffer[src[i]]; src and dst must not overlap."""
        if len(src) != len(dst):
            raise ValueError(f"copy_blocks: {len(src)} sources, {len(dst)} destinations")
        if src:
            self.buffer[self._index(dst)] = self.buffer[self._index(src)]

    # -- linear states -------------------------------------------------------------------------
    def write_state(self, group: str, blocks: Sequence[int], state: "torch.Tensor") -> None:
        """Store a state ([num_layers * state_bytes] bytes, any dtype/shape) over its blocks."""
        raw = state.contiguous().view(self._torch.uint8).reshape(-1)
        self._check_state(group, blocks, raw.numel())
        padded = self._torch.zeros(len(blocks) * self.cfg.block_bytes, dtype=self._torch.uint8,
                                   device=self.buffer.device)
        padded[:raw.numel()] = raw
        self.buffer[self._index(blocks)] = padded.view(len(blocks), self.cfg.block_bytes)

    def read_state(self, group: str, blocks: Sequence[int]) -> "torch.Tensor":
        """The state's num_layers * state_bytes bytes, flat uint8 (padding cut off)."""
        g = self._specs[group]
        n = g.state_bytes * g.num_layers
        self._check_state(group, blocks, n)
        return self.buffer[self._index(blocks)].reshape(-1)[:n]

    def restore(self, alloc: StateAllocation) -> None:
        """Copy the hit checkpoint into the request's working state (no-op without a hit)."""
        if alloc.restore_from:
            self.copy_blocks(alloc.restore_from, alloc.state_blocks)

    def snapshot(self, alloc: StateAllocation, boundary: int) -> None:
        """After computing exactly `boundary` tokens, copy the working state into that checkpoint."""
        for b, blocks in alloc.checkpoint_writes:
            if b == boundary:
                self.copy_blocks(alloc.state_blocks, blocks)
                return
        raise KeyError(f"no checkpoint at {boundary} tokens in {alloc.checkpoint_writes}")

    def _check_state(self, group: str, blocks: Sequence[int], nbytes: int) -> None:
        g: GroupSpec = self._specs[group]
        if nbytes != g.state_bytes * g.num_layers or len(blocks) * self.cfg.block_bytes < nbytes:
            raise ValueError(f"group {group!r}: state of {nbytes} bytes over {len(blocks)} blocks; "
                             f"expected {g.state_bytes * g.num_layers} bytes")

    def _index(self, block_ids: Sequence[int]) -> "torch.Tensor":
        return self._torch.as_tensor(list(block_ids), dtype=self._torch.int64, device=self.buffer.device)
