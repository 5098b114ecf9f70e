"""Random prompt trees (prfaas_sgl/workload/prompt_trees.py) over a tiny model's corpus, and the check the
cache pool's differential tests all run."""
from __future__ import annotations

from typing import Callable

from prfaas_sgl.workload.prompt_trees import prompt_tree as workload_tree

from .pd import generate_body
from .prompts import prompt_ids

NEW = 8
# Not bit-exact by construction: a hit resumes mid-prompt, so the pool's server cuts the prompt into other
# chunk shapes than the reference, and float32 sums taken in another order differ by ~1e-6 (measured
# <= 3.3e-6 on 30 prompts). The bound is 30x that, far below a real state error (a bf16 conv state moved
# log-probs by up to 1e-2).
LOGPROB_BOUND = 1e-4


def prompt_tree(path: str, seed: int, n: int, max_len: int = 1500) -> list[list[int]]:
    return workload_tree(prompt_ids(path, 6000, seed=seed), seed, n, max_len)


def check_tree(prompts: list[list[int]], through: Callable[[dict], dict], reference: Callable[[dict], dict],
               cached: Callable[[dict], int]) -> tuple[int, float]:
    """Sends every prompt through the route under test and the no-cache reference; asserts equal greedy
    tokens and log-probs within LOGPROB_BOUND. Returns (prompts that hit, per `cached`; worst |dlogprob|)."""
    hits, worst = 0, 0.0
    for ids in prompts:
        body = {**generate_body(ids, NEW), "return_logprob": True}
        got, ref = through(body), reference(body)
        assert got.get("output_ids") == ref["output_ids"], (len(ids), got.get("meta_info", got))
        pairs = zip(got["meta_info"]["output_token_logprobs"], ref["meta_info"]["output_token_logprobs"])
        worst = max(worst, *(abs(a[0] - b[0]) for a, b in pairs))
        assert worst <= LOGPROB_BOUND, (len(ids), worst)
        hits += cached(got) > 0
    return hits, worst
