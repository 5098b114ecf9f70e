"""Query-only extend attention on `torch_native` (opt-in: `--prfaas-cpu-query-only-attention`).

SGLang's CPU attention backend pads each request's queries to its whole context and runs causal SDPA over
all of it (`_run_sdpa_forward_extend`), so a chunk's attention costs ~ctx² whatever was cached or computed
by an earlier chunk. A GPU backend (flashinfer, fa3) computes only the new queries, and there a prefix hit
saves attention too. This computes only the new queries, as a GPU backend does:

    keys     0 ............ prefix ============= seq_len
    queries                 [ extend: n rows   ]      row i sees keys 0 .. prefix + i
    mask     n x seq_len, True where key <= prefix + i   (tril with diagonal = prefix)

A request with no prefix (a whole prompt, or a first chunk) takes the stock path unchanged, so a server that
never hits and never chunks computes exactly what stock torch_native computes. Otherwise the rows differ
from the padded computation in the last float bits (SDPA's reductions run over a different key span), the
same size of difference stock torch_native already shows between two chunk grids. Sliding-window,
cross-attention and encoder batches keep the stock path.
"""
from __future__ import annotations

import logging

import torch
from torch.nn.functional import scaled_dot_product_attention

TORCH_NATIVE = "sglang.srt.layers.attention.torch_native_backend.TorchNativeAttnBackend"
ENABLED_ATTR = "_prfaas_query_only"
log = logging.getLogger(__name__)


def install(HookRegistry, HookType) -> None:
    HookRegistry.register(f"{TORCH_NATIVE}.__init__", remember_setting, HookType.AFTER)
    HookRegistry.register(f"{TORCH_NATIVE}._run_sdpa_forward_extend", query_only_extend, HookType.AROUND)


def remember_setting(result, self, model_runner, *args, **kwargs):
    from prfaas_sgl.srt.flags import get_config

    enabled = get_config(model_runner.server_args).cpu_query_only_attention
    setattr(self, ENABLED_ATTR, enabled)
    if enabled:
        log.info("prfaas_sgl cpu: torch_native extend attends with its new queries only")
    return result


def query_only_extend(original, self, query, output, k_cache, v_cache, req_to_token, req_pool_indices, seq_lens,
                      extend_prefix_lens, extend_seq_lens, encoder_lens=None, scaling=None, enable_gqa=False,
                      causal=False, is_cross_attn=False, sliding_window_size=None):
    stock = (not getattr(self, ENABLED_ATTR, False) or not causal or is_cross_attn or encoder_lens is not None
             or (sliding_window_size is not None and sliding_window_size > -1))
    if stock:
        return original(self, query, output, k_cache, v_cache, req_to_token, req_pool_indices, seq_lens,
                        extend_prefix_lens, extend_seq_lens, encoder_lens, scaling=scaling, enable_gqa=enable_gqa,
                        causal=causal, is_cross_attn=is_cross_attn, sliding_window_size=sliding_window_size)
    return attend_new_queries(query, output, k_cache, v_cache, req_to_token, req_pool_indices.tolist(),
                              seq_lens.tolist(), extend_prefix_lens.tolist(), extend_seq_lens.tolist(),
                              scaling, enable_gqa)


def attend_new_queries(query, output, k_cache, v_cache, req_to_token, reqs, seq_lens, prefix_lens, q_lens,
                       scaling, enable_gqa):
    """query/output [T, H, D] (T = sum of q_lens); each request's queries are its last q_len positions."""
    heads_first = query.movedim(0, 1)  # [H, T, D]
    start = 0
    for req, seq_len, prefix, n in zip(reqs, seq_lens, prefix_lens, q_lens):
        q = heads_first[:, start:start + n].contiguous()  # the layout stock torch_native gives SDPA
        slots = req_to_token[req, :seq_len]
        k = k_cache[slots].movedim(0, 1).to(q.dtype)
        v = v_cache[slots].movedim(0, 1).to(q.dtype)
        if prefix == 0:  # the stock computation: a square causal SDPA
            out = scaled_dot_product_attention(q[None], k[None], v[None], enable_gqa=enable_gqa, scale=scaling,
                                               is_causal=True)
        else:
            mask = torch.ones(n, seq_len, dtype=torch.bool, device=q.device).tril(diagonal=prefix)
            out = scaled_dot_product_attention(q[None], k[None], v[None], attn_mask=mask, enable_gqa=enable_gqa,
                                               scale=scaling)
        output[start:start + n] = out[0].movedim(0, 1)
        start += n
    return output
