"""Mamba/GDN/KDA state slots between different attention-TP sizes: SGLang's slice arithmetic
restated in `backend/tp_state.py`, checked against SGLang's own function, then real transfers between
SGLang's own MambaPools (built on CPU at each TP size) whose shards are cut from one global pool by the
sharding rule (q, k and v of a conv state split on their own), so the truth is known independently of the
slice arithmetic: every decode rank must end up holding exactly its shard of the request's slot."""
from __future__ import annotations

import itertools
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from prfaas_sgl.srt.backend.tp import WHOLE, layout_problem, pairing, sources, with_state_runs
from prfaas_sgl.srt.backend.tp_state import (Side, StateShapes, StateTensor, byte_blocks, first_source, local_states,
                                              state_tensors)
from prfaas_sgl.transfer.config import TransferConfig
from prfaas_sgl.transfer.items import ByteRuns, ItemBatch, Items
from prfaas_sgl.transfer.layout import BufferSpec, MemoryLayout
from prfaas_sgl.transfer.receiver import ZmqReceiver
from prfaas_sgl.transfer.sender import ZmqSender
from prfaas_sgl.transfer.states import TransferState as S
from tests.support.sglang_context import sglang_context  # noqa: F401  (autouse: SGLang's pools read it)

TP_PAIRS = [(1, 2), (2, 1), (1, 4), (4, 1), (2, 4), (4, 2)]


@pytest.mark.parametrize("groups, outer", [(None, 1), ((24, 24, 64), 1), ((64, 32, 32), 3), ((24, 24, 60), 1)])
def test_byte_blocks_match_sglang(groups, outer):
    utils = pytest.importorskip("sglang.srt.disaggregation.utils", reason="compares with SGLang's function")
    full = sum(groups) if groups else 112
    for src_tp, dst_tp in TP_PAIRS:
        src = StateTensor(full // src_tp * outer * 6, full // src_tp, outer, groups)
        dst = src.at(src_tp, dst_tp)
        for src_rank, dst_rank in itertools.product(range(src_tp), range(dst_tp)):
            want = utils.compute_mamba_state_slice_byte_blocks(
                src_item_len=src.item_len, dst_item_len=dst.item_len, src_dim=src.dim, dst_dim=dst.dim,
                outer_count=outer, src_attn_tp_size=src_tp, dst_attn_tp_size=dst_tp,
                dst_tp_rank_in_group=dst_rank, local_tp_rank_in_group=src_rank,
                conv_shard_groups=list(groups) if groups else None)
            assert byte_blocks(src, dst, src_tp, dst_tp, src_rank, dst_rank) == [tuple(b) for b in want]


def test_replicated_state_goes_whole_from_one_source():
    utils = pytest.importorskip("sglang.srt.disaggregation.utils", reason="compares with SGLang's election")
    t = StateTensor(96, 0)
    for src_tp, dst_tp in TP_PAIRS:
        for src_rank in range(src_tp):
            want = utils.should_send_replicated_state(src_attn_tp_size=src_tp, dst_attn_tp_size=dst_tp,
                                                      local_tp_rank_in_group=src_rank)
            assert byte_blocks(t, t, src_tp, dst_tp, src_rank, 0) == ([(0, 0, 96)] if want else [])


# -- SGLang's own pools, one per rank -----------------------------------------------------------------
N_GROUPS, HEADS, HEAD_DIM, STATE, KERNEL = 4, 8, 16, 32, 4  # temporal: 16 KiB at TP 1, pieces of 4 KiB chunks
SLOTS, LAYERS = 4, [1, 3]


def gdn_pool(tp: int):
    from sglang.srt.configs.mamba_utils import Mamba2CacheParams, Mamba2StateDType, Mamba2StateShape
    from sglang.srt.mem_cache.memory_pool import MambaPool

    key_dim, value_dim = N_GROUPS * STATE, HEADS * HEAD_DIM
    shape = Mamba2StateShape.create(tp_world_size=tp, intermediate_size=value_dim, n_groups=N_GROUPS,
                                    num_heads=HEADS, head_dim=HEAD_DIM, state_size=STATE, conv_kernel=KERNEL,
                                    conv_shard_groups=[key_dim, key_dim, value_dim])
    params = Mamba2CacheParams(shape=shape, layers=LAYERS,
                               dtype=Mamba2StateDType(conv=torch.bfloat16, temporal=torch.float32))
    return MambaPool(size=SLOTS - 1, spec_state_size=SLOTS - 1, cache_params=params, mamba_layer_ids=LAYERS,
                     device="cpu")


def kda_pool(tp: int):
    from sglang.srt.configs.mamba_utils import KimiLinearCacheParams, KimiLinearStateShape, Mamba2StateDType
    from sglang.srt.mem_cache.memory_pool import MambaPool

    shape = KimiLinearStateShape.create(tp_world_size=tp, num_heads=HEADS, head_dim=HEAD_DIM, num_k_heads=4,
                                        head_k_dim=HEAD_DIM, conv_kernel_size=KERNEL)
    params = KimiLinearCacheParams(shape=shape, layers=LAYERS,
                                   dtype=Mamba2StateDType(conv=torch.bfloat16, temporal=torch.float32))
    return MambaPool(size=SLOTS - 1, spec_state_size=SLOTS - 1, cache_params=params, mamba_layer_ids=LAYERS,
                     device="cpu")


def entries(pool) -> list[tuple[str, torch.Tensor, int]]:
    """(field, [slots, ...] tensor, slice axis within a slot) per transfer entry, SGLang's order."""
    return [(f, t, axis) for f, t, axis, _ in pool._iter_transfer_state_entries()]


def kv_args_of(pool) -> SimpleNamespace:
    """The state part of SGLang's KVArgs for one MAMBA component (setup_state_kv_args)."""
    from sglang.srt.disaggregation.base.conn import StateType

    return SimpleNamespace(state_types=[StateType.MAMBA], state_dim_per_tensor=[pool.get_state_dim_per_tensor()],
                           state_slice_outer_counts=[pool.get_state_slice_outer_counts()],
                           state_conv_shard_groups=[pool.get_state_conv_shard_groups()])


def shard(glob: torch.Tensor, axis: int, groups, tp: int, rank: int) -> torch.Tensor:
    """Rank `rank`'s part of a global slot tensor: its 1/tp of every sub-block of `axis` (one block: heads)."""
    parts, start = [], 0
    for g in groups or [glob.shape[axis]]:
        n = g // tp
        parts.append(glob.narrow(axis, start + rank * n, n))
        start += g
    return torch.cat(parts, dim=axis)


def fill_ranks(make, tp: int, glob) -> list:
    """SGLang pools of every rank at `tp`, each slot holding that rank's shard of the global pool's."""
    pools = [make(tp) for _ in range(tp)]
    groups = glob.get_state_conv_shard_groups()
    for rank, p in enumerate(pools):
        for (field, g, axis), (_, t, _), grp in zip(entries(glob), entries(p), groups):
            for slot in range(SLOTS):
                t[slot] = shard(g[slot], axis, grp, tp, rank)
    return pools


def layout_of(pool) -> tuple[MemoryLayout, list[tuple[int, int]]]:
    ptrs, lens, items = pool.get_contiguous_buf_infos()
    lay = MemoryLayout(tuple(BufferSpec("state", i, n // i) for n, i in zip(lens, items)))
    return lay, list(zip(ptrs, lens))


CFG = TransferConfig(connections=1, chunk_bytes=4096, window_bytes=1 << 16, timeout_s=10, stage_slots=4)


def transfer(src_pools, dst_pool, src_tp: int, dst_tp: int, dst_rank: int, src_slot: int, dst_slot: int) -> int:
    """Every source of `dst_rank` sends its state slot, as PrefillManager and DecodeManager pair them."""
    dst_lay, dst_bufs = layout_of(dst_pool)
    dst_states = state_tensors(kv_args_of(dst_pool), [range(len(dst_bufs))], [b.item_len for b in dst_lay.buffers])
    rx = ZmqReceiver(dst_lay, dst_bufs, CFG)
    senders, sent = [], 0
    try:
        for r in sources(src_tp, dst_tp, dst_rank):
            src_lay, src_bufs = layout_of(src_pools[r])
            ids = list(range(len(src_bufs)))
            src_states = state_tensors(kv_args_of(src_pools[r]), [ids], [b.item_len for b in src_lay.buffers])
            assert layout_problem(src_lay, dst_lay, src_tp, dst_tp, 2, 1, StateShapes(src_states)) is None
            tx_pair = pairing(src_tp, dst_tp, r, dst_rank, 2, 1, 8, src_states, me=Side.PREFILL)
            rx_pair = pairing(src_tp, dst_tp, r, dst_rank, 2, 1, 8, dst_states, me=Side.DECODE)
            assert tx_pair.states == rx_pair.states  # both sides derive the same runs from their own facts
            slots = {s: ItemBatch((Items(tuple(ids), np.array([s])),)) for s in (src_slot, dst_slot)}
            rx_batch = with_state_runs(slots[dst_slot], rx_pair, ids, Side.DECODE)
            tx_batch = with_state_runs(slots[src_slot], tx_pair, ids, Side.PREFILL)
            rx.expect(r, rx_batch)
            tx = ZmqSender(src_lay, src_bufs, CFG)
            senders.append(tx)
            tx.send(r, rx.address, tx_batch, last=True)
            assert rx.wait(r, 10).state is S.DONE
            sent += tx.wait(r, 5).nbytes
    finally:
        for tx in senders:
            tx.close()
        rx.close()
    return sent


@pytest.mark.parametrize("make", [gdn_pool, kda_pool], ids=["gdn", "kda"])
@pytest.mark.parametrize("src_tp, dst_tp", TP_PAIRS)
def test_every_decode_rank_holds_exactly_its_state_shard(make, src_tp, dst_tp):
    glob = make(1)
    gen = torch.Generator().manual_seed(src_tp * 10 + dst_tp)
    for _, t, _ in entries(glob):
        t.view(torch.uint8).copy_(torch.randint(0, 256, t.view(torch.uint8).shape, dtype=torch.uint8, generator=gen))
    src_pools = fill_ranks(make, src_tp, glob)
    groups = glob.get_state_conv_shard_groups()
    for dst_rank in range(dst_tp):
        dst = make(dst_tp)
        for _, t, _ in entries(dst):
            t.zero_()
        sent = transfer(src_pools, dst, src_tp, dst_tp, dst_rank, src_slot=2, dst_slot=1)
        for (_, g, axis), (_, t, _), grp in zip(entries(glob), entries(dst), groups):
            want = shard(g[2], axis, grp, dst_tp, dst_rank)  # random bytes hold NaNs: compare bytes
            assert torch.equal(t[1].view(torch.uint8), want.contiguous().view(torch.uint8))
            for other in (0, 2, 3):  # nothing else of the pool was written
                assert not t[other].view(torch.uint8).any()
        assert sent == sum(t[1].nbytes for _, t, _ in entries(dst))  # each byte of the shard crossed once


def test_state_item_lengths_that_do_not_shard_are_refused():
    lay = MemoryLayout((BufferSpec("kv", 64, 4), BufferSpec("state", 96, 2)))
    half = MemoryLayout((BufferSpec("kv", 32, 4), BufferSpec("state", 40, 2)))
    states = {1: StateTensor(96, 8)}
    assert "do not shard into the peer's 40 B" in layout_problem(lay, half, 1, 2, 2, 1, StateShapes(states))
    ok = MemoryLayout((BufferSpec("kv", 32, 4), BufferSpec("state", 48, 2)))
    assert layout_problem(lay, ok, 1, 2, 2, 1, StateShapes(states)) is None


def test_states_of_other_kinds_keep_the_refusal():
    lay = MemoryLayout((BufferSpec("kv", 64, 4), BufferSpec("state", 100, 2)))
    half = MemoryLayout((BufferSpec("kv", 32, 4), BufferSpec("state", 50, 2)))
    args = SimpleNamespace(state_types=["swa"], state_dim_per_tensor=[[]])
    with pytest.raises(ValueError, match="'swa'; only Mamba/GDN/KDA"):
        state_tensors(args, [[1]], [64, 100])
    assert "cannot be sliced between TP sizes: no per-tensor" in layout_problem(
        lay, half, 1, 2, 2, 1, StateShapes(problem="no per-tensor slice dims"))


def test_aux_row_and_replicated_states_come_from_the_same_elected_source():
    """What every prefill rank holds alike (the aux row, a dim-0 state slot) crosses once per decode rank,
    from the one source `first_source` elects; equal TP pairs every item whole (`WHOLE`)."""
    replicated = {2: StateTensor(64, 0)}
    for src_tp, dst_tp in TP_PAIRS + [(8, 2), (4, 4)]:
        for src_rank, dst_rank in itertools.product(range(src_tp), range(dst_tp)):
            pair = pairing(src_tp, dst_tp, src_rank, dst_rank, 2, 1, 8, replicated)
            if src_tp == dst_tp:
                assert pair is WHOLE and pair.aux and pair.kv and pair.states is None
                continue
            elected = first_source(src_tp, dst_tp, src_rank)
            assert pair.aux == (2 in pair.states) == elected
        assert sum(first_source(src_tp, dst_tp, r) for r in range(src_tp)) == min(src_tp, dst_tp)


def test_state_shapes_carry_why_they_cannot_be_sliced():
    memory = SimpleNamespace(state_ids=[[1]], layout=MemoryLayout((BufferSpec("kv", 64, 4),
                                                                   BufferSpec("state", 100, 2))))
    refused = local_states(SimpleNamespace(state_types=["swa"], state_dim_per_tensor=[[]]), memory)
    assert not refused.tensors and "'swa'; only Mamba/GDN/KDA" in refused.problem
    ok = local_states(SimpleNamespace(state_types=["mamba"], state_dim_per_tensor=[[4]]), memory)
    assert ok == StateShapes({1: StateTensor(100, 4)}) and not ok.problem


def test_replica_source_without_kv_still_sends_its_state_shard():
    """Prefill TP 4 → decode TP 1 with 2 KV heads: ranks 1 and 3 hold replicas (no K/V, no aux) but each
    prefill rank holds a quarter of the state heads, so all four send with the last chunk."""
    states = {2: StateTensor(4 * 64, 4)}  # 4 heads of 64 B per rank at TP 4
    for r in range(4):
        pair = pairing(4, 1, r, 0, 2, 1, 8, states)
        assert pair.kv == (r % 2 == 0) and pair.aux == (r == 0)
        assert pair.sends(last=True) and pair.sends(last=False) == pair.kv
        src, dst = pair.states[2].src, pair.states[2].dst
        assert src == ByteRuns(256, ((0, 256),)) and dst == ByteRuns(1024, ((r * 256, 256),))


def test_managers_move_state_shards_from_two_prefill_ranks():
    """PrefillManager TP 2 → DecodeManager TP 1 through SGLang's calls (add_transfer_request / expect) over
    real ZmqSender/ZmqReceiver: K/V heads and a GDN-shaped state component (conv cat(q, k, v) of 3-byte
    channels, temporal of 64-byte heads), each prefill rank holding its shard of one global slot."""
    from sglang.srt.disaggregation.base.conn import KVPoll

    from prfaas_sgl.srt.backend import control
    from prfaas_sgl.srt.backend.memory import KVMemory

    from .backend_stubs import make_decode, make_prefill

    heads, head_bytes, pages, groups = 2, 256, 8, (4, 4, 8)  # conv: 16 channels of 3 B at TP 1
    rng = np.random.default_rng(5)
    kv = rng.integers(0, 256, (2, pages, heads, head_bytes), dtype=np.uint8)
    conv = rng.integers(0, 256, (SLOTS, 16, 3), dtype=np.uint8)
    temporal = rng.integers(0, 256, (SLOTS, 4, 64), dtype=np.uint8)

    def args(arrays, tp):
        ptrs, lens = [a.ctypes.data for a in arrays], [a.nbytes for a in arrays]
        return SimpleNamespace(
            kv_data_ptrs=ptrs[:2], kv_data_lens=lens[:2], kv_item_lens=[lens[0] // pages] * 2,
            state_data_ptrs=[ptrs[2:4]], state_data_lens=[lens[2:4]],
            state_item_lens=[[lens[2] // SLOTS, lens[3] // SLOTS]],
            state_types=["mamba"], state_dim_per_tensor=[[16 // tp, 4 // tp]], state_slice_outer_counts=[[1, 1]],
            state_conv_shard_groups=[[list(groups), None]], aux_data_ptrs=ptrs[4:], aux_data_lens=[512],
            aux_item_lens=[64], page_size=1, engine_rank=0, total_kv_head_num=heads)

    dst = [np.zeros(pages * heads * head_bytes, np.uint8) for _ in range(2)] + [
        np.zeros(conv.nbytes, np.uint8), np.zeros(temporal.nbytes, np.uint8), np.zeros(512, np.uint8)]
    d = make_decode(None)
    d.kv_args = args(dst, 1)
    d.memory, d.transfer_config = KVMemory.of(d.kv_args), CFG
    d.receiver = d.data_plane = ZmqReceiver(d.memory.layout, d.memory.buffers, CFG)
    d.expected, d.peer_rejections, d.waiting_timeout, d.local_ip, d.attn_tp_size = {}, {}, 30.0, "127.0.0.1", 1
    prefills, keep = [], []
    try:
        for rank in range(2):
            src = [np.ascontiguousarray(kv[i][:, rank]).reshape(-1) for i in range(2)]
            src.append(shard(torch.from_numpy(conv), 1, groups, 2, rank).contiguous().numpy().reshape(-1))
            src.append(np.ascontiguousarray(temporal[:, 2 * rank: 2 * rank + 2]).reshape(-1))
            src.append(np.zeros(512, np.uint8))
            keep.append(src)
            p = make_prefill()
            p.kv_args, p.attn_tp_size, p.attn_tp_rank, p.is_mla_backend = args(src, 2), 2, rank, False
            p.memory, p.transfer_config = KVMemory.of(p.kv_args), CFG
            p.sender = p.data_plane = ZmqSender(p.memory.layout, p.memory.buffers, CFG)
            reg = control.Register(endpoint="127.0.0.1", dst_port=5555, data_host="127.0.0.1",
                                   data_port=d.receiver.address.port, server_key=None, layout=d.memory.layout,
                                   page_size=1, attn_tp_size=1, tp_rank=0)
            p._on_control(control.encode(reg), "127.0.0.1")
            assert not p.rejections
            prefills.append(p)
        assert d.expect(4242, np.arange(pages), 3, [np.array([1])], src_tp=2, srcs=[0, 1]) is None
        for p in prefills:
            meta = control.Metadata(room=4242, endpoint="127.0.0.1", dst_port=5555, npages=pages, aux_index=3,
                                    state_indices=[[1]], decode_prefix_len=0, required_dst_info_num=1,
                                    is_dummy=False)
            p.request_status[4242] = KVPoll.Bootstrapping
            p._on_control(control.encode(meta), "127.0.0.1")
            p.add_transfer_request(4242, np.arange(pages), slice(0, pages), True, aux_index=1,
                                   state_indices=[np.array([2])])
        for tid in d.expected[4242]:
            assert d.receiver.wait(tid, 10).state is S.DONE
        assert np.array_equal(dst[0].reshape(pages, heads, head_bytes), kv[0])
        assert np.array_equal(dst[2].reshape(SLOTS, 16, 3)[1], conv[2])  # q0 q1 | k0 k1 | v0 v1 again
        assert np.array_equal(dst[3].reshape(SLOTS, 4, 64)[1], temporal[2])
        assert not dst[2].reshape(SLOTS, -1)[[0, 2, 3]].any() and not dst[3].reshape(SLOTS, -1)[[0, 2, 3]].any()
    finally:
        for p in prefills:
            p.sender.close()
        d.receiver.close()


def test_byte_runs_gather_and_land_on_strided_slabs():
    """Both pools strided (the unified slab: rows `stride` bytes apart): a GDN conv slot (one run per
    q/k/v sub-block) and a temporal slot larger than a chunk (pieces) from TP 1 to decode rank 1 of TP 2
    land in their shards; the slab bytes between rows stay untouched."""
    from prfaas_sgl.srt.backend.tp_state import runs_pair
    from prfaas_sgl.transfer.buffers import Strided

    conv, temporal = StateTensor(16 * 6, 16, 1, (4, 4, 8)), StateTensor(8 * 2048, 8)
    tensors = [conv, temporal]
    pairs = [runs_pair(t, t.at(1, 2), 1, 2, 0, 1) for t in tensors]
    rng = np.random.default_rng(9)

    def slabs(items: list[int], fill: bool):
        arrays = [rng.integers(0, 256, SLOTS * (n + 40), dtype=np.uint8) if fill
                  else np.full(SLOTS * (n + 40), 7, np.uint8) for n in items]
        bufs = [Strided(a.ctypes.data, a.nbytes, n + 40) for a, n in zip(arrays, items)]
        return MemoryLayout(tuple(BufferSpec("state", n, SLOTS) for n in items)), arrays, bufs

    src_lay, src, src_bufs = slabs([t.item_len for t in tensors], True)
    dst_lay, dst, dst_bufs = slabs([t.at(1, 2).item_len for t in tensors], False)
    rx, tx = ZmqReceiver(dst_lay, dst_bufs, CFG), ZmqSender(src_lay, src_bufs, CFG)
    try:
        rx.expect(1, ItemBatch(tuple(Items((b,), np.array([3]), p.dst) for b, p in enumerate(pairs))))
        tx.send(1, rx.address, ItemBatch(tuple(Items((b,), np.array([0]), p.src) for b, p in enumerate(pairs))),
                last=True)
        assert rx.wait(1, 10).state is S.DONE
    finally:
        tx.close()
        rx.close()
    for b, (t, runs) in enumerate(zip(tensors, pairs)):
        n, m = t.item_len, t.at(1, 2).item_len
        rows = dst[b].reshape(SLOTS, m + 40)
        assert np.array_equal(rows[3, :m], src[b].reshape(SLOTS, n + 40)[0, :n][runs.src.columns()])
        assert (rows[:3] == 7).all() and (rows[3, m:] == 7).all()
    want_q = src[0].reshape(SLOTS, 136)[0, :96].reshape(16, 6)[[2, 3, 6, 7, 12, 13, 14, 15]]
    assert np.array_equal(dst[0].reshape(SLOTS, 88)[3, :48].reshape(8, 6), want_q)  # q1 | k1 | v1
