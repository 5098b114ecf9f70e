"""The decode-server kinds of prfaas_hybrid (--disaggregation-mode decode with
--disaggregation-decode-enable-radix-cache). Both index full-attention KV only: a hit becomes SGLang's
decode_prefix_len, and the prefill sends what decode cannot hold from its cache, whatever prefix that is.

DecodeKvCache (hybrid linear attention): the prefill sends the pages past the hit plus the request's
state at the prompt end, so decode never resumes a state from its cache and any block-aligned prefix
counts (the linear-state rule would cap a hit at a state checkpoint decode never has). The request's
own Mamba slot goes back at release as on any server.

DecodeWindowKvCache (sliding-window hybrid, page size > 1): SGLang's decode caps the match before the
request's SWA tail and allocates the whole tail fresh (disaggregation/decode.py
_match_prefix_and_lock), the prefill fills it, so a hit needs no window pages:

    row positions  [0, hit)             tree's full slots, no SWA peers needed
                   [hit, tail)          full slots, SWA peers never allocated (evicted cursor = tail)
                   [tail, seq_len)      full slots + SWA peers, the window the prefill sent
The tree keeps full slots only: at release the live peers of the blocks it took go back (sliding.py
_free_windows), and a removed entry frees its full side only.
"""
from __future__ import annotations

import dataclasses

from sglang.srt.mem_cache.base_prefix_cache import EvictParams, EvictResult

from prfaas_sgl.cachepool import GroupSpec

from .base import PrfaasHybridCache
from .mirror import Insert
from .sliding import SlidingWindowCache


class DecodeKvCache(PrfaasHybridCache):
    """The base class's full-attention index as it is: no state group, no state checkpoints."""


class DecodeWindowKvCache(SlidingWindowCache):
    """SlidingWindowCache without its SWA group: the tree never owns a window page."""

    def _groups(self) -> tuple[GroupSpec, ...]:
        return PrfaasHybridCache._groups(self)

    def _stage(self, req, insert: Insert, last_hash: int, length: int, up_to: int) -> None:
        """No window pages to hand over, so no swa_evict_floor to raise."""

    def evict(self, params: EvictParams) -> EvictResult:
        """Evicting frees no window page here: a window shortfall is not the tree's to meet."""
        return super().evict(dataclasses.replace(params, swa_num_tokens=0))

    def _evict_group(self, short_kv: bool, short_windows: bool) -> str | None:
        return None

    def swa_evictable_size(self) -> int:
        return 0
