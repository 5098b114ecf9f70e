"""The campaign's load, drawn from a seed: which requests, how long their prompts are, when they are sent.

Prompts are random token ids (no tokenizer, no shared prefixes: every request is a full prefill, so a
wrong KV transfer cannot hide behind a cache hit). Short prompts (<= the router's threshold) take the
local prefill route, long ones the remote (PrfaaS) route. Arrivals are a seeded Poisson process spread
over `span_s`; the runner also caps requests in flight.
"""
from __future__ import annotations

import random
from dataclasses import dataclass

FIRST_ID = 3  # ids 0..2 are the tiny tokenizer's special tokens


@dataclass(frozen=True, slots=True)
class LoadSpec:
    n_requests: int
    span_s: float  # arrivals spread over [0, span_s)
    threshold: int  # router threshold (tokens): short <= threshold < long
    short_len: tuple[int, int] = (16, 160)
    long_len: tuple[int, int] = (400, 1600)
    long_frac: float = 0.5
    vocab_size: int = 512

    def __post_init__(self) -> None:
        if self.n_requests < 1 or self.span_s <= 0:
            raise ValueError("n_requests must be >= 1 and span_s > 0")
        if not 1 <= self.short_len[0] <= self.short_len[1] <= self.threshold < self.long_len[0] <= self.long_len[1]:
            raise ValueError(f"need 1 <= short_len <= threshold ({self.threshold}) < long_len, got "
                             f"short {self.short_len}, long {self.long_len}")
        if not 0.0 <= self.long_frac <= 1.0:
            raise ValueError(f"long_frac must be in [0, 1], got {self.long_frac}")


@dataclass(frozen=True, slots=True)
class PlannedRequest:
    index: int
    kind: str  # "short" (local route) | "long" (remote route)
    n_tokens: int
    prompt_seed: int
    send_at_s: float

    def input_ids(self, vocab_size: int = 512) -> list[int]:
        rng = random.Random(self.prompt_seed)
        return [rng.randrange(FIRST_ID, vocab_size) for _ in range(self.n_tokens)]


def make_plan(spec: LoadSpec, seed: int) -> tuple[PlannedRequest, ...]:
    """Requests in send order; the same (spec, seed) always gives the same plan."""
    rng = random.Random(seed)
    # A Poisson process conditioned on n arrivals in [0, span_s) puts them at sorted uniform times.
    times = sorted(rng.uniform(0.0, spec.span_s) for _ in range(spec.n_requests))
    out = []
    for i, t in enumerate(times):
        long = rng.random() < spec.long_frac
        lo, hi = spec.long_len if long else spec.short_len
        out.append(PlannedRequest(i, "long" if long else "short", rng.randint(lo, hi),
                                  rng.getrandbits(63), round(t, 3)))
    return tuple(out)


def make_probes(spec: LoadSpec, seed: int, n: int) -> tuple[PlannedRequest, ...]:
    """Recovery probes sent one by one after the faults, short and long alternately (both routes), indexed
    after the load's requests."""
    rng = random.Random(f"probes-{seed}")
    kinds = ("short", "long") * n
    return tuple(PlannedRequest(spec.n_requests + i, kinds[i], rng.randint(*(spec.long_len if kinds[i] == "long"
                                else spec.short_len)), rng.getrandbits(63), 0.0) for i in range(n))


def with_prompt_seed(req: PlannedRequest, prompt_seed: int) -> PlannedRequest:
    """The same slot in the plan with another prompt (the reference found a near tie in the first one)."""
    return PlannedRequest(req.index, req.kind, req.n_tokens, prompt_seed, req.send_at_s)
