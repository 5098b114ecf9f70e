"""The tier benchmark's conversation trace: seeded, each turn extends the previous one, and sized so its
working set is the asked multiple of the device pool (below it the benchmark would not need a tier)."""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _bench():
    spec = importlib.util.spec_from_file_location("bench_cachepool_tiers", ROOT / "scripts" / "bench_cachepool_tiers.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up by name
    spec.loader.exec_module(mod)
    return mod


def test_each_turn_extends_the_previous_prompt_by_reply_and_user_message():
    b = _bench()
    rounds = b.conversation_trace(5, conversations=3, turns=4, context=100, user=10, reply=7, vocab=1000)
    assert [len(r) for r in rounds] == [3, 3, 3, 3]
    for c in range(3):
        prompts = [rounds[t][c].prompt for t in range(4)]
        assert len(prompts[0]) == 110
        for prev, cur in zip(prompts, prompts[1:]):
            assert cur[:len(prev)] == prev and len(cur) == len(prev) + 17
    assert rounds[0][0].prompt[:100] != rounds[0][1].prompt[:100]  # private contexts
    assert rounds == b.conversation_trace(5, 3, 4, 100, 10, 7, 1000)
    assert rounds != b.conversation_trace(6, 3, 4, 100, 10, 7, 1000)


def test_the_working_set_is_at_least_the_asked_multiple_of_the_pool():
    b = _bench()
    for ratio in (4, 5, 10):
        n = b.conversations_for(ratio, 1024, turns=4, context=512, user=64, reply=32)
        ws = b.working_set_tokens(b.conversation_trace(1, n, 4, 512, 64, 32, 1000))
        assert ratio * 1024 <= ws < ratio * 1024 + 864  # one conversation more would overshoot
