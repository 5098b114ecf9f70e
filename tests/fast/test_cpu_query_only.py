"""Query-only extend attention (`prfaas_sgl.srt.cpu.query_only`) against SGLang 0.5.23's own
`_run_sdpa_forward_extend` (its torch_native_backend.py executed with stand-ins for its sglang imports, as in
test_cpu_swa_fixes): a batch of requests with and without a cached prefix over a shuffled KV pool, GQA, the
tiny hybrid's shapes. Requests without a prefix are bit-identical to stock; the others equal it to float32
rounding and equal a row-by-row reference built from the definition."""
from __future__ import annotations

import types

import pytest
import torch

from prfaas_sgl.srt.cpu import query_only

from .test_cpu_swa_fixes import _torch_native_module

HQ, HK, D = 4, 2, 16


def _batch(seed: int, prefixes: list[int], news: list[int]):
    g = torch.Generator().manual_seed(seed)
    seq_lens = [p + n for p, n in zip(prefixes, news)]
    pool = sum(seq_lens) + 7
    k_cache, v_cache = torch.randn(pool, HK, D, generator=g), torch.randn(pool, HK, D, generator=g)
    req_to_token = torch.zeros(len(seq_lens) + 2, max(seq_lens) + 5, dtype=torch.int64)
    perm = torch.randperm(pool, generator=g)
    reqs, used = [2, 0, 3, 1][: len(seq_lens)], 0
    for r, n in zip(reqs, seq_lens):
        req_to_token[r, :n] = perm[used:used + n]
        used += n
    query = torch.randn(sum(news), HQ, D, generator=g)
    args = (k_cache, v_cache, req_to_token, torch.tensor(reqs), torch.tensor(seq_lens), torch.tensor(prefixes),
            torch.tensor(news))
    return query, args


def _run(fn, backend, query, args):
    out = torch.full_like(query, float("nan"))
    fn(backend, query, out, *args, scaling=0.25, enable_gqa=True, causal=True)
    return out


@pytest.fixture(scope="module")
def stock():
    return _torch_native_module().TorchNativeAttnBackend._run_sdpa_forward_extend


def _hooked(stock, enabled: bool):
    backend = types.SimpleNamespace(**{query_only.ENABLED_ATTR: enabled})
    return backend, lambda b, *a, **kw: query_only.query_only_extend(stock, b, *a, **kw)


@pytest.mark.parametrize("seed", range(4))
def test_new_queries_only_equal_stock_padded_attention(stock, seed):
    prefixes, news = [0, 300, 17, 512], [40, 212, 1, 512]
    query, args = _batch(seed, prefixes, news)
    want = _run(stock, None, query, args)
    backend, hooked = _hooked(stock, True)
    got = _run(hooked, backend, query, args)
    assert not got.isnan().any()
    torch.testing.assert_close(got, want, rtol=0, atol=2e-6)
    assert torch.equal(got[:40], want[:40])  # the request with no prefix: the stock computation, bit for bit


def test_each_row_attends_its_keys_up_to_its_own_position(stock):
    prefixes, news = [5, 0], [3, 4]
    query, args = _batch(9, prefixes, news)
    k_cache, v_cache, req_to_token, reqs, seq_lens = args[:5]
    backend, hooked = _hooked(stock, True)
    got = _run(hooked, backend, query, args)
    row = 0
    for r, p, n in zip(reqs.tolist(), prefixes, news):
        for i in range(n):
            slots = req_to_token[r, : p + i + 1]
            k = k_cache[slots].repeat_interleave(HQ // HK, dim=1)  # [keys, HQ, D]
            v = v_cache[slots].repeat_interleave(HQ // HK, dim=1)
            w = torch.softmax(torch.einsum("hd,khd->hk", query[row], k) * 0.25, dim=-1)
            torch.testing.assert_close(got[row], torch.einsum("hk,khd->hd", w, v), rtol=0, atol=1e-5)
            row += 1


def test_off_by_default_is_the_stock_computation(stock):
    query, args = _batch(3, [300, 0], [212, 40])
    backend, hooked = _hooked(stock, False)
    assert torch.equal(_run(hooked, backend, query, args), _run(stock, None, query, args))
