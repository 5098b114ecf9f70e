"""Torch copies for `ByteRuns` slices (items.py): the staged path's gather and landing when a stream item
is several byte runs of a pool item (Mamba/GDN/KDA state between TP sizes).

`items` is a buffer's [num_items, item_len] uint8 tensor (packed or strided rows, host or CUDA, as
staging.Pools holds it). A stream item is the item's bytes at `runs.columns()`, in that order:

    pool item:    | a | B | c | D |         runs ((off B, len B), (off D, len D))
    stream item:  | B | D |                 columns = [off B .. off B + len B) ++ [off D .. off D + len D)

Whole runs (one source fills the destination item in order) take the plain row copies.
"""
from __future__ import annotations

import functools

import numpy as np
import torch

from prfaas_sgl.transfer.items import ByteRuns


@functools.lru_cache(maxsize=256)
def columns(runs: ByteRuns, device: str) -> torch.Tensor:
    """`runs.columns()` on `device`, made once per slice and device (a pairing's slices repeat per room)."""
    return torch.from_numpy(runs.columns()).to(device)


def gather(items: torch.Tensor, index: torch.Tensor, runs: ByteRuns, out: torch.Tensor) -> torch.Tensor:
    """Stream items of items[index] into `out` (flat, len(index) × runs.stream_len bytes, items' device)."""
    rows = out.view(index.numel(), runs.stream_len)
    if runs.whole:
        return torch.index_select(items, 0, index, out=rows)
    picked = items.index_select(0, index)  # [count, item_len]: then the runs' bytes of every row at once
    return torch.index_select(picked, 1, columns(runs, str(items.device)), out=rows)


def read_piece(items: torch.Tensor, item: int, runs: ByteRuns, start: int, out: torch.Tensor) -> None:
    """Stream-item bytes [start, start + len(out)) of pool item `item` into `out`."""
    cols = columns(runs, str(items.device))[start: start + out.numel()]
    torch.index_select(items[item], 0, cols, out=out)


def write_rows(items: torch.Tensor, index: np.ndarray, tensor_index: torch.Tensor | None, runs: ByteRuns,
               rows: torch.Tensor) -> None:
    """Write stream items `rows` [k, stream_len] into pool items `index` (numpy; `tensor_index` the same
    ids on a CUDA pool's device)."""
    cols = columns(runs, str(items.device))
    if items.is_cuda:
        items.index_put_((tensor_index[:, None], cols[None, :]), rows)
    else:  # numpy's fancy assignment, as landing.apply_spans does for whole items
        items.numpy()[np.ix_(index, cols.numpy())] = rows.numpy()


def write_piece(items: torch.Tensor, item: int, runs: ByteRuns, start: int, src: torch.Tensor) -> None:
    """Stream-item bytes [start, start + len(src)) into pool item `item` (a piece of a large state)."""
    cols = columns(runs, str(items.device))[start: start + src.numel()]
    items[item].index_put_((cols,), src)
