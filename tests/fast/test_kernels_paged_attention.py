"""Paged attention: the torch reference vs a per-token dense twin (fp32, max abs error <= 1e-5), the
pool adapter's exact page tables, and FlashInfer vs the reference on a GPU (skipped without one)."""

from __future__ import annotations

import math
import sys
import types

import pytest
import torch
from prfaas_sgl.cachepool import GroupSpec, HybridCachePool, PoolConfig
from prfaas_sgl.cachepool.storage import BlockStorage
from prfaas_sgl.kernels.paged_attention import (
    AttentionSpec,
    FlashInferPagedAttention,
    build_paged_batch,
    paged_batch_from_allocations,
    paged_decode,
    paged_prefill,
    pool_kv_cache,
)
from prfaas_sgl.kernels.paged_attention.flashinfer import (
    SUPPORTED_HEAD_DIMS,
    PlanCache,
    check_supported,
    use_tensor_cores,
)

TOL = 1e-5
NO_GPU = "FlashInfer kernels need a CUDA GPU; this machine has none"

# page_size, D, Hq, Hkv, [(q_len, kv_len) per request], window_left, soft cap
CASES = {
    "page1-decode-and-append": (1, 64, 4, 1, [(1, 1), (3, 7), (1, 5)], -1, 0.0),
    "page16-ragged-d80": (16, 80, 8, 2, [(1, 37), (20, 20), (17, 50), (5, 16)], -1, 0.0),
    "page16-window": (16, 64, 4, 1, [(33, 33), (1, 40), (18, 45)], 7, 0.0),
    "page4-d80-window-softcap": (4, 80, 4, 1, [(9, 9), (1, 13), (6, 23)], 5, 2.0),
    "page16-mha-qlen-gt-page": (16, 64, 2, 2, [(40, 41), (2, 3)], -1, 0.0),
}


def make_inputs(page_size, d, hq, hkv, reqs, seed=0, dtype=torch.float32, fill=float("nan")):
    """Random q and a paged cache whose pages are handed out in a shuffled order. Every slot no
    request owns (spare pages, the tail of a last page) holds `fill`, so reading one shows up."""
    gen = torch.Generator().manual_seed(seed)
    n_pages = [-(-kv // page_size) for _, kv in reqs]
    total = sum(n_pages) + 3  # spare pages nobody owns
    perm = torch.randperm(total, generator=gen).tolist()
    k_cache = torch.full((total, page_size, hkv, d), fill, dtype=dtype)
    v_cache = torch.full_like(k_cache, fill)
    tables, dense_k, dense_v, pos = [], [], [], 0
    for (_, kv_len), n in zip(reqs, n_pages):
        table, pos = perm[pos:pos + n], pos + n
        k, v = (torch.randn(kv_len, hkv, d, generator=gen).to(dtype) for _ in range(2))
        for t in range(kv_len):
            k_cache[table[t // page_size], t % page_size] = k[t]
            v_cache[table[t // page_size], t % page_size] = v[t]
        tables.append(table)
        dense_k.append(k)
        dense_v.append(v)
    q = torch.randn(sum(q for q, _ in reqs), hq, d, generator=gen).to(dtype)
    batch = build_paged_batch(tables, [kv for _, kv in reqs], [q for q, _ in reqs], page_size)
    return q, k_cache, v_cache, batch, tables


def dense_reference(q, k_cache, v_cache, tables, reqs, spec):
    """Token by token, head by head, float64: gather each request's K/V from its block table into
    contiguous tensors, then plain softmax(q.k) v over the keys the query may see."""
    out, row = torch.zeros(q.shape, dtype=torch.float64), 0
    for table, (q_len, kv_len) in zip(tables, reqs):
        ps = spec.page_size
        k = torch.stack([k_cache[table[t // ps], t % ps] for t in range(kv_len)]).double()
        v = torch.stack([v_cache[table[t // ps], t % ps] for t in range(kv_len)]).double()
        for r in range(q_len):
            p = kv_len - q_len + r
            lo = 0 if spec.window_left < 0 else max(0, p - spec.window_left)
            for h in range(spec.num_qo_heads):
                kh = h // (spec.num_qo_heads // spec.num_kv_heads)
                s = k[lo:p + 1, kh] @ q[row + r, h].double() * spec.scale
                if spec.logits_soft_cap > 0:
                    s = spec.logits_soft_cap * torch.tanh(s / spec.logits_soft_cap)
                out[row + r, h] = torch.softmax(s, 0) @ v[lo:p + 1, kh]
        row += q_len
    return out


def _spec(ps, d, hq, hkv, window, cap):
    return AttentionSpec(hq, hkv, d, ps, window_left=window, logits_soft_cap=cap)


@pytest.mark.parametrize("case", list(CASES), ids=list(CASES))
def test_naive_matches_dense(case):
    ps, d, hq, hkv, reqs, window, cap = CASES[case]
    spec = _spec(ps, d, hq, hkv, window, cap)
    q, k_cache, v_cache, batch, tables = make_inputs(ps, d, hq, hkv, reqs)
    got = paged_prefill(q, k_cache, v_cache, batch, spec)
    assert got.dtype == torch.float32 and got.shape == q.shape
    assert not got.isnan().any()  # no NaN-filled slot was read
    assert (got.double() - dense_reference(q, k_cache, v_cache, tables, reqs, spec)).abs().max() <= TOL


def test_decode_matches_dense_and_prefill():
    reqs = [(1, 1), (1, 16), (1, 17), (1, 50)]
    spec = _spec(16, 80, 8, 2, -1, 0.0)
    q, k_cache, v_cache, batch, tables = make_inputs(16, 80, 8, 2, reqs, seed=3)
    got = paged_decode(q, k_cache, v_cache, batch, spec)
    assert (got.double() - dense_reference(q, k_cache, v_cache, tables, reqs, spec)).abs().max() <= TOL
    assert torch.equal(got, paged_prefill(q, k_cache, v_cache, batch, spec))
    windowed = _spec(16, 80, 8, 2, 3, 0.0)  # position 49 sees keys 46..49 only
    assert (paged_decode(q, k_cache, v_cache, batch, windowed).double()
            - dense_reference(q, k_cache, v_cache, tables, reqs, windowed)).abs().max() <= TOL


def test_single_key_returns_its_value_and_scale_defaults():
    spec = AttentionSpec(4, 1, 64, 16)
    assert spec.scale == 1 / math.sqrt(64) and spec.group_size == 4
    q, k_cache, v_cache, batch, tables = make_inputs(16, 64, 4, 1, [(1, 1)])
    out = paged_decode(q, k_cache, v_cache, batch, spec)
    assert torch.equal(out[0], v_cache[tables[0][0], 0].expand(4, 64))  # softmax of one logit is 1


def test_page_table_from_the_pool_exact_values():
    cfg = PoolConfig(9, 4, (GroupSpec("full", "full", 2, kv_bytes_per_token=2 * 8 * 4),))
    pool = HybridCachePool(cfg)
    pool.admit("a", list(range(10)))  # blocks 0 1 2
    pool.commit("a", 10)  # blocks 0 and 1 are full, so cached; block 2 (2 tokens) is not
    b = pool.admit("b", list(range(8)) + [50, 51, 52])  # hits 0 1, takes 3
    pool.free("a")  # 2 goes back to the free list, behind 4..8
    c = pool.admit("c", [7] * 21)  # 6 blocks: 4 5 6 7 8 2
    assert b.num_cached_tokens == 8
    batch = paged_batch_from_allocations([b, c], "full", q_lens=[3, 21], page_size=4)
    assert batch.qo_indptr.tolist() == [0, 3, 24]
    assert batch.kv_indptr.tolist() == [0, 3, 9]
    assert batch.kv_indices.tolist() == [0, 1, 3, 4, 5, 6, 7, 8, 2]
    assert batch.kv_last_page_len.tolist() == [3, 1]
    assert batch.kv_indptr.dtype == batch.kv_indices.dtype == torch.int32
    assert batch.kv_lens == (11, 21) and batch.q_lens == (3, 21)
    assert batch.to("cpu").kv_indices.tolist() == batch.kv_indices.tolist()
    grown = pool.grow("b", 12, list(range(8)) + [50, 51, 52, 53])  # decode step: page 3 fills up
    step = paged_batch_from_allocations([grown], "full", q_lens=[1], page_size=4)
    assert step.kv_indices.tolist() == [0, 1, 3] and step.kv_last_page_len.tolist() == [4]
    # a chunk of c: only the first ceil(6 / 4) = 2 of its 6 blocks are read
    chunk = paged_batch_from_allocations([c], "full", q_lens=[6], page_size=4, kv_lens=[6])
    assert chunk.kv_indices.tolist() == [4, 5] and chunk.kv_last_page_len.tolist() == [2]


def test_page_table_errors_say_what_to_change():
    with pytest.raises(ValueError, match="needs 3 pages of 4 tokens but its block table has 2"):
        build_paged_batch([[0, 1]], [9], [1], 4)
    with pytest.raises(ValueError, match="NULL_BLOCK"):
        build_paged_batch([[-1, 5]], [6], [1], 4)
    with pytest.raises(ValueError, match="need 1 <= q_len <= kv_len"):
        build_paged_batch([[0]], [2], [3], 4)
    with pytest.raises(ValueError, match="not a multiple of num_kv_heads"):
        AttentionSpec(6, 4, 64, 16)
    q, k_cache, v_cache, batch, _ = make_inputs(4, 64, 4, 1, [(2, 5)])
    with pytest.raises(ValueError, match="q_len 1 per request"):
        paged_decode(q, k_cache, v_cache, batch, AttentionSpec(4, 1, 64, 4))


def _fill_pool(storage, allocs, layer_kv):
    """Write each request's K/V [layers, T, Hkv, D] pairs into its blocks as the pool lays them out."""
    for a, (k, v) in zip(allocs, layer_kv):
        raw = torch.cat([k, v], dim=-2).flatten(-2).contiguous().view(torch.uint8)
        storage.write_tokens("full", a.group("full").block_table, 0, raw)


def test_reads_pool_blocks_in_place():
    hkv, hq, d, bs, layers = 2, 8, 80, 4, 3
    cfg = PoolConfig(16, bs, (GroupSpec("full", "full", layers, kv_bytes_per_token=2 * hkv * d * 4),))
    pool, storage = HybridCachePool(cfg), BlockStorage(cfg)
    gen = torch.Generator().manual_seed(5)
    allocs = [pool.admit("x", list(range(13))), pool.admit("y", list(range(100, 106)))]
    kv = [tuple(torch.randn(layers, a.num_tokens, hkv, d, generator=gen) for _ in range(2)) for a in allocs]
    _fill_pool(storage, allocs, kv)
    spec = AttentionSpec(hq, hkv, d, bs)
    batch = paged_batch_from_allocations(allocs, "full", q_lens=[5, 6], page_size=bs)
    q = torch.randn(11, hq, d, generator=gen)
    for layer in range(layers):
        k_cache, v_cache = pool_kv_cache(storage, "full", layer, hkv, d, torch.float32)
        assert k_cache.data_ptr() == storage.buffer.data_ptr() + layer * bs * 2 * hkv * d * 4
        assert k_cache.stride() == v_cache.stride() == (cfg.block_bytes // 4, 2 * hkv * d, d, 1)
        got = paged_prefill(q, k_cache, v_cache, batch, spec)
        tables = [list(a.group("full").block_table) for a in allocs]
        want = dense_reference(q, k_cache, v_cache, tables, [(5, 13), (6, 6)], spec)
        assert (got.double() - want).abs().max() <= TOL
        # and the pages hold exactly what was written: token 9 of x in layer `layer`
        assert torch.equal(k_cache[tables[0][2], 1], kv[0][0][layer, 9])
    with pytest.raises(ValueError, match="kv_bytes_per_token=640"):
        pool_kv_cache(storage, "full", 0, hkv, d, torch.float16)


def test_plan_cache_replans_only_for_a_new_batch_spec_or_dtype():
    cache, spec = PlanCache(), AttentionSpec(8, 2, 64, 16)
    batch = build_paged_batch([[0, 1]], [20], [4], 16)
    same_values = build_paged_batch([[0, 1]], [20], [4], 16)
    bf16, f16 = torch.bfloat16, torch.float16
    assert cache.stale("prefill", batch, spec, bf16, bf16)
    assert not cache.stale("prefill", batch, spec, bf16, bf16)  # layers 2..L of the same batch
    assert cache.stale("decode-tc1", batch, spec, bf16, bf16)  # slots are independent
    assert cache.stale("prefill", same_values, spec, bf16, bf16)  # identity, not value
    assert cache.stale("prefill", same_values, AttentionSpec(8, 2, 64, 16, window_left=3), bf16, bf16)
    assert cache.stale("prefill", same_values, AttentionSpec(8, 2, 64, 16, window_left=3), f16, f16)
    assert not cache.stale("prefill", same_values, AttentionSpec(8, 2, 64, 16, window_left=3), f16, f16)
    assert use_tensor_cores(spec, bf16) and not use_tensor_cores(AttentionSpec(4, 2, 64, 16), bf16)
    assert not use_tensor_cores(spec, torch.float32)


def test_out_argument_is_written():
    q, k_cache, v_cache, batch, _ = make_inputs(4, 64, 4, 1, [(2, 5), (1, 3)])
    spec = AttentionSpec(4, 1, 64, 4)
    out = torch.empty_like(q)
    assert paged_prefill(q, k_cache, v_cache, batch, spec, out=out) is out
    assert torch.equal(out, paged_prefill(q, k_cache, v_cache, batch, spec))


# -- GPU: FlashInfer vs the reference ------------------------------------------------------------
needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason=NO_GPU)
GPU_TOL = {torch.float16: 1e-2, torch.bfloat16: 2e-2}
# FlashInfer takes head dims 64/128/256 only (see SUPPORTED_HEAD_DIMS), so the GPU cases keep the CPU
# cases' awkward page sizes, raggedness, windows and soft caps with d=128 where those used d=80.
# Every case runs in bf16; the ragged one also in fp16 (each dtype/variant is a separate JIT build).
PREFILL_GPU_CASES = {
    "page1-decode-and-append": CASES["page1-decode-and-append"],
    "page16-ragged-d128": (16, 128, 8, 2, [(1, 37), (20, 20), (17, 50), (5, 16)], -1, 0.0),
    "page16-window": CASES["page16-window"],
    "page4-d128-window-softcap": (4, 128, 4, 1, [(9, 9), (1, 13), (6, 23)], 5, 2.0),
    "page16-mha-qlen-gt-page": CASES["page16-mha-qlen-gt-page"],
}
PREFILL_GPU_PARAMS = [(c, torch.bfloat16) for c in PREFILL_GPU_CASES] + [("page16-ragged-d128", torch.float16)]
DECODE_CASES = {  # (q_len 1 everywhere) GQA 4 takes the tensor-core decode path, GQA 2 the CUDA-core one
    "decode-gqa4-page1": (1, 64, 8, 2, [(1, 1), (1, 9), (1, 33)], -1, 0.0),
    "decode-gqa2-page16-window": (16, 128, 4, 2, [(1, 16), (1, 17), (1, 70)], 20, 0.0),
    "decode-gqa4-d128-window-softcap": (16, 128, 8, 2, [(1, 5), (1, 50)], 9, 2.0),
}


@pytest.fixture(scope="module")
def runner():
    return FlashInferPagedAttention("cuda")


def test_flashinfer_wrappers_use_the_kernels_sglang_runs(monkeypatch):
    """Runs on CPU with a recording stand-in for the flashinfer module: SGLang 0.5.23's flashinfer backend
    builds its paged prefill and decode wrappers with backend="fa2"; FlashInfer's default ("auto") picks
    FA3 on Hopper, another kernel, whose JIT build did not finish in the GPU check's time on an H200."""
    made = []

    class Wrapper:
        def __init__(self, *args, **kwargs):
            made.append((type(self).__name__, kwargs.get("backend")))

        def plan(self, *args, **kwargs):
            pass

        def run(self, q, kv, out=None):
            return q

    fake = types.SimpleNamespace(BatchPrefillWithPagedKVCacheWrapper=type("Prefill", (Wrapper,), {}),
                                 BatchDecodeWithPagedKVCacheWrapper=type("Decode", (Wrapper,), {}))
    monkeypatch.setitem(sys.modules, "flashinfer", fake)
    monkeypatch.setattr(torch, "zeros", lambda *a, **k: torch.empty(0))  # no CUDA workspace on CPU
    runner = FlashInferPagedAttention.__new__(FlashInferPagedAttention)
    monkeypatch.setattr(torch, "device", lambda d: types.SimpleNamespace(type="cuda"))
    runner.__init__("cuda")
    q, k_cache, v_cache, batch, _ = make_inputs(16, 128, 8, 2, [(1, 20), (1, 5)], dtype=torch.bfloat16)
    runner.prefill(q, k_cache, v_cache, batch, AttentionSpec(8, 2, 128, 16))
    for hq in (8, 2):  # tensor-core and CUDA-core decode
        runner.decode(q[:, :hq], k_cache, v_cache, batch, AttentionSpec(hq, 2, 128, 16))
    assert made == [("Prefill", "fa2"), ("Decode", "fa2"), ("Decode", "fa2")]


def test_flashinfer_refuses_head_dims_it_would_get_wrong():
    """Runs on CPU: the check is what stands between a d=80 layer and a CUDA illegal memory access."""
    for d in SUPPORTED_HEAD_DIMS:
        check_supported(AttentionSpec(8, 2, d, 16))
    for d in (80, 96, 72):
        with pytest.raises(ValueError, match=rf"supports head_dim in \(64, 128, 256\), got {d}"):
            check_supported(AttentionSpec(8, 2, d, 16))


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize(("case", "dtype"), PREFILL_GPU_PARAMS, ids=[f"{c}-{d}" for c, d in PREFILL_GPU_PARAMS])
def test_flashinfer_prefill_matches_naive(case, dtype, runner):
    _compare_on_gpu(runner, PREFILL_GPU_CASES[case], dtype, paged_prefill)


@pytest.mark.gpu
@needs_gpu
def test_flashinfer_raises_on_head_dim_80_before_any_kernel(runner):
    q, k_cache, v_cache, batch, _ = make_inputs(16, 80, 8, 2, [(3, 20)], dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="got 80"):
        paged_prefill(q.cuda(), k_cache.cuda(), v_cache.cuda(), batch, AttentionSpec(8, 2, 80, 16), runner)
    torch.cuda.synchronize()  # the context is still healthy: nothing was launched


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16], ids=str)
@pytest.mark.parametrize("case", list(DECODE_CASES), ids=list(DECODE_CASES))
def test_flashinfer_decode_matches_naive(case, dtype, runner):
    _compare_on_gpu(runner, DECODE_CASES[case], dtype, paged_decode)


def _compare_on_gpu(runner, case, dtype, call):
    ps, d, hq, hkv, reqs, window, cap = case
    spec = _spec(ps, d, hq, hkv, window, cap)
    # finite garbage in unowned slots: a wrongly read slot gives a large error, not a NaN*0 puzzle
    q, k_cache, v_cache, batch, _ = make_inputs(ps, d, hq, hkv, reqs, dtype=dtype, fill=100.0)
    want = call(q, k_cache, v_cache, batch, spec).float()  # CPU reference, fp32 accumulate
    got = call(q.cuda(), k_cache.cuda(), v_cache.cuda(), batch, spec, runner)
    assert got.dtype == dtype and got.shape == q.shape
    torch.testing.assert_close(got.float().cpu(), want, atol=GPU_TOL[dtype], rtol=GPU_TOL[dtype])


@pytest.mark.gpu
@needs_gpu
def test_flashinfer_reads_pool_views_and_reuses_its_plan(runner, monkeypatch):
    """Strided K/V views of the pool's uint8 buffer (K and V interleaved per token), one plan for
    all layers of a batch."""
    hkv, hq, d, bs, layers, dtype = 2, 8, 128, 16, 2, torch.bfloat16
    cfg = PoolConfig(32, bs, (GroupSpec("full", "full", layers, kv_bytes_per_token=2 * hkv * d * 2),))
    pool, storage = HybridCachePool(cfg), BlockStorage(cfg, device="cuda")
    gen = torch.Generator().manual_seed(9)
    allocs = [pool.admit("x", list(range(45))), pool.admit("y", list(range(200, 217)))]
    kv = [tuple(torch.randn(layers, a.num_tokens, hkv, d, generator=gen).to(dtype).cuda()
                for _ in range(2)) for a in allocs]
    _fill_pool(storage, allocs, kv)
    spec = AttentionSpec(hq, hkv, d, bs)
    batch = paged_batch_from_allocations(allocs, "full", q_lens=[20, 17], page_size=bs)
    q = torch.randn(37, hq, d, generator=gen).to(dtype)
    plans = []
    for layer in range(layers):
        k_cache, v_cache = pool_kv_cache(storage, "full", layer, hkv, d, dtype)
        got = paged_prefill(q.cuda(), k_cache, v_cache, batch, spec, runner)
        if layer == 0:  # count the plans of the remaining layers
            monkeypatch.setattr(runner._prefill, "plan", _counting(runner._prefill.plan, plans))
        want = paged_prefill(q, k_cache.cpu(), v_cache.cpu(), batch, spec).float()
        torch.testing.assert_close(got.float().cpu(), want, atol=2e-2, rtol=2e-2)
    assert plans == []  # one plan per batch, reused by every layer


def _counting(fn, calls):
    def wrapped(*args, **kwargs):
        calls.append(args)
        return fn(*args, **kwargs)
    return wrapped
