"""The sliding-window hybrid CPU fixes (`prfaas_sgl.srt.cpu.swa_fixes`) against SGLang 0.5.23's own
`torch_native_backend.py`, executed whole with small stand-ins for its sglang imports (importing SGLang
takes ~15 s of CPU). A batch of MiMo-V2-Flash-shaped layers (GQA, v_head_dim < head_dim, window 3) runs a
chunked prefill after a cached prefix, next to a fresh request, then a decode step, over a hybrid pool
whose SWA layers live in their own sub-pool; every output is checked against the token-by-token reference
on the requests' logical K/V. Each fix's test also shows the stock backend failing the same batch.
"""

from __future__ import annotations

import ast
import builtins
import enum
import importlib.util
import sys
import textwrap
import types
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from prfaas_sgl.kernels.sink_attention.naive import naive_sink_attention
from prfaas_sgl.srt.cpu import swa_fixes

SGLANG = Path(importlib.util.find_spec("sglang").submodule_search_locations[0])  # finds, does not import
TORCH_NATIVE = SGLANG / "srt/layers/attention/torch_native_backend.py"
TOL = 1e-5
WINDOW, HQ, D, DV = 3, 4, 16, 8
FULL, SWA = 0, 1  # layer ids; MiMo's full layers have 1 KV head, its SWA layers 2
KV_HEADS = {FULL: 1, SWA: 2}


@dataclass
class KVWriteLoc:  # SGLang's memory_pool.KVWriteLoc, the fields set_kv_buffer reads
    loc: torch.Tensor
    swa_loc: torch.Tensor | None = None
    full_loc: torch.Tensor | None = None


class FakeSWAKVPool:
    """What torch_native touches of SGLang's SWAKVPool: SWA layers' K/V in a sub-pool indexed by SWA slots,
    written through `KVWriteLoc.swa_loc`; full->SWA slot translation through the allocator's mapping, where
    a slot freed from the window maps to 0. SWA slot 0 holds NaN here: reading a freed slot poisons the
    output even when masked (0 * NaN), as reading another token's row would corrupt it."""

    def __init__(self, size: int, size_swa: int, mapping: torch.Tensor):
        self.swa_layer_nums = 1
        self.layers_mapping = {FULL: (0, False), SWA: (0, True)}
        self.full_to_swa_index_mapping = mapping
        self.k = {FULL: torch.zeros(size, 1, D), SWA: torch.zeros(size_swa, 2, D)}
        self.v = {FULL: torch.zeros(size, 1, DV), SWA: torch.zeros(size_swa, 2, DV)}
        self.k[SWA][0], self.v[SWA][0] = float("nan"), float("nan")

    def translate_loc_from_full_to_swa(self, loc):
        return self.full_to_swa_index_mapping[loc]

    def get_key_buffer(self, layer_id):
        return self.k[layer_id]

    def get_value_buffer(self, layer_id):
        return self.v[layer_id]

    def set_kv_buffer(self, layer, loc_info, k, v):
        loc = loc_info.swa_loc if self.layers_mapping[layer.layer_id][1] else loc_info.loc
        self.k[layer.layer_id][loc], self.v[layer.layer_id][loc] = k, v


class AttentionType(enum.Enum):
    DECODER = "decoder"
    ENCODER_ONLY = "encoder_only"


def _torch_native_module() -> types.ModuleType:
    """SGLang's torch_native_backend.py executed as a module whose sglang imports get stand-ins; registered
    in sys.modules by the caller (the fix reads `KVWriteLoc` from the backend's module)."""
    stand_ins = {
        "sglang.srt.layers.attention.base_attn_backend": types.SimpleNamespace(AttentionBackend=object),
        "sglang.srt.layers.radix_attention": types.SimpleNamespace(AttentionType=AttentionType),
        "sglang.srt.mem_cache.memory_pool": types.SimpleNamespace(KVWriteLoc=KVWriteLoc),
        "sglang.srt.mem_cache.swa_memory_pool": types.SimpleNamespace(SWAKVPool=FakeSWAKVPool),
        "sglang.srt.model_executor.forward_batch_info": types.SimpleNamespace(ForwardBatch=object),
    }

    def importer(name, globals=None, locals=None, fromlist=(), level=0):
        if name in stand_ins:
            return stand_ins[name]
        if name.startswith("sglang"):
            raise ImportError(f"test gives no stand-in for {name}")
        return builtins.__import__(name, globals, locals, fromlist, level)

    module = types.ModuleType("prfaas_test_torch_native_backend")
    module.__dict__["__builtins__"] = {**builtins.__dict__, "__import__": importer}
    exec(compile(TORCH_NATIVE.read_text(), str(TORCH_NATIVE), "exec"), module.__dict__)
    return module


@pytest.fixture
def native(monkeypatch):
    module = _torch_native_module()
    monkeypatch.setitem(sys.modules, module.__name__, module)
    return module.TorchNativeAttnBackend


def _hooked(cls, method: str):
    """The method as SGLang's HookRegistry AROUND hook wraps it: fix(original, self, *args, **kwargs)."""
    original, fix = getattr(cls, method), getattr(swa_fixes, swa_fixes.TARGETS[f"{swa_fixes.TORCH_NATIVE}.{method}"])
    return lambda self, *args, **kwargs: fix(original, self, *args, **kwargs)


def _layer(layer_id: int) -> types.SimpleNamespace:
    return types.SimpleNamespace(
        layer_id=layer_id, tp_q_head_num=HQ, tp_k_head_num=KV_HEADS[layer_id], qk_head_dim=D, v_head_dim=DV,
        scaling=D**-0.5, sliding_window_size=WINDOW if layer_id == SWA else -1, is_cross_attention=False,
        attn_type=AttentionType.DECODER,
    )


class World:
    """Two requests over a hybrid pool, their logical K/V kept beside it for the reference.

    req pool row 2: positions 0..4 cached (an earlier chunk), 5..11 in this extend, 12 decoded next
    req pool row 0: positions 0..8 in this extend, 9 decoded next
    Full slots are a scrambled permutation; the SWA slots of the live window are another one, and row 2's
    positions 0..1 (older than its first query's window) are already freed: they map to SWA slot 0."""

    ROWS, PREFIX, EXTEND = (2, 0), (5, 0), (7, 9)

    def __init__(self, native_cls, seed=0):
        self.gen = torch.Generator().manual_seed(seed)
        self.req_to_token = torch.zeros(3, 16, dtype=torch.int64)
        full_slots = (torch.randperm(40, generator=self.gen) + 1).tolist()
        swa_slots = (torch.randperm(30, generator=self.gen) + 1).tolist()
        mapping = torch.zeros(42, dtype=torch.int64)
        for row, n in zip(self.ROWS, (13, 10)):
            for pos in range(n):
                full = full_slots.pop()
                self.req_to_token[row, pos] = full
                if not (row == 2 and pos < 2):
                    mapping[full] = swa_slots.pop()
        self.pool = FakeSWAKVPool(42, 32, mapping)
        runner = types.SimpleNamespace(device="cpu", token_to_kv_pool=self.pool,
                                       req_to_token_pool=types.SimpleNamespace(req_to_token=self.req_to_token))
        self.backend = native_cls(runner)
        self.keys = {lid: {row: torch.empty(0, KV_HEADS[lid], D) for row in self.ROWS} for lid in KV_HEADS}
        self.values = {lid: {row: torch.empty(0, KV_HEADS[lid], DV) for row in self.ROWS} for lid in KV_HEADS}
        self.sinks = torch.randn(HQ, generator=self.gen) * 2
        self._store_prefix()

    def _store_prefix(self):
        for lid in KV_HEADS:
            k, v = self._new_kv(lid, self.PREFIX[0])
            self._append(lid, 2, k, v)
            slots = self.req_to_token[2, : self.PREFIX[0]]
            if lid == SWA:
                slots = slots[2:]  # positions 0..1 were freed from the SWA pool
                k, v = k[2:], v[2:]
            self.pool.k[lid][self.pool.translate_loc_from_full_to_swa(slots) if lid == SWA else slots] = k
            self.pool.v[lid][self.pool.translate_loc_from_full_to_swa(slots) if lid == SWA else slots] = v

    def _new_kv(self, lid, n):
        return torch.randn(n, KV_HEADS[lid], D, generator=self.gen), torch.randn(n, KV_HEADS[lid], DV, generator=self.gen)

    def _append(self, lid, row, k, v):
        self.keys[lid][row] = torch.cat([self.keys[lid][row], k])
        self.values[lid][row] = torch.cat([self.values[lid][row], v])

    def extend_batch(self):
        seq = [p + e for p, e in zip(self.PREFIX, self.EXTEND)]
        loc = torch.cat([self.req_to_token[row, p:s] for row, p, s in zip(self.ROWS, self.PREFIX, seq)])
        return self._batch(seq, loc, extend_prefix_lens=torch.tensor(self.PREFIX),
                           extend_seq_lens=torch.tensor(self.EXTEND))

    def decode_batch(self):
        seq = [p + e + 1 for p, e in zip(self.PREFIX, self.EXTEND)]
        loc = torch.stack([self.req_to_token[row, s - 1] for row, s in zip(self.ROWS, seq)])
        return self._batch(seq, loc)

    def _batch(self, seq, loc, **extra):
        batch = types.SimpleNamespace(req_pool_indices=torch.tensor(self.ROWS), seq_lens=torch.tensor(seq),
                                      out_cache_loc=loc, encoder_lens=None, **extra)
        self.backend.init_forward_metadata(batch)
        return batch

    def step(self, lid, q_lens):
        """New q [T, HQ * D], k, v for this step's tokens (rows in order); k/v appended to the logical K/V."""
        ks, vs = [], []
        for row, n in zip(self.ROWS, q_lens):
            k, v = self._new_kv(lid, n)
            self._append(lid, row, k, v)
            ks.append(k)
            vs.append(v)
        q = torch.randn(sum(q_lens), HQ * D, generator=self.gen)
        return q, torch.cat(ks), torch.cat(vs)

    def reference(self, lid, q, q_lens, sinks):
        window = WINDOW if lid == SWA else -1
        outs, start = [], 0
        for row, n in zip(self.ROWS, q_lens):
            keys, values = self.keys[lid][row], self.values[lid][row]
            outs.append(naive_sink_attention(q[start : start + n].view(n, HQ, D), keys, values, scale=D**-0.5,
                                             sinks=sinks, window=window, q_pos0=keys.shape[0] - n))
            start += n
        return torch.cat(outs).view(-1, HQ * DV)


def _run(world, cls, lid, sinks, hooked: bool):
    """Extend then decode on layer `lid`; returns the two outputs and their references."""
    extend = _hooked(cls, "forward_extend") if hooked else cls.forward_extend
    decode = _hooked(cls, "forward_decode") if hooked else cls.forward_decode
    kw = {} if sinks is None and not hooked else {"sinks": sinks}
    results = []
    for make_batch, q_lens, forward in ((world.extend_batch, World.EXTEND, extend), (world.decode_batch, (1, 1), decode)):
        batch = make_batch()  # sets the backend's per-forward SWA write slots
        q, k, v = world.step(lid, q_lens)
        got = forward(world.backend, q, k, v, _layer(lid), batch, **kw)
        results.append((got, world.reference(lid, q, q_lens, sinks)))
    return results


def _close(got, want) -> bool:
    return got.shape == want.shape and bool((got - want).abs().max() <= TOL)


def test_targets_exist_in_sglang_source():
    """Every hooked attribute is a method of torch_native's backend class (guards against SGLang moving them)."""
    tree = ast.parse(TORCH_NATIVE.read_text())
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "TorchNativeAttnBackend")
    methods = {n.name for n in cls.body if isinstance(n, ast.FunctionDef)}
    for target in swa_fixes.TARGETS:
        module, _, rest = target.rpartition(".TorchNativeAttnBackend.")
        assert (SGLANG.parent / Path(*module.split("."))).with_suffix(".py") == TORCH_NATIVE and rest in methods
    names = []

    class Registry:
        register = staticmethod(lambda target, hook, kind: names.append((target, hook.__name__, kind)))

    swa_fixes.install(Registry, types.SimpleNamespace(AROUND="around"))
    assert [(t, n, k) for t, n, k in names] == [(t, n, "around") for t, n in swa_fixes.TARGETS.items()]


def test_attention_sinks_on_swa_layer(native):
    """Fix 1 + 2 on MiMo's SWA layers (sinks given): stock torch_native raises TypeError on `sinks`."""
    world = World(native, seed=1)
    with pytest.raises(TypeError, match="sinks"):
        native.forward_extend(world.backend, *world.step(SWA, World.EXTEND), _layer(SWA), world.extend_batch(),
                              sinks=world.sinks)
    world = World(native, seed=1)
    for got, want in _run(world, native, SWA, world.sinks, hooked=True):
        assert _close(got, want)


def test_swa_pool_reads_translated_window(native):
    """Fix 2 alone (SWA layer, no sinks): stock torch_native reads the SWA sub-pool with full-pool slots;
    the fix reads the window's translated slots and never a freed one. (Here full slots run past the
    smaller SWA sub-pool, as they do in a server, so stock indexes out of bounds; in range it reads other
    tokens' rows.)"""
    with pytest.raises(IndexError, match="out of bounds"):
        _run(World(native, seed=2), native, SWA, None, hooked=False)
    for got, want in _run(World(native, seed=2), native, SWA, None, hooked=True):
        assert _close(got, want)


def test_full_attention_layer_with_sinks_none_keeps_stock_path(native):
    """MiMo's full-attention layers pass `sinks=None`: the stock code runs (and is right) after the fix."""
    for got, want in _run(World(native, seed=3), native, FULL, None, hooked=True):
        assert _close(got, want)
    for got, want in _run(World(native, seed=3), native, FULL, None, hooked=False):
        assert _close(got, want)


def test_full_attention_layer_with_sinks(native):
    """`add_full_attention_sink_bias` checkpoints: sinks on a full-pool layer (no window, no translation)."""
    world = World(native, seed=4)
    for got, want in _run(world, native, FULL, world.sinks, hooked=True):
        assert _close(got, want)
