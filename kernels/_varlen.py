"""Varlen bookkeeping shared by the kernels: where each sequence sits in the packed token axis.

SGLang packs a batch as one row `[1, T_total, ...]` plus `cu_seqlens` (a.k.a. `query_start_loc`):

    cu_seqlens = [0, 5, 6, 9]       3 sequences
    tokens      |0 1 2 3 4|5|6 7 8|
                  seq 0    1  seq 2

Without cu_seqlens a `[B, T, ...]` input is B sequences of T tokens each.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True)
class SeqLayout:
    """starts, lengths: [N] int64 on CPU; offsets into the flattened token axis."""

    starts: torch.Tensor
    lengths: torch.Tensor

    @property
    def num_seqs(self) -> int:
        return int(self.starts.numel())


def seq_layout(cu_seqlens: torch.Tensor | None, batch: int, seqlen: int) -> SeqLayout:
    """Layout of `batch` x `seqlen` tokens, packed (cu_seqlens [N + 1]) or rectangular."""
    if cu_seqlens is None:
        starts = torch.arange(batch, dtype=torch.int64) * seqlen
        return SeqLayout(starts, torch.full((batch,), seqlen, dtype=torch.int64))
    if batch != 1:
        raise ValueError(f"packed (cu_seqlens) inputs must have batch 1, got {batch}; flatten the batch first")
    cu = cu_seqlens.to(device="cpu", dtype=torch.int64)
    if int(cu[-1]) > seqlen:
        raise ValueError(f"cu_seqlens ends at {int(cu[-1])} but the input has only {seqlen} tokens")
    return SeqLayout(cu[:-1].clone(), cu[1:] - cu[:-1])


def slot_indices(indices: torch.Tensor | None, num_seqs: int) -> torch.Tensor:
    """Pool slot per sequence as int64 [N]; None means sequence n uses slot n."""
    if indices is None:
        return torch.arange(num_seqs, dtype=torch.int64)
    idx = indices.to(device="cpu", dtype=torch.int64).reshape(-1)
    if idx.numel() < num_seqs:
        raise ValueError(f"{idx.numel()} state indices for {num_seqs} sequences; pass one slot per sequence")
    return idx[:num_seqs]
