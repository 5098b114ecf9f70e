"""prfaas_hybrid checkpoints and restores every linear-attention family's state the same way: over
SGLang's real MambaPool built with the family's own state shapes (GDN: conv (dim, K-1); KDA: conv
transposed, (K-1, 3 H D); Lightning: no conv), a checkpoint copies each conv and recurrent tensor of the
request's slot, and a later prefix hit restores exactly the state of the boundary it matched.

The same shapes give router/kv_accounting.py's state bytes (what the planner and the router's link
accounting count): checked here against SGLang's own `mamba_cache_per_req`."""
from __future__ import annotations

from array import array
from types import SimpleNamespace as NS

import pytest
import torch
from sglang.srt.configs.mamba_utils import (KimiLinearCacheParams, KimiLinearStateShape, Mamba2CacheParams,
                                            Mamba2StateShape)
from sglang.srt.mem_cache.allocator.token import TokenToKVPoolAllocator
from sglang.srt.mem_cache.base_prefix_cache import MatchPrefixParams
from sglang.srt.mem_cache.memory_pool import MambaPool
from sglang.srt.mem_cache.radix_cache import RadixKey

from prfaas_sgl.tools.models import tiny
from prfaas_sgl.router.kv_accounting import AUX_ROW_BYTES, account
from prfaas_sgl.srt.cachepool_backend import cache as backend

CHUNK, SLOTS, LAYERS = 32, 8, 3


def _params(family: str, layers: list[int]):
    """SGLang's state shapes for the tiny models' linear layers (tp 1), as their config classes build them."""
    if family == "kda":  # tiny-kimi-linear: 4 heads x 16, short conv 4
        shape = KimiLinearStateShape.create(tp_world_size=1, num_heads=4, head_dim=16, conv_kernel_size=4)
        return KimiLinearCacheParams(shape=shape, layers=layers)
    if family == "gdn":  # tiny-qwen35-hybrid: 2 key heads x 16, 4 value heads x 16, conv 4 (Qwen3-Next's create)
        shape = Mamba2StateShape.create(tp_world_size=1, intermediate_size=4 * 16, n_groups=2, num_heads=4,
                                        head_dim=16, state_size=16, conv_kernel=4)
        return Mamba2CacheParams(shape=shape, layers=layers)
    # Lightning (bailing_hybrid without a short conv): num_heads x head_dim x head_dim, conv_dim 0
    shape = Mamba2StateShape.create(tp_world_size=1, intermediate_size=0, n_groups=0, num_heads=4, head_dim=16,
                                    state_size=16, conv_kernel=1)
    return Mamba2CacheParams(shape=shape, layers=layers)


def _cache(family: str):
    mamba = MambaPool(size=SLOTS, spec_state_size=0, cache_params=_params(family, list(range(LAYERS))),
                      mamba_layer_ids=list(range(LAYERS)), device="cpu")
    free = set(range(4, SLOTS + 1))  # slots 1-3 are the requests' own (SGLang allocates them at admission)

    def alloc(k):
        return torch.tensor([free.pop() for _ in range(k)], dtype=torch.int64) if len(free) >= k else None

    rtp = NS(req_to_token=torch.zeros((4, 256), dtype=torch.int32), mamba_pool=mamba,
             mamba_allocator=NS(alloc=alloc, free=lambda idx: free.update(idx.reshape(-1).tolist())),
             translate_mamba_indices=lambda i: i, free_mamba_cache=lambda req: None)
    kv = TokenToKVPoolAllocator(1024, torch.float32, "cpu", None, False)
    ctx = NS(params=NS(page_size=1, token_to_kv_pool_allocator=kv, req_to_token_pool=rtp),
             server_args=NS(chunked_prefill_size=CHUNK, disaggregation_mode="null"), is_hybrid_ssm=True,
             is_hybrid_swa=False, enable_hierarchical_cache=False, disable_radix_cache=False)
    return backend.build(ctx), mamba, kv


def _tensors(mamba: MambaPool) -> list[torch.Tensor]:
    return [*mamba.mamba_cache.conv, mamba.mamba_cache.temporal]


def _state(mamba: MambaPool, slot: int) -> list[torch.Tensor]:
    return [t[:, slot].clone() for t in _tensors(mamba)]


def _write_random(mamba: MambaPool, slot: int, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    for t in _tensors(mamba):
        t[:, slot] = torch.randn(t[:, slot].shape, generator=g).to(t.dtype)


def _request(rid: str, row: int, tokens: list[int], slot: int):
    kv = NS(req_pool_idx=row, mamba_pool_idx=torch.tensor(slot), mamba_cow_src_index=None,
            mamba_needs_clear=False, holds_mamba=True)
    return NS(rid=rid, extra_key=None, cache_salt=None, full_untruncated_fill_ids=array("q", tokens), kv=kv)


@pytest.mark.parametrize("family", ["gdn", "kda", "lightning"])
def test_checkpoints_restore_every_state_tensor(family):
    cache, mamba, kv = _cache(family)
    tokens = list(range(100, 100 + 2 * CHUNK + 5))
    a = _request("a", 0, tokens, slot=1)
    cache.req_to_token_pool.req_to_token[0, :len(tokens)] = kv.alloc(len(tokens)).to(torch.int32)
    states = {}
    for boundary, seed in ((CHUNK, 1), (2 * CHUNK, 2)):  # the model's state at each chunk end
        _write_random(mamba, 1, seed)
        states[boundary] = _state(mamba, 1)
        cache.checkpoint(a, up_to=boundary)
    _write_random(mamba, 1, 3)  # a decodes on: its own slot moves past every checkpoint
    assert len(cache.mirror.state_of) == 2

    for boundary, row in ((2 * CHUNK, 1), (CHUNK, 2)):
        b = _request(f"b{boundary}", row, tokens[:boundary] + [7, 7, 7], slot=1 + row)
        hit = cache.match_prefix(MatchPrefixParams(key=RadixKey(array("q", b.full_untruncated_fill_ids[:-1])),
                                                   req=b, cow_mamba=True))
        assert hit.device_prefix_len == boundary
        # what the scheduler does with the staged copy before the forward (ScheduleBatch's deferred COW)
        mamba.copy_from(b.kv.mamba_cow_src_index, b.kv.mamba_pool_idx.unsqueeze(0))
        got = _state(mamba, int(b.kv.mamba_pool_idx))
        assert len(got) == len(states[boundary])
        for want, have in zip(states[boundary], got):
            assert torch.equal(want, have), family


@pytest.mark.parametrize("family, spec", [("gdn", tiny.QWEN35_HYBRID), ("kda", tiny.KIMI_LINEAR)])
def test_accounted_state_bytes_equal_sglangs_state_shapes(family, spec):
    """router/kv_accounting.py's fixed bytes = SGLang's bytes per state slot over the same layers."""
    acct = account({"dtype": "float32", **spec.config})
    layers = 6  # both tiny models: 6 linear layers of 8
    assert acct.state_bytes - AUX_ROW_BYTES == _params(family, list(range(layers))).mamba_cache_per_req


def test_lightning_state_bytes_equal_sglangs_state_shapes():
    conf = {"model_type": "bailing_hybrid", "dtype": "float32", "num_hidden_layers": 8, "num_attention_heads": 4,
            "head_dim": 16, "layer_group_size": 4, "kv_lora_rank": 32, "qk_rope_head_dim": 8}
    acct = account(conf)
    assert acct.family == "lightning"
    assert acct.state_bytes - AUX_ROW_BYTES == _params("lightning", list(range(6))).mamba_cache_per_req
