"""Where prfaas_hybrid keeps linear states: wherever SGLang's no_buffer strategy holds one on a block
boundary (each chunk end, the prompt's end, a finished request's end), not only on the chunk grid; a
match reports the branch point where its KV reaches past its state, and the unified slab's admission
ends the first chunk there (or on a block boundary when the budget cuts it), so the next request
sharing the prefix hits all of it. SGLang's tree keeps a state at each of those points too
(MambaComponent.prepare_for_caching_req), so these hits are what it would give.

Runs over the real slab (SGLang's CPU pools, 16-token blocks, 32-token chunks) and SGLang's own
PrefillAdder."""
from __future__ import annotations

from array import array

from sglang.srt.managers.schedule_batch import Req
from sglang.srt.mem_cache.base_prefix_cache import MatchPrefixParams
from sglang.srt.mem_cache.radix_cache import RadixKey
from sglang.srt.sampling.sampling_params import SamplingParams

from tests.fast.test_cachepool_slab_admission import _admit, _run, _server
from tests.fast import test_cachepool_slab_backend as B
from tests.fast.test_cachepool_slab_backend import BS, CHUNK, _serve
from tests.support.sglang_context import sglang_context  # noqa: F401 - autouse


def _match(cache, tokens: list[int]):
    """A scheduler match of a new request (SGLang passes the prompt minus its last token)."""
    req = Req("probe", "", array("q", tokens), SamplingParams(max_new_tokens=1))
    return cache.match_prefix(MatchPrefixParams(key=RadixKey(array("q", tokens[:-1])), req=req, cow_mamba=True))


def _req(rid: str, tokens: list[int]) -> Req:
    return Req(rid, "", array("q", tokens), SamplingParams(max_new_tokens=4, temperature=0.0))


def test_a_prompt_ending_off_the_chunk_grid_is_hit_to_its_end():
    """80 tokens in 32-token chunks: states at 32 and 64 (chunk ends) and 80 (its end, a block boundary
    but not a chunk multiple). A next turn extending it hits all 80; the grid alone gave 64."""
    cache, pool, _, _ = _server()
    prompt = list(range(1, 81))
    _serve(cache, pool, prompt)
    assert _match(cache, prompt + list(range(500, 520))).device_prefix_len == 80
    cache.check_integrity()


def test_an_end_inside_a_block_has_no_state_and_the_hit_stops_at_the_chunk_end_before_it():
    """88 tokens: the state at 88 lies inside block 5, so no block can name it; the hit is the chunk end
    at 64, and the KV of block [64, 80) is still cached (a branch point past the hit)."""
    cache, pool, _, _ = _server()
    prompt = list(range(1, 89))
    _serve(cache, pool, prompt)
    m = _match(cache, prompt + list(range(500, 520)))
    assert m.device_prefix_len == 64 and m.mamba_branching_seqlen == 80
    cache.check_integrity()


def test_a_match_reports_where_its_kv_reaches_past_its_state():
    """A shared prefix of 48 tokens ends inside the chunk [32, 64): the hit is 32 (a state), the KV
    reaches 48, and the match says so (SGLang's mamba_branching_seqlen); a full hit reports none."""
    cache, pool, _, _ = _server()
    prompt = list(range(1, 81))
    _serve(cache, pool, prompt)
    m = _match(cache, prompt[:48] + list(range(900, 940)))
    assert m.device_prefix_len == 32 and m.mamba_branching_seqlen == 48
    assert _match(cache, prompt + [7]).mamba_branching_seqlen is None


def test_admission_ends_the_first_chunk_at_the_branch_point_and_the_next_request_hits_it():
    cache, pool, tok, _ = _server()
    shared = list(range(1, 49))
    _serve(cache, pool, shared + list(range(200, 232)))  # 80 tokens: states at 32, 64, 80
    a = _req("a", shared + list(range(300, 340)))
    assert _admit(cache, tok, [a], chunk=4 * CHUNK) == [a]
    assert (a.prefix_len, a.extend_end - a.prefix_len) == (32, 16)  # [32, 48): a chunk of its own, ending at the branch
    # the chunk's end is checkpointed as the scheduler does it (stash_chunked_request -> checkpoint_kv_cache)
    _run(cache, pool, [a])
    cache.checkpoint(a, up_to=48)
    assert _match(cache, shared + list(range(400, 440))).device_prefix_len == 48
    cache.check_integrity()


def test_a_chunk_cut_short_by_the_budget_ends_on_a_block_boundary():
    """A 40-token chunk budget would end the first chunk at 40, inside block [32, 48), where no state
    can be cached; it ends at 32 instead."""
    cache, _, tok, _ = _server()
    a = _req("a", list(range(1, 101)))
    assert _admit(cache, tok, [a], chunk=40) == [a]
    assert (a.prefix_len, a.extend_end - a.prefix_len) == (0, 2 * BS)


def test_after_a_chunk_ended_at_a_branch_point_the_pass_admits_only_whole_prompts():
    """The branch cut leaves budget, but SGLang tracks one chunked request per pass (PrefillAdder's
    new_chunked_req): a second long prompt would have been chunked too and lost. It waits; a short
    prompt that fits whole still joins the batch."""
    cache, pool, tok, _ = _server()
    shared = list(range(1, 49))
    _serve(cache, pool, shared + list(range(200, 232)))
    a, b = _req("a", shared + list(range(300, 340))), _req("b", list(range(600, 730)))
    assert _admit(cache, tok, [a, b], chunk=4 * CHUNK) == [a]  # b (130 tokens) does not fit whole in 112
    assert a.extend_end - a.prefix_len == 16
    c, d = _req("c", shared + list(range(400, 440))), _req("d", list(range(800, 830)))
    assert _admit(cache, tok, [c, d], chunk=4 * CHUNK) == [c, d]  # d (30 tokens) fits whole
    assert d.extend_end == 30


def test_chunk_ends_align_to_the_index_block_not_to_a_larger_slab_block(monkeypatch):
    """A state larger than 16 tokens of KV makes slab blocks larger than the index block (80 tokens for
    the benchmark's model): flooring to the slab block cut a 512-token chunk to 480, one more pass per
    long prompt. A 128-token chunk stays 128 here, with 96-token slab blocks."""
    big = B.NS(shape=B.NS(conv=[(2, 3)], temporal=(9, 40)), dtype=B.PARAMS.dtype, is_kda=False, layers=[1, 2])
    monkeypatch.setattr(B, "PARAMS", big)
    cache, _, tok, _ = _server()
    assert tok.bs > cache.bs == BS and 128 % tok.bs
    a = _req("a", list(range(1, 201)))
    assert _admit(cache, tok, [a], chunk=128) == [a]
    assert a.extend_end == 128
