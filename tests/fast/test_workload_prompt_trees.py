"""prompt_tree: seeded, capped, and it draws every kind of prompt a prefix cache must get right."""
from __future__ import annotations

import random

import pytest

from prfaas_sgl.workload.prompt_trees import kinds, prompt_tree

_RNG = random.Random(0)
TEXT = [_RNG.randrange(512) for _ in range(6000)]


def test_the_same_seed_gives_the_same_tree_and_another_seed_another():
    assert prompt_tree(TEXT, 3, 20) == prompt_tree(TEXT, 3, 20)
    assert prompt_tree(TEXT, 3, 20) != prompt_tree(TEXT, 4, 20)


def test_prompts_are_capped_at_their_end_and_the_tree_has_resends_and_shared_prefixes():
    tree = prompt_tree(TEXT, 5, 60, max_len=700)
    assert max(map(len, tree)) <= 700 and min(map(len, tree)) >= 1
    counts = kinds(tree)
    assert sum(counts.values()) == 60
    assert counts["resend"] >= 3 and counts["shares_prefix"] >= 10 and counts["fresh"] >= 5, counts


def test_a_text_too_short_for_its_fresh_slices_is_refused():
    with pytest.raises(ValueError, match="needs >= 1300"):
        prompt_tree(TEXT[:500], 0, 3)
