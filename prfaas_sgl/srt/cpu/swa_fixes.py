"""Fixes that let stock SGLang 0.5.23 serve MiMo-V2-Flash-style sliding-window hybrids on a CPU.

SGLang's `torch_native` attention backend (the CPU one) has two gaps for these models, both in its
forward_extend / forward_decode, so one AROUND hook on each takes the affected layers:

1. Attention sinks. MiMo's attention always calls `attn(..., sinks=...)` (None on full-attention layers, a
   per-head logit on SWA layers); torch_native's forwards take no `sinks` and raise TypeError.
2. SWA-pool reads. With the hybrid `SWAKVPool`, an SWA layer's K/V live in a smaller pool indexed by
   SWA slots. torch_native writes through the translated slots but reads with `req_to_token`'s full-pool
   indices, i.e. other tokens' rows (or past the pool's end). Other backends translate the read indices
   with `translate_loc_from_full_to_swa` (triton's `update_sliding_window_buffer`); so do we, and read only
   the window, because slots that slid out of it were freed (they map to slot 0).

Layers with neither (sinks None, not an SWA-pool layer) keep the stock code. Like `fixes.py`, these run
only in CPU mode (`SGLANG_USE_CPU_ENGINE=1`). `TARGETS` maps each hooked SGLang attribute to its fix.
"""
from __future__ import annotations

import sys

import torch

TORCH_NATIVE = "sglang.srt.layers.attention.torch_native_backend.TorchNativeAttnBackend"

TARGETS = {
    f"{TORCH_NATIVE}.forward_extend": "sinks_and_swa_pool_on_torch_native_extend",
    f"{TORCH_NATIVE}.forward_decode": "sinks_and_swa_pool_on_torch_native_decode",
}


def install(HookRegistry, HookType) -> None:
    for target, name in TARGETS.items():
        HookRegistry.register(target, globals()[name], HookType.AROUND)


def sinks_and_swa_pool_on_torch_native_extend(
    original, self, q, k, v, layer, forward_batch, save_kv_cache=True, sinks=None, **kwargs
):
    """Extend (prefill, chunked prefill after a cached prefix, mixed batches): see the module docstring."""
    if not needs_sink_attention(self, layer, sinks):
        return original(self, q, k, v, layer, forward_batch, save_kv_cache=save_kv_cache, **kwargs)
    return attend(self, q, k, v, layer, forward_batch, save_kv_cache, sinks, forward_batch.extend_seq_lens)


def sinks_and_swa_pool_on_torch_native_decode(
    original, self, q, k, v, layer, forward_batch, save_kv_cache=True, sinks=None, **kwargs
):
    """Decode (one query per request): see the module docstring."""
    if not needs_sink_attention(self, layer, sinks):
        return original(self, q, k, v, layer, forward_batch, save_kv_cache=save_kv_cache, **kwargs)
    q_lens = torch.ones_like(forward_batch.seq_lens)
    return attend(self, q, k, v, layer, forward_batch, save_kv_cache, sinks, q_lens)


def needs_sink_attention(backend, layer, sinks) -> bool:
    return sinks is not None or reads_swa_pool(backend, layer)


def reads_swa_pool(backend, layer) -> bool:
    """True for an SWA layer whose K/V live in SWAKVPool's SWA sub-pool (SWA slot ids, not full ones)."""
    if not backend.use_sliding_window_kv_pool:
        return False
    return backend.token_to_kv_pool.layers_mapping[layer.layer_id][1]


def attend(backend, q, k, v, layer, forward_batch, save_kv_cache, sinks, q_lens):
    """Writes this batch's K/V as stock torch_native does, then attends request by request.
    q [T, Hq * D] (or [T, Hq, D]); q_lens [B]: each request's queries, its last ones (positions
    seq_len - q_len .. seq_len - 1). Returns [T, Hq * Dv]."""
    from prfaas_sgl.kernels.sink_attention.cpu import sink_attention

    if layer.is_cross_attention or forward_batch.encoder_lens is not None:
        raise NotImplementedError("prfaas_sgl sink/SWA-pool attention on torch_native is decoder-only")
    pool = backend.token_to_kv_pool
    if save_kv_cache and k is not None and v is not None:
        loc = _write_loc(backend, forward_batch.out_cache_loc)
        pool.set_kv_buffer(layer, loc, k, v)
    q3 = q.reshape(-1, layer.tp_q_head_num, layer.qk_head_dim)
    out = q.new_empty(q3.shape[0], layer.tp_q_head_num, layer.v_head_dim)
    k_buf, v_buf = pool.get_key_buffer(layer.layer_id), pool.get_value_buffer(layer.layer_id)
    window = layer.sliding_window_size if layer.sliding_window_size is not None else -1
    swa = reads_swa_pool(backend, layer)
    req_to_token = backend.req_to_token_pool.req_to_token
    start = 0
    for req, seq_len, q_len in zip(forward_batch.req_pool_indices.tolist(), forward_batch.seq_lens.tolist(),
                                   q_lens.tolist()):
        q_pos0 = seq_len - q_len
        #   positions 0 ...... lo ========= q_pos0 ====== seq_len     lo: the first query's oldest key
        #                         window    [ this batch's queries ]
        lo = max(0, q_pos0 - window) if window >= 0 else 0
        slots = req_to_token[req, lo:seq_len]
        if swa:
            slots = pool.translate_loc_from_full_to_swa(slots)
        keys, values = k_buf[slots].to(q.dtype), v_buf[slots].to(q.dtype)
        out[start : start + q_len] = sink_attention(q3[start : start + q_len], keys, values, scale=layer.scaling,
                                                    sinks=sinks, window=window, q_pos0=q_pos0, k_pos0=lo)
        start += q_len
    return out.view(-1, layer.tp_q_head_num * layer.v_head_dim)


def _write_loc(backend, out_cache_loc):
    """The pair torch_native's own forwards write through (full slots, plus SWA slots on an SWA pool), built
    with the `KVWriteLoc` the backend's module imported."""
    write_loc = sys.modules[type(backend).__module__].KVWriteLoc
    return write_loc(out_cache_loc, backend.swa_out_cache_loc)
