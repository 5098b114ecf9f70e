"""DecodeKvCache: prfaas_hybrid on a PD decode server (--disaggregation-mode decode with
--disaggregation-decode-enable-radix-cache) serving a hybrid linear-attention model.

It indexes full-attention KV only. Its hit becomes SGLang's decode_prefix_len; the prefill sends the
pages past it plus the request's state at the prompt end whatever prefix decode holds, so decode
never resumes a state from its cache and any block-aligned prefix counts (the linear-state rule
would cap a hit at a state checkpoint decode never has). The request's own Mamba slot (the state the
prefill sent) goes back at release as on any server.
"""
from __future__ import annotations

from .base import PrfaasHybridCache


class DecodeKvCache(PrfaasHybridCache):
    """The base class's full-attention index as it is: no state group, no state checkpoints."""
