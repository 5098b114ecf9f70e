"""Workloads: sessions of one or more turns, each turn a prompt described by hash-id blocks.

Everything is described in *blocks*, like a Mooncake trace: a turn's prompt is the concatenation of its
hash ids' block texts, the last block cut to fit ``input_len``. Turns of one session extend the previous
turn's prompt, so turn k's prompt is a token prefix of turn k+1's (the cut block is a prefix of the full
block). A shared prefix ("system prompt") is a whole number of blocks shared by all sessions of a group:

    turn 0:  [ group g prefix blocks | private blocks ... cut ]
    turn 1:  [ group g prefix blocks | private blocks ............... cut ]
              <- shared by the group -><- shared with turn 0 -><- new ->

Seeding: one ``numpy.random.SeedSequence(seed)`` spawns independent streams for arrivals and lengths,
so changing the arrival process does not change the lengths.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

import numpy as np

from prfaas_sgl.workload.arrivals import ArrivalSpec
from prfaas_sgl.workload.lengths import parse_length_dist, scaled
from prfaas_sgl.workload.traces import TraceRecord


@dataclass(frozen=True, slots=True)
class Turn:
    input_len: int  # prompt tokens
    output_len: int  # max_tokens asked for
    hash_ids: tuple[int, ...]  # one id per block of the workload's block_size tokens


@dataclass(frozen=True, slots=True)
class Session:
    index: int
    start_s: float  # open-loop start, seconds from the run's start
    turns: tuple[Turn, ...]
    think_s: float = 0.0  # pause between a turn's end and the next turn's send


@dataclass(frozen=True, slots=True)
class Workload:
    sessions: tuple[Session, ...]
    block_size: int  # tokens per hash id, after scaling

    @property
    def n_requests(self) -> int:
        return sum(len(s.turns) for s in self.sessions)


@dataclass(frozen=True, slots=True)
class SyntheticSpec:
    """Lengths are in tokens before ``scale``; the scaled block size is round(block_size * scale)."""

    n_sessions: int
    input_dist: str = "paper"
    output_dist: str = "fixed:1024"
    scale: float = 1.0
    turns: int = 1
    followup_dist: str = "fixed:256"  # new user tokens added per later turn
    think_s: float = 0.0
    shared_prefix_len: int = 0  # rounded up to whole blocks
    prefix_groups: int = 1
    block_size: int = 512
    max_context: int = 131072  # a session ends before a turn's prompt would pass this

    def __post_init__(self) -> None:
        for spec in (self.input_dist, self.output_dist, self.followup_dist):
            parse_length_dist(spec)  # raises with the expected form
        if self.n_sessions < 0 or self.turns < 1 or self.prefix_groups < 1:
            raise ValueError("need --num-sessions >= 0, --turns >= 1 and --prefix-groups >= 1")
        if self.max_context < 1:
            raise ValueError("--max-context must be >= 1 token")
        if self.scale <= 0 or self.block_size < 1 or self.shared_prefix_len < 0 or self.think_s < 0:
            raise ValueError("need --scale > 0, --block-size >= 1, --shared-prefix >= 0, --think-time >= 0")


def scaled_block_size(block_size: int, scale: float) -> int:
    return max(1, round(block_size * scale))


def _seed_streams(seed: int) -> tuple[np.random.Generator, np.random.Generator]:
    arrivals, lengths = np.random.SeedSequence(seed).spawn(2)
    return np.random.default_rng(arrivals), np.random.default_rng(lengths)


def synthesize(spec: SyntheticSpec, arrival: ArrivalSpec | None, seed: int) -> Workload:
    """Build a seeded workload; ``arrival=None`` (closed loop) gives every session start 0."""
    arr_rng, len_rng = _seed_streams(seed)
    n = spec.n_sessions
    starts = arrival.times(arr_rng, n) if arrival else np.zeros(n)
    bs = scaled_block_size(spec.block_size, spec.scale)
    cap = max(1, round(spec.max_context * spec.scale))
    first = scaled(parse_length_dist(spec.input_dist).sample(len_rng, n), spec.scale)
    outs = scaled(parse_length_dist(spec.output_dist).sample(len_rng, n * spec.turns), spec.scale)
    follow = scaled(parse_length_dist(spec.followup_dist).sample(len_rng, n * spec.turns), spec.scale)
    next_id = itertools.count()
    prefix_blocks = math.ceil(round(spec.shared_prefix_len * spec.scale) / bs) if spec.shared_prefix_len else 0
    groups = [tuple(next(next_id) for _ in range(prefix_blocks)) for _ in range(spec.prefix_groups)]
    sessions = []
    for s in range(n):
        prefix = groups[s % spec.prefix_groups]
        row = slice(s * spec.turns, (s + 1) * spec.turns)
        turns = _session_turns(prefix, bs, int(first[s]), outs[row], follow[row], cap, next_id)
        sessions.append(Session(s, float(starts[s]), turns, spec.think_s))
    return Workload(tuple(sessions), bs)


def _session_turns(prefix: tuple[int, ...], bs: int, first_len: int, outs: np.ndarray,
                   follow: np.ndarray, cap: int, next_id: itertools.count) -> tuple[Turn, ...]:
    """Turns of one session; stops early when the context would pass ``cap`` tokens (keeps >= 1 turn)."""
    private: list[int] = []
    length = len(prefix) * bs + first_len
    turns: list[Turn] = []
    for k in range(len(outs)):
        if k > 0:
            length += int(outs[k - 1]) + int(follow[k])
            if length > cap:
                break
        while (len(prefix) + len(private)) * bs < length:
            private.append(next(next_id))
        turns.append(Turn(length, int(outs[k]), prefix + tuple(private)))
    return tuple(turns)


def from_trace(records: list[TraceRecord], block_size: int = 512, scale: float = 1.0,
               speedup: float = 1.0) -> Workload:
    """One single-turn session per record; timestamps divided by ``speedup``, lengths times ``scale``."""
    if speedup <= 0 or scale <= 0:
        raise ValueError("need --trace-speedup > 0 and --scale > 0")
    t0 = records[0].timestamp_ms if records else 0.0
    sessions = tuple(
        Session(i, (r.timestamp_ms - t0) / 1000.0 / speedup,
                (Turn(max(1, round(r.input_length * scale)), max(1, round(r.output_length * scale)),
                      r.hash_ids),))
        for i, r in enumerate(records)
    )
    return Workload(sessions, scaled_block_size(block_size, scale))


def to_trace(workload: Workload) -> list[TraceRecord]:
    """Flatten to trace records; later turns are stamped start + k * think time (open-loop replay)."""
    out = [
        TraceRecord(round((s.start_s + k * s.think_s) * 1000.0, 3), t.input_len, t.output_len, t.hash_ids)
        for s in workload.sessions
        for k, t in enumerate(s.turns)
    ]
    out.sort(key=lambda r: r.timestamp_ms)
    return out
