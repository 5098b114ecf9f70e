"""Per-request block hashes kept across SGLang's calls and extended as the request grows.

SGLang matches a waiting request again on every scheduling attempt, locks the match, and checkpoints a
running request at every chunk end. Hashing the token list from scratch on each call costs O(length)
per call (tens of ms at 128K tokens) and O(length^2 / chunk) per request. Here each request's hashes
are extended by the blocks that became full since the last call, chained from its last hash, so a
block is hashed once per request; a token list that is not an extension of the kept one (SGLang
replaces the prompt of an aborted request) is hashed again from scratch.

Arrays are kept, not copied, so an entry trusts that a kept array's hashed tokens do not change while
it is looked up. SGLang 0.5.23 changes a request's token array in place by appending only
(Req.refresh_fill_ids), or replaces it, with one exception: a streaming session's next turn trims the
last finished turn's array back to its committed length and extends it with new tokens, and the new
request carries that same array (session_controller._share_token_arrays). That never reaches this
backend: SGLang refuses --enable-streaming-session with any tree cache but UnifiedRadixCache
(mem_cache/registry.create_tree_cache), and only that cache's finish hook sets the committed length.
Were it allowed, a turn is trimmed only after it finished or aborted: a released turn's entry is
dropped (on_release) and its pool request, which holds the array, is freed; a turn aborted while
waiting keeps an entry whose hashes describe the old tokens, but entries are found by rid, and the
next turn's rid starts its own entry hashed from the new tokens.
"""
from __future__ import annotations

from array import array
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Optional

import numpy as np

from prfaas_sgl.cachepool.hashing import extend_hashes, hashes_until_miss


class RequestHashes:
    """tokens: array("q") of the longest token list seen for the request, the caller's own array when
    it passed one (SGLang's req.full_untruncated_fill_ids, not copied; the pool and match handles keep
    it too); hashes: a prefix of block_hashes(tokens). Neither shrinks. While the request lives,
    SGLang only appends to its array (the module docstring says which array changes otherwise, and
    why no entry reads it then). source: the caller's array that tokens last agreed with, or None."""

    __slots__ = ("tokens", "hashes", "source")

    def __init__(self, tokens: array, hashes: list[int], source: Optional[array] = None) -> None:
        self.tokens, self.hashes, self.source = tokens, hashes, source


class HashMemo:
    """RequestHashes by SGLang request id; the `capacity` most recently used are kept (a request
    matched but never released, e.g. aborted while waiting, ages out). A request's ids are SGLang's own
    array (a copy only for a list), so an entry adds its hash ints; one kept after SGLang dropped the
    request holds its ids (1 MB at 128K tokens) until it ages out. A request aged out while still
    waiting is only hashed again."""

    def __init__(self, block_size: int, seed: int = 0, capacity: int = 256) -> None:
        self.bs, self.seed, self.capacity = block_size, seed, capacity
        self._by_rid: OrderedDict[str, RequestHashes] = OrderedDict()

    def get(self, rid: Optional[str], token_ids: Sequence[int], cached: Optional[Callable[[int], bool]] = None,
            blocks: Optional[int] = None) -> RequestHashes:
        """Hashes covering token_ids: the result's tokens start with token_ids (they may go on: an
        earlier call saw more of the request) and its hashes cover every full block of them, or the
        first `blocks` (a checkpoint reads no further); with `cached` (a lookup: is this hash in the
        index?) only up to the first block that is not, which is all a match reads. A later call
        hashes the rest it needs. Without a rid nothing is kept, and an array("q") is not copied."""
        ids = token_ids if isinstance(token_ids, array) and token_ids.typecode == "q" else array("q", token_ids)
        kept = self._by_rid.get(rid) if rid is not None else None
        if kept is not None and self._extends(kept, ids):
            self._by_rid.move_to_end(rid)  # type: ignore[arg-type]
        elif rid is None:
            kept = RequestHashes(ids, [])
        else:
            kept = self._by_rid[rid] = RequestHashes(ids, [], ids)
            if len(self._by_rid) > self.capacity:
                self._by_rid.popitem(last=False)
        if cached is None:
            extend_hashes(kept.hashes, kept.tokens, self.bs, self.seed, blocks)
        else:
            hashes_until_miss(kept.tokens, self.bs, kept.hashes, cached, self.seed)
        return kept

    def _extends(self, kept: RequestHashes, ids: array) -> bool:
        """Whether ids and kept.tokens agree on their common prefix; if so, kept.tokens becomes the
        longer of the two (an array, never copied: a 128K-token request is a 1 MB copy). numpy
        compares 128K ids in ~70 us; comparing array slices costs ~1.3 ms (per element, in Python
        objects) and copies both."""
        if ids is kept.tokens:  # the caller's array, appended to in place since the last call
            return True
        if ids is not kept.source:  # a request's own array is only appended to while it lives
            n = min(len(ids), len(kept.tokens))
            if not np.array_equal(np.frombuffer(kept.tokens, np.int64, n), np.frombuffer(ids, np.int64, n)):
                return False
        if len(ids) > len(kept.tokens):
            kept.tokens = ids
        kept.source = ids
        return True

    def drop(self, rid: str) -> None:
        self._by_rid.pop(rid, None)

    def __len__(self) -> int:
        return len(self._by_rid)
