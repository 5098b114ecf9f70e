"""The SGLang side of scripts/bench_cachepool_gpu_sizes.py drives SGLang's own tree through the calls its
scheduler makes per request (checkpoint per chunk end, and at release the finished checkpoint, the row
free, unlock, on_release), and leaves the tree and both allocators whole after a mix: every KV slot and
every state slot is either free or held by the tree exactly once, nothing stays locked.

A small pool (6,000 KV slots, 12 state slots) so the mix evicts KV and states; 128-token chunks so a
request checkpoints several times.
"""
from __future__ import annotations

import random
import sys
from array import array
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))

import _cachepool_sglang_side as side  # noqa: E402
import bench_cachepool_sglang_hybrid as peer  # noqa: E402

KV, SLOTS, CHUNK, MAX_CONTEXT = 6_000, 12, 128, 2_048


def _text(rng: random.Random, lo: int, hi: int) -> array:
    return array("q", (rng.randrange(50_000) for _ in range(rng.randint(lo, hi))))


def _mix(n: int, seed: int) -> list[array]:
    """Shared system prompts + questions, fresh documents, conversations that grow turn by turn."""
    rng = random.Random(seed)
    systems = [_text(rng, 200, 700) for _ in range(3)]
    convs = [array("q", rng.choice(systems)) for _ in range(3)]
    out = []
    for _ in range(n):
        kind = rng.random()
        if kind < 0.5:
            out.append(rng.choice(systems) + _text(rng, 10, 150))
        elif kind < 0.65:
            out.append(_text(rng, 800, 1_500))
        else:
            c = rng.randrange(len(convs))
            if len(convs[c]) > 1_600:
                convs[c] = array("q", rng.choice(systems))
            convs[c] = convs[c] + _text(rng, 30, 200)
            out.append(convs[c])
    return out


@pytest.fixture()
def tree():
    alloc, pool, cache = peer.build(KV, SLOTS, MAX_CONTEXT, in_flight=1)
    return side.Sglang(alloc, pool, cache, CHUNK)


def _calls(obj, name: str) -> list:
    """Record the calls of obj.name (an instance attribute shadows the method)."""
    seen, real = [], getattr(obj, name)

    def wrapper(*args, **kwargs):
        seen.append((args, kwargs))
        return real(*args, **kwargs)

    setattr(obj, name, wrapper)
    return seen


def test_a_request_runs_the_schedulers_tree_calls(tree):
    cache = tree.cache
    into_tree, row_frees, releases = (_calls(cache, name) for name in
                                      ("checkpoint_into_tree", "free_kv_row", "on_release"))
    ids = _text(random.Random(1), 1_000, 1_000)
    assert tree.serve(ids, "a") == 0
    # chunk ends 128 .. 896, then the finished checkpoint at 1,000
    assert [kw["up_to"] for _, kw in into_tree] == list(range(CHUNK, 1_000, CHUNK)) + [1_000]
    assert len(row_frees) == 1 and len(releases) == 1 and releases[0][1] == {"checkpointed": True}
    # the prompt's state lies at its end, so a re-send hits up to the last chunk end before it
    assert tree.serve(ids, "b") == 896
    # a request sharing 950 tokens: its own KV of [896, 950) duplicates the tree's, and its row is
    # rewritten onto the tree's slots (the duplicates go back to the allocator: the mix test)
    ids2 = ids[:950] + _text(random.Random(2), 100, 100)
    assert tree.serve(ids2, "c") == 896
    path = cache.path_device_indices(tree.match(ids2 + array("q", [7]), None).last_device_node)
    assert len(path) == 1_050
    assert torch.equal(tree.pool.req_to_token[0, :1_050].to(torch.int64), path)


def test_the_tree_and_allocators_stay_whole_after_a_mix(tree):
    cache, alloc, states = tree.cache, tree.alloc, tree.pool.mamba_allocator
    hits = [tree.serve(ids, f"mix-{i}") for i, ids in enumerate(_mix(60, seed=0))]
    assert sum(hits) > 0
    cache.sanity_check()
    assert cache.full_protected_size() == 0 and cache.mamba_protected_size() == 0
    kv = torch.cat([cache.all_values_flatten(), alloc.free_pages, alloc.release_pages])
    assert sorted(kv.tolist()) == list(range(1, KV + 1))
    assert cache.full_evictable_size() + alloc.available_size() == KV
    held = torch.cat([cache.all_mamba_values_flatten().flatten(), states.free_slots])
    assert sorted(held.tolist()) == list(range(1, SLOTS + 1))
    assert cache.mamba_evictable_size() + states.available_size() == SLOTS
