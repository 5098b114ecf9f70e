"""Reference outputs, computed before the load: the greedy tokens of a colocated SGLang server running
batch 1 with the same chunked prefill. (HF transformers greedy would spare a server start, but its
reference GDN kernels take ~5-30 s per 1,000-token prompt on this CPU.)

A prompt whose greedy choice is a near tie somewhere in its output (top-1 and top-2 log-probabilities
closer than TIE_LOGPROB) is replaced by another prompt of the same length: float rounding differences
between two correct paths (HF vs SGLang kernels, chunk boundaries under batching) can flip such a token,
and the campaign's "wrong tokens" must only ever mean a real bug.
"""
from __future__ import annotations

import json
import random
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from .plan import PlannedRequest, with_prompt_seed

TIE_LOGPROB = 1e-3
MAX_REDRAWS = 5


@dataclass(frozen=True, slots=True)
class Reference:
    output_ids: list[int]
    min_margin: float  # smallest top-1 minus top-2 log-probability over the output tokens
    redraws: int  # prompts thrown away for near ties before this one


def generate_body(input_ids: list[int], max_new_tokens: int) -> dict:
    return {"input_ids": input_ids,
            "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 0.0, "ignore_eos": True}}


def colocated_greedy(url: str, ids: list[int], max_new_tokens: int) -> tuple[list[int], float]:
    """(output ids, min top-1 minus top-2 log-probability) from a colocated SGLang server."""
    body = {**generate_body(ids, max_new_tokens), "return_logprob": True, "top_logprobs_num": 2}
    req = urllib.request.Request(url + "/generate", json.dumps(body).encode(), {"content-type": "application/json"})
    with urllib.request.urlopen(req, timeout=300) as r:
        out = json.loads(r.read())
    tops = out["meta_info"]["output_top_logprobs"]
    margins = [t[0][0] - t[1][0] for t in tops if t and len(t) >= 2]
    return out["output_ids"], min(margins, default=float("inf"))


def _one(url: str, req: PlannedRequest, max_new_tokens: int) -> tuple[PlannedRequest, Reference]:
    rng = random.Random(req.prompt_seed)
    for redraws in range(MAX_REDRAWS + 1):
        ids, margin = colocated_greedy(url, req.input_ids(), max_new_tokens)
        if margin >= TIE_LOGPROB or redraws == MAX_REDRAWS:
            return req, Reference(ids, margin, redraws)
        req = with_prompt_seed(req, rng.getrandbits(63))
    raise AssertionError("unreachable")


def references(url: str, plan: tuple[PlannedRequest, ...], max_new_tokens: int,
               workers: int = 2) -> tuple[tuple[PlannedRequest, ...], dict[int, Reference]]:
    """(the plan with near-tie prompts replaced, reference per request index). The colocated server runs
    one request at a time; two client threads keep it busy between answers."""
    with ThreadPoolExecutor(workers) as pool:
        done = list(pool.map(lambda r: _one(url, r, max_new_tokens), plan))
    return tuple(r for r, _ in done), {r.index: ref for r, ref in done}
