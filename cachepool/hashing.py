"""Chained block hashes: h[i] = xxh3_64(token ids of block i, seed = h[i-1]), h[-1] = seed.

Equal hashes mean equal token prefixes (up to 64-bit collisions), so a prefix lookup is a run of dict
hits. Only FULL blocks are hashed: a partial tail block is never reusable.
"""
from __future__ import annotations

from array import array
from collections.abc import Sequence

import xxhash

_TOKEN_BYTES = 4  # ids are packed as uint32


def block_hashes(token_ids: Sequence[int], block_size: int, seed: int = 0) -> list[int]:
    """Hashes of the len(token_ids) // block_size full blocks.

    tokens  [0 ........ bs)[bs ...... 2bs) ... [(n-1)bs .. n*bs)[tail < bs]
    hashes   h[0]           h[1]                h[n-1]           (none)
    """
    data = memoryview(array("I", token_ids).tobytes())
    step = block_size * _TOKEN_BYTES
    out: list[int] = []
    parent = seed
    digest = xxhash.xxh3_64_intdigest
    for start in range(0, (len(token_ids) // block_size) * step, step):
        parent = digest(data[start:start + step], parent)
        out.append(parent)
    return out


def extend_hashes(hashes: list[int], token_ids: Sequence[int], block_size: int, seed: int = 0) -> None:
    """Append hashes for full blocks of token_ids not yet hashed (decode growth). Mutates hashes."""
    done = len(hashes)
    start = done * block_size
    full = (len(token_ids) // block_size) * block_size
    if full <= start:
        return
    parent = hashes[-1] if hashes else seed
    hashes.extend(block_hashes(token_ids[start:full], block_size, parent))
