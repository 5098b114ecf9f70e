"""Different attention-TP sizes on the two sides: which prefill rank sends which KV heads to
which decode rank, derived by both sides from the same facts, so no message carries it.

SGLang's rank mapping (common/conn.py `_resolve_rank_mapping`) pairs ranks:

    prefill TP 2, decode TP 4 (decode larger)      prefill TP 8, decode TP 2 (prefill larger)
    P0 ─▶ D0, D1   each gets a head slice          P0..P3 ─▶ D0   each sends its heads into a slice
    P1 ─▶ D2, D3   of P's heads                    P4..P7 ─▶ D1   of D's heads

Each K/V page is [page_size][heads][head_dim]; a slice keeps `count` heads from `start` (items.HeadSlice).
With fewer KV heads than ranks, heads are replicated: 2 heads at prefill TP 8 live on 4 ranks each. SGLang's
mooncake path then sends every replica; here only the first replica of each head among a decode rank's
sources sends its K/V (`sends_kv`), so each head crosses the link once. Every source still reports to the
decode; one that sends nothing reports Success at once.

Mamba/GDN/KDA state slots (conv and temporal state) are sliced by SGLang's other rule
(`compute_mamba_state_slice_byte_blocks`, restated in tp_state.py) into byte runs (items.ByteRuns): in
aggregation every source writes its shard of the decode's slot, so a source that sends no K/V (a replica)
still sends its states with the last chunk. Other state kinds (SWA windows, DSA, ...) still need equal
TP (`layout_problem` says so).
"""
from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass, replace
from typing import Any

from prfaas_sgl.srt.backend.tp_state import Side, StateRuns, StateShapes, StateTensor, first_source, state_runs
from prfaas_sgl.transfer.items import HeadSlice, ItemBatch, Items, Slice
from prfaas_sgl.transfer.layout import MemoryLayout


def head_slice_params(src_tp: int, dst_tp: int, src_rank: int, dst_rank: int,
                      total_heads: int) -> tuple[int, int, int, int]:
    """(src_head_start, heads, dst_head_start, heads): SGLang 0.5.23's `compute_head_slice_params`
    (common/staging_buffer.py), restated so CPU CI needs neither Triton nor that module's imports."""
    src_heads, dst_heads = max(1, total_heads // src_tp), max(1, total_heads // dst_tp)
    src_local, dst_local = src_rank % src_tp, dst_rank % dst_tp
    if src_tp > dst_tp:
        unique = src_local // max(1, src_tp // total_heads)
        return 0, src_heads, (unique * src_heads) % dst_heads, src_heads
    unique = dst_local // max(1, dst_tp // total_heads)
    return (unique * dst_heads) % src_heads, dst_heads, 0, dst_heads


def sources(src_tp: int, dst_tp: int, dst_rank: int) -> list[int]:
    """Prefill attention-TP ranks that feed decode rank `dst_rank` (SGLang's target_tp_ranks, non-MLA)."""
    d = dst_rank % dst_tp
    if src_tp <= dst_tp:
        return [d // (dst_tp // src_tp)]
    ratio = src_tp // dst_tp
    return list(range(d * ratio, (d + 1) * ratio))


def sends_kv(src_tp: int, dst_tp: int, src_rank: int, total_heads: int) -> bool:
    """Replica dedupe: of the sources of one decode rank holding the same KV head, only the first sends.

    Sources of a decode rank are a block of `src_tp // dst_tp` consecutive ranks; replicas of a head
    are blocks of `src_tp // total_heads`; within the source block, runs of min(both) ranks share a head.
    """
    if src_tp <= dst_tp:
        return True
    run = min(max(1, src_tp // total_heads), src_tp // dst_tp)
    return (src_rank % src_tp) % run == 0


@dataclass(frozen=True, slots=True)
class Pairing:
    """What one prefill rank sends to one decode rank: the K/V head slice on each side (None = whole
    items, equal TP), whether K/V and aux go at all, and `states`: per state buffer id that goes, its
    byte runs on each side (None = every state buffer whole, equal TP). The defaults are `WHOLE`."""

    src: HeadSlice | None = None
    dst: HeadSlice | None = None
    kv: bool = True
    aux: bool = True
    states: Mapping[int, StateRuns] | None = None

    def sends(self, last: bool) -> bool:
        """Anything goes with a chunk (`last`: the one that carries states and aux)?"""
        return self.kv or (last and (self.aux or self.states is None or bool(self.states)))

    @property
    def empty(self) -> bool:
        return not self.sends(last=True)


WHOLE = Pairing()  # equal TP (or MLA): every item whole, everything goes


def pairing(src_tp: int, dst_tp: int, src_rank: int, dst_rank: int, total_heads: int, page_size: int,
            head_bytes: int, states: Mapping[int, StateTensor] | None = None, me: Side = Side.PREFILL) -> Pairing:
    """`head_bytes`: bytes of one head of one token (head_dim × dtype size) in a K or V buffer; `states`:
    the state buffers of this side, which is `me` (tp_state.state_tensors)."""
    if src_tp == dst_tp:
        return WHOLE
    s0, n, d0, _ = head_slice_params(src_tp, dst_tp, src_rank, dst_rank, total_heads)
    src_heads, dst_heads = max(1, total_heads // src_tp), max(1, total_heads // dst_tp)
    my_tp, peer_tp = (src_tp, dst_tp) if me is Side.PREFILL else (dst_tp, src_tp)
    return Pairing(src=HeadSlice(page_size, src_heads, head_bytes, s0, n),
                   dst=HeadSlice(page_size, dst_heads, head_bytes, d0, n),
                   kv=sends_kv(src_tp, dst_tp, src_rank, total_heads),
                   aux=first_source(src_tp, dst_tp, src_rank),  # the aux row is alike on every rank
                   states=state_runs(states or {}, my_tp, peer_tp, src_rank, dst_rank, me))


def with_state_runs(batch: ItemBatch, pair: Pairing, state_ids: Collection[int], side: Side) -> ItemBatch:
    """`batch` with each state buffer's items under its byte runs on `side`; state buffers that do not go
    in this pairing are left out. Equal TP: `batch` as it is."""
    if pair.states is None:
        return batch
    groups: list[Items] = []
    for g in batch.groups:
        if not state_ids or not set(g.buffer_ids) & set(state_ids):
            groups.append(g)
            continue
        by_slice: dict[Slice, list[int]] = {}  # buffers sharing a slice (every conv layer, ...) stay one group
        for b in g.buffer_ids:
            if b in pair.states:
                by_slice.setdefault(pair.states[b].on(side), []).append(b)
        groups += [Items(tuple(ids), g.index, runs) for runs, ids in by_slice.items()]
    return replace(batch, groups=tuple(groups))


def head_bytes(item_len: int, page_size: int, tp: int, total_heads: int) -> int | None:
    """Bytes per head per token of a K/V item of `item_len` at `tp`, or None if it does not split."""
    heads = max(1, total_heads // tp)
    unit, rest = divmod(item_len, page_size * heads)
    return unit if unit and not rest else None


def layout_problem(mine: MemoryLayout, theirs: MemoryLayout, my_tp: int, their_tp: int, total_heads: int,
                   page_size: int, states: StateShapes = StateShapes()) -> str | None:
    """Why a peer at another attention TP cannot exchange K/V and states with us, or None (equal TP: see
    mismatch()). `states`: our state buffers (tp_state.local_states), or why they cannot be sliced."""
    if my_tp == their_tp:
        return mine.mismatch(theirs)
    kv, state = mine.ids_of("kv"), mine.ids_of("state")
    problem = mine.mismatch(theirs, sliced=kv + state) or _state_problem(theirs, my_tp, their_tp, state, states)
    if problem:
        return problem
    for b in kv:
        a = head_bytes(mine.buffers[b].item_len, page_size, my_tp, total_heads)
        z = head_bytes(theirs.buffers[b].item_len, page_size, their_tp, total_heads)
        if a is None or a != z:
            return (f"K/V buffer {b}: item lengths {mine.buffers[b].item_len} B (TP {my_tp}) and "
                    f"{theirs.buffers[b].item_len} B (TP {their_tp}) do not split into {total_heads} heads "
                    f"of one size with page_size {page_size}")
    return None


def _state_problem(theirs: MemoryLayout, my_tp: int, their_tp: int, ids: list[int],
                   shapes: StateShapes) -> str | None:
    """Our state buffers must shard into the peer's: the slot it registered is the one SGLang's rule
    gives at its TP."""
    if not ids:
        return None
    states = shapes.tensors
    why = shapes.problem or ("" if set(ids) <= set(states) else "no per-tensor slice dims known for every state buffer")
    if why:
        return (f"attention TP differs (here {my_tp}, peer {their_tp}) and the state buffers cannot be sliced "
                f"between TP sizes: {why}; run equal TP")
    for b in ids:
        peer = states[b].at(my_tp, their_tp)
        if peer is None or peer.item_len != theirs.buffers[b].item_len:
            return (f"state buffer {b}: {states[b].item_len} B slots (TP {my_tp}, dim {states[b].dim}) do not "
                    f"shard into the peer's {theirs.buffers[b].item_len} B slots (TP {their_tp})")
    return None


def total_kv_heads(kv_args: Any, tp: int) -> int:
    """KV heads of the model: SGLang's `total_kv_head_num`, else this rank's `kv_head_num` times `tp`."""
    total = int(getattr(kv_args, "total_kv_head_num", 0) or 0)
    return total or int(getattr(kv_args, "kv_head_num", 0) or 0) * tp


def pool_head_bytes(memory: Any, kv_args: Any, tp: int) -> int:
    """Bytes of one KV head of one token in `memory`'s first K/V buffer (rank of a `tp`-way model). Not
    `head_bytes` above, which computes the same from a layout buffer's item length."""
    item = memory.layout.buffers[memory.kv_ids[0]].item_len
    return item // (kv_args.page_size * max(1, total_kv_heads(kv_args, tp) // tp))
