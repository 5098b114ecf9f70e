"""Chained block hashes: h[i] = xxh3_64(token ids of block i, seed = h[i-1]), h[-1] = seed.

Equal hashes mean equal token prefixes (up to 64-bit collisions), so a prefix lookup is a run of dict
hits. Only FULL blocks are hashed: a partial tail block is never reusable. Token ids are hashed as
native uint32; an `array("q")` (SGLang's token arrays) is packed without a per-token Python loop.
"""
from __future__ import annotations

from array import array
from collections.abc import Callable, Sequence
from typing import Optional

import numpy as np
import xxhash

_TOKEN_BYTES = 4  # ids are packed as uint32


def block_hashes(token_ids: Sequence[int], block_size: int, seed: int = 0) -> list[int]:
    """Hashes of the len(token_ids) // block_size full blocks.

    tokens  [0 ........ bs)[bs ...... 2bs) ... [(n-1)bs .. n*bs)[tail < bs]
    hashes   h[0]           h[1]                h[n-1]           (none)
    """
    return _hash_blocks(token_ids, 0, len(token_ids) // block_size, block_size, seed)


def _hash_blocks(token_ids: Sequence[int], first: int, end: int, block_size: int, parent: int) -> list[int]:
    """Chained hashes of blocks [first, end) of token_ids, the chain entering at `parent`; the ids are
    packed once, without slicing token_ids first (a slice of 128K ids is a 1 MB copy)."""
    if end <= first:
        return []
    data = _packed(token_ids, first * block_size, end * block_size)
    step = block_size * _TOKEN_BYTES
    out: list[int] = []
    digest = xxhash.xxh3_64_intdigest
    for start in range(0, (end - first) * step, step):
        parent = digest(data[start:start + step], parent)
        out.append(parent)
    return out


def hashes_until_miss(token_ids: Sequence[int], block_size: int, hashes: list[int],
                      cached: Callable[[int], bool], seed: int = 0) -> None:
    """Extend `hashes` (a prefix of block_hashes(token_ids)) until it holds a hash that is not `cached`,
    or every full block: a prefix lookup needs no hash past its first miss, so a new prompt costs one
    block, not its length. Hashes in doubling windows and looks up only each window's last hash (a
    chained hash that is cached implies nothing about its parents, but one that is not means the first
    miss is at or before it), so a full hit costs what block_hashes costs; at most twice the blocks up
    to the first miss are hashed. Mutates hashes; they stay a prefix of block_hashes(token_ids).

    hashes  [given ....)[window 1][window 2 ....][window 4 ..........]   stop: last hash not cached
    """
    n = len(token_ids) // block_size
    done = len(hashes)
    if done >= n or (done and not cached(hashes[-1])):
        return
    while done < n:
        end = min(n, 2 * done if done else 1)
        hashes.extend(_hash_blocks(token_ids, done, end, block_size, hashes[-1] if hashes else seed))
        if not cached(hashes[-1]):
            return
        done = end


def _packed(token_ids: Sequence[int], start: int, end: int) -> memoryview:
    """token_ids[start:end] as native uint32 bytes, with no copy but the conversion. An array (SGLang
    keeps token ids in array("q")) goes through a numpy view, ~3x faster than a per-token conversion;
    a list is fastest through array("I")."""
    if isinstance(token_ids, array):
        size = token_ids.itemsize
        view = np.frombuffer(token_ids, dtype=token_ids.typecode, count=end - start, offset=start * size)
        return memoryview(view.astype(np.uint32)).cast("B")
    return memoryview(array("I", token_ids[start:end])).cast("B")


def extend_hashes(hashes: list[int], token_ids: Sequence[int], block_size: int, seed: int = 0,
                  limit: Optional[int] = None) -> None:
    """Append hashes for the full blocks of token_ids not hashed yet, chained from hashes[-1]
    (decode growth, a prefill's next chunk), up to `limit` blocks in all if given. Mutates hashes;
    O(new blocks).

    tokens  [0 ....... done*bs)[done*bs ......... full)[tail]
    hashes   hashes (given)     appended here
    """
    n = len(token_ids) // block_size if limit is None else min(limit, len(token_ids) // block_size)
    hashes.extend(_hash_blocks(token_ids, len(hashes), n, block_size, hashes[-1] if hashes else seed))
