"""Layer-group streaming on a prfaas_zmq prefill: the bookkeeping (which pages of a request leave before
its forward, which SGLang then no longer sends) and the per-forward gates (`transfer/gates.py`). The
SGLang hooks that drive it live in `layerwise_hooks`; the sends go through `PrefillManager.stream_groups`.

Page offsets are the transfer's own (SGLang's `index_slice`: page 0 is the first page past the decode's
cached prefix). Both paths queue pages in order, so one count per room says what has been queued:

    tokens: [ decode prefix | queued: pages 0 .. P-1 | this forward's extend ...... extend_end | later ]
            0               base                     base + P * page_size
    span:                                            tok_from                 tok_to = extend_end,
                                                                             rounded down to a page
                                                                             unless it ends the prompt

A middle chunk's partial last page is left for the next send, as SGLang does (its other tokens are not
computed yet). SGLang's own send of a chunk that streamed finds its pages queued already (`trim`) and sends
only the rest: on the last chunk, the states and the aux row.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from prfaas_sgl.srt.backend.layer_groups import LayerGroup, kv_buffer_layers, layer_groups
from prfaas_sgl.srt.backend.memory import KVMemory, index_len
from prfaas_sgl.transfer.config import LayerwiseConfig
from prfaas_sgl.transfer.gates import LayerGate, layer_batches
from prfaas_sgl.transfer.items import ItemBatch


@dataclass(frozen=True, slots=True)
class Span:
    """Tokens [tok_from, tok_to) of a request = the transfer's pages from `page_from` on."""

    tok_from: int
    tok_to: int
    page_from: int


def span(base: int, queued_pages: int, page_size: int, extend_end: int, input_len: int) -> Span | None:
    """What of a request this forward's layers can send: from the first page not queued yet to the end
    of this forward's extend (see the module diagram); None when that is empty."""
    tok_from = base + queued_pages * page_size
    tok_to = min(extend_end, input_len)
    if tok_to < input_len:
        tok_to -= tok_to % page_size
    return Span(tok_from, tok_to, queued_pages) if tok_to > tok_from else None


def trim(kv_indices: Any, index_slice: slice, queued_pages: int) -> tuple[Any, slice]:
    """SGLang's send of transfer pages `index_slice` less the first ones that are queued already."""
    start = index_slice.start or 0
    skip = min(max(0, queued_pages - start), index_len(kv_indices))
    if skip == 0:
        return kv_indices, index_slice
    return kv_indices[skip:], slice(start + skip, index_slice.stop)


class LayerwiseStreamer:
    """One per prefill manager; scheduler thread only (the forward hooks run there too).

    `kv_ids[k]` is the layout id of K/V buffer k and `buffer_layers[k]` its layer: a model layer id when
    SGLang's pool names them (`kv_layer_ids`), else a position among the pool's layers (`positional`),
    which `bind` maps onto the model's attention layers once the model is known. `count` is the
    transport's stats counter (`StatsBook.count`); `make_event` makes the gate's device event (None on
    CPU: the hook runs after the group computed)."""

    def __init__(self, cfg: LayerwiseConfig, kv_ids: Sequence[int], buffer_layers: Sequence[int], positional: bool,
                 timeout_s: float, count: Callable[[str, int], None],
                 make_event: Callable[[], Any] | None = None) -> None:
        self.cfg, self.timeout_s = cfg, timeout_s
        self._kv_ids, self._buffer_layers, self._positional = tuple(kv_ids), tuple(buffer_layers), positional
        self.groups: tuple[LayerGroup, ...] = ()
        self._buffers: tuple[tuple[int, ...], ...] = ()
        self._count, self._make_event = count, make_event
        self._queued: dict[int, int] = {}  # room -> transfer pages queued so far, by either path
        self._active: dict[int, LayerGate] = {}  # layer id -> gate it completes, while a forward streams
        self._forwards = 0

    def bind(self, attention_layers: Sequence[int], full_layers: Sequence[int]) -> str | None:
        """Make the groups from the model's attention layer ids (`full_layers`: those without a sliding
        window); why streaming cannot apply, or None. A positional pool holds either every attention
        layer or (an SWA pool) only the full ones, in ascending id order."""
        layers = self._buffer_layers
        if self._positional:
            n = len(set(layers))
            ids = sorted(set(attention_layers)) if n == len(set(attention_layers)) else sorted(set(full_layers))
            if n != len(ids):
                return f"{n} layers of K/V buffers, but the model has {len(set(attention_layers))} attention layers"
            layers = tuple(ids[i] for i in layers)
        missing = set(layers) - set(attention_layers)
        if missing:
            return f"K/V buffers of layers {sorted(missing)} that run no RadixAttention"
        self.groups = layer_groups(self._kv_ids, layers, self.cfg.layers_per_group)
        self._buffers = tuple(g.buffer_ids for g in self.groups)
        return None

    def streams(self, input_len: int) -> bool:
        """Does a prompt of `input_len` tokens stream its layer groups (once `bind` made the groups)?"""
        return bool(self.groups) and input_len >= self.cfg.min_tokens

    # -- one forward ---------------------------------------------------------------------------------
    def begin(self) -> tuple[LayerGate, ...]:
        """The gates of the forward about to run, one per group; the hook opens them as layers finish."""
        self._forwards += 1
        gates = tuple(LayerGate(f"forward {self._forwards} layers {g.layers[0]}-{g.last_layer}", self.timeout_s,
                                self._make_event() if self._make_event else None) for g in self.groups)
        self._active = {g.last_layer: gate for g, gate in zip(self.groups, gates)}
        return gates

    def on_layer(self, layer_id: int) -> None:
        """Forward hook of the attention layer `layer_id`: its group's KV is written (CPU) or launched."""
        gate = self._active.get(layer_id)
        if gate is not None and not gate.is_open:
            gate.open()
            self._count("gates_opened_in_forward", 1)

    def end(self, gates: Sequence[LayerGate], ok: bool = True) -> None:
        """The forward returned (`ok`) or raised. Gates its hooks missed open now (a layer that ran outside
        a module call); after a failure they stay closed, so their sends fail at the gate's deadline."""
        self._active = {}
        for gate in gates:
            gate.forward_running = False
        for gate in gates:
            if ok and not gate.is_open:
                gate.open()
                self._count("gates_opened_after_forward", 1)

    # -- per room --------------------------------------------------------------------------------------
    def queued(self, room: int, sglang_pages: int) -> int:
        """Transfer pages of `room` queued so far; SGLang's own count (`CommonKVSender.curr_idx`) covers
        the pages it sent before the room first streamed."""
        return max(self._queued.get(room, 0), sglang_pages)

    def note_queued(self, room: int, stop: int) -> None:
        self._queued[room] = max(self._queued.get(room, 0), stop)

    def trim(self, room: int, kv_indices: Any, index_slice: slice) -> tuple[Any, slice]:
        """`trim` against this room's queued pages (SGLang's send after a streamed forward)."""
        queued = self._queued.get(room, 0)
        return trim(kv_indices, index_slice, queued) if queued else (kv_indices, index_slice)

    def splitter(self, gates: Sequence[LayerGate]) -> Callable[[ItemBatch], list[ItemBatch]]:
        """A chunk's pages as one batch per layer group, each behind its gate."""
        return lambda batch: layer_batches(batch, self._buffers, gates)

    def streamed(self, pages: int) -> None:
        self._count("pages_streamed", pages)

    def forget(self, room: int) -> None:
        self._queued.pop(room, None)


def make_streamer(cfg: LayerwiseConfig, kv_args: Any, memory: KVMemory, is_mla: bool, timeout_s: float,
                  stats: Any, cp_split: bool = False) -> LayerwiseStreamer | None:
    """The streamer of a prefill rank, or None when layer-wise streaming is off or cannot apply (no
    K/V buffers; K/V split over context-parallel ranks (`cp_split`, `kv_shard_size`), whose page
    slices SGLang filters per rank after the forward). `stats`: the sender's `StatsBook` (None: not counted)."""
    if not cfg.on or not memory.kv_ids or cp_split or int(getattr(kv_args, "kv_shard_size", 1) or 1) > 1:
        return None
    named = list(getattr(kv_args, "kv_layer_ids", None) or ())
    layers = kv_buffer_layers(named, len(memory.kv_ids), is_mla)
    make_event = None
    if memory.device != "cpu":
        import torch

        make_event = torch.cuda.Event
    count = stats.count if stats is not None else (lambda name, n: None)
    return LayerwiseStreamer(cfg, memory.kv_ids, layers, not named, timeout_s, count, make_event)
