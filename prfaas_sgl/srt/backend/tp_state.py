"""Mamba/GDN/KDA state slots between different attention-TP sizes: which bytes of a prefill
rank's slot go to which bytes of a decode rank's slot, SGLang 0.5.23's arithmetic restated
(disaggregation/utils.py `compute_mamba_state_slice_blocks` / `compute_mamba_state_slice_byte_blocks`)
so CPU CI needs neither Triton nor SGLang's pools.

A state tensor's slot is [outer][dim][rest]: `dim` is the TP-sharded axis (heads of a temporal state
[heads, dk, dv]; channels of a GDN conv state [conv_dim, k-1]); `outer` rows come before it (KDA's conv
state is [k-1, conv_dim], so outer = k-1). A GDN/KDA conv dim is cat([q, k, v]), each sub-block sharded
across TP on its own ("shard groups", full sizes), so a rank's slot is [q_r | k_r | v_r]:

    scatter, prefill TP 1 → decode TP 2 (decode rank 1):    aggregation, prefill TP 2 → decode TP 1:
    src |q0 q1|k0 k1|v0 v1|   three runs: q1, k1, v1        P0 |q0|k0|v0| ─▶ D |q0 . |k0 . |v0 . |
    dst |q1|k1|v1|            the whole slot, in order      P1 |q1|k1|v1| ─▶ D |. q1 |. k1 |. v1 |

A temporal state is one block per outer row (one head range). `dim` 0 marks a state replicated across
attention TP: the whole slot, from one elected source. The facts come from SGLang's KVArgs
(state_dim_per_tensor, state_slice_outer_counts, state_conv_shard_groups); each side knows its own and
derives the peer's from the two TP sizes, so no message carries them.
"""
from __future__ import annotations

import enum
import functools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from prfaas_sgl.transfer.items import ByteRuns

Block = tuple[int, int, int]  # (src start, dst start, count), in dims or bytes


class Side(enum.Enum):
    """Which end of a transfer a rank is on: the prefill sends, the decode receives."""

    PREFILL = "prefill"
    DECODE = "decode"


@dataclass(frozen=True, slots=True)
class StateRuns:
    """One state slot's byte runs on each side: the same bytes, in the same stream order."""

    src: ByteRuns
    dst: ByteRuns

    def on(self, side: Side) -> ByteRuns:
        return self.src if side is Side.PREFILL else self.dst


@dataclass(frozen=True, slots=True)
class StateTensor:
    """One state buffer at one side's attention TP: `item_len` bytes per slot, `dim` entries on the sharded
    axis (0: replicated), `outer` rows before it, `groups` full sub-block dims of a conv state (or None)."""

    item_len: int
    dim: int
    outer: int = 1
    groups: tuple[int, ...] | None = None

    def at(self, tp: int, other_tp: int) -> "StateTensor | None":
        """The same tensor on a rank at `other_tp` (this one at `tp`), or None if it does not shard so."""
        if self.dim == 0:
            return self
        full, per = self.dim * tp, self.dim * self.outer
        if full % other_tp or self.item_len % per:
            return None
        if self.groups and sum(self.groups) == full and any(g % tp or g % other_tp for g in self.groups):
            return None  # a q/k/v sub-block that does not split evenly on both sides
        dim = full // other_tp
        return StateTensor(dim * self.outer * (self.item_len // per), dim, self.outer, self.groups)


def first_source(src_tp: int, dst_tp: int, src_rank: int) -> bool:
    """Whether prefill rank `src_rank` is the first of its decode rank's sources, the one that sends what
    every source holds alike (a replicated state slot, the aux row). SGLang's
    `should_send_replicated_state`: in aggregation only the first source sends."""
    return src_tp <= dst_tp or (src_rank % src_tp) % (src_tp // dst_tp) == 0


def slice_blocks(src_dim: int, dst_dim: int, src_tp: int, dst_tp: int, dst_rank: int, src_rank: int,
                 groups: Sequence[int] | None) -> list[Block]:
    """(src dim start, dst dim start, dims) blocks of one slot: `compute_mamba_state_slice_blocks`."""
    sub = groups is not None and sum(groups) == src_dim * src_tp
    if src_tp > dst_tp:  # aggregation: this source writes its shard at its writer offset
        writer = src_rank % (src_tp // dst_tp)
        if not sub:
            return [(0, writer * src_dim, src_dim)]
        return [(s, d + writer * (g // src_tp), g // src_tp) for g, s, d in _offsets(groups, src_tp, dst_tp)]
    if not sub:  # scatter: this decode rank's range of the source's dims
        return [((dst_rank * dst_dim) % src_dim, 0, dst_dim)]
    return [(s + (dst_rank * (g // dst_tp)) % (g // src_tp), d, g // dst_tp)
            for g, s, d in _offsets(groups, src_tp, dst_tp)]


def _offsets(groups: Sequence[int], src_tp: int, dst_tp: int) -> list[tuple[int, int, int]]:
    """(full group dim, src start, dst start) of each conv sub-block on the two ranks."""
    out, s, d = [], 0, 0
    for g in groups:
        out.append((g, s, d))
        s, d = s + g // src_tp, d + g // dst_tp
    return out


def byte_blocks(src: StateTensor, dst: StateTensor, src_tp: int, dst_tp: int, src_rank: int,
                dst_rank: int) -> list[Block]:
    """(src byte offset, dst byte offset, bytes) within one slot: `compute_mamba_state_slice_byte_blocks`
    (ranks are taken modulo their TP sizes, as SGLang's rank-in-group). Empty: nothing goes."""
    if (src.dim == 0) != (dst.dim == 0):
        raise ValueError("state replication differs between prefill and decode")
    src_rank, dst_rank = src_rank % src_tp, dst_rank % dst_tp
    if src.dim == 0:
        if src.item_len != dst.item_len:
            raise ValueError(f"replicated state item lengths differ: {src.item_len} != {dst.item_len}")
        return [(0, 0, src.item_len)] if first_source(src_tp, dst_tp, src_rank) else []
    src_unit = src.item_len // (src.dim * src.outer)
    dst_unit = dst.item_len // (dst.dim * dst.outer)
    logical = slice_blocks(src.dim, dst.dim, src_tp, dst_tp, dst_rank, src_rank, src.groups)
    return [(o * src.dim * src_unit + s * src_unit, o * dst.dim * dst_unit + d * dst_unit, n * src_unit)
            for o in range(src.outer) for s, d, n in logical]


@functools.lru_cache(maxsize=1024)
def runs_pair(src: StateTensor, dst: StateTensor, src_tp: int, dst_tp: int, src_rank: int,
              dst_rank: int) -> StateRuns | None:
    """The slot's byte runs on each side, or None: nothing goes. Cached: a pairing repeats for every room."""
    blocks = byte_blocks(src, dst, src_tp, dst_tp, src_rank, dst_rank)
    if not blocks:
        return None
    return StateRuns(ByteRuns(src.item_len, tuple((s, n) for s, _, n in blocks)),
                     ByteRuns(dst.item_len, tuple((d, n) for _, d, n in blocks)))


def state_runs(mine: Mapping[int, StateTensor], my_tp: int, peer_tp: int, src_rank: int, dst_rank: int,
               me: Side) -> dict[int, StateRuns]:
    """Per state buffer id: its runs between prefill rank `src_rank` and decode rank `dst_rank`; `mine`
    describes this side, which is `me`. Buffers that do not go are absent."""
    sending = me is Side.PREFILL
    src_tp, dst_tp = (my_tp, peer_tp) if sending else (peer_tp, my_tp)
    out = {}
    for b, t in mine.items():
        peer = t.at(my_tp, peer_tp)
        if peer is None:
            raise ValueError(f"state buffer {b} ({t}) does not shard from TP {my_tp} to TP {peer_tp}")
        src, dst = (t, peer) if sending else (peer, t)
        pair = runs_pair(src, dst, src_tp, dst_tp, src_rank, dst_rank)
        if pair is not None:
            out[b] = pair
    return out


def state_tensors(kv_args: Any, state_ids: Sequence[Sequence[int]], item_lens: Sequence[int]) -> dict[int, StateTensor]:
    """This side's state buffers (ids per state component, as KVMemory.state_ids) from SGLang's KVArgs.
    Raises ValueError saying why they cannot be sliced between TP sizes."""
    types = list(getattr(kv_args, "state_types", []) or [])
    out: dict[int, StateTensor] = {}
    for c, ids in enumerate(state_ids):
        kind = getattr(types[c], "value", types[c]) if c < len(types) else "?"
        if ids and kind != "mamba":
            raise ValueError(f"state component {c} is {kind!r}; only Mamba/GDN/KDA states are sliced between "
                             "TP sizes (SWA windows and the rest need equal TP)")
        dims = _component(kv_args, "state_dim_per_tensor", c)
        outers = _component(kv_args, "state_slice_outer_counts", c) or [1] * len(ids)
        groups = _component(kv_args, "state_conv_shard_groups", c) or [None] * len(ids)
        if len(dims) != len(ids) or len(outers) != len(ids) or len(groups) != len(ids):
            raise ValueError(f"SGLang gave no per-tensor slice dims for the {len(ids)} tensors of state "
                             f"component {c} (state_dim_per_tensor)")
        for b, dim, outer, g in zip(ids, dims, outers, groups):
            out[b] = StateTensor(int(item_lens[b]), int(dim), int(outer), tuple(map(int, g)) if g else None)
    return out


def _component(kv_args: Any, name: str, c: int) -> list:
    per = getattr(kv_args, name, None) or []
    return list(per[c] or []) if c < len(per) else []


@dataclass(frozen=True, slots=True)
class StateShapes:
    """This rank's state buffers, for peers at another attention TP: `tensors` per buffer id, or, when
    `problem` is set, why they cannot be sliced between TP sizes (`tensors` is then empty)."""

    tensors: Mapping[int, StateTensor] = field(default_factory=dict)
    problem: str = ""


def local_states(kv_args: Any, memory: Any) -> StateShapes:
    """`state_tensors` of a manager's KVMemory, or why its states cannot be sliced between TP sizes
    (then a peer at another TP is refused at Register with that reason)."""
    try:
        return StateShapes(state_tensors(kv_args, memory.state_ids, [b.item_len for b in memory.layout.buffers]))
    except ValueError as e:
        return StateShapes(problem=str(e))
