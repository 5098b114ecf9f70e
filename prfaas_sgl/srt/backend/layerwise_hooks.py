"""The SGLang side of layer-group streaming (`layerwise.py`): AROUND `Scheduler.run_batch` on a prefill
server, and a torch forward hook on every `RadixAttention` of the model.

    run_batch(batch)                              scheduler thread
      every request streams? ── no ──▶ SGLang's run_batch as is (the chunk path)
      gates = streamer.begin()                    one per layer group of this forward
      per request: pages of this extend ─▶ PrefillManager.stream_groups: one send per group, parked
      SGLang's run_batch ─▶ forward: RadixAttention(layer) ─hook─▶ streamer.on_layer ─▶ gate opens
      streamer.end(gates)                         a gate no hook opened opens now (counted apart)
    later, after the result: SGLang's send_kv_chunk ─▶ add_transfer_request: the rest (states, aux)

A batch streams only when every request in it does (ours, bootstrapped, prompt >= min_tokens, not
aborted) and SGLang will run its layers as module calls (not a prefill CUDA graph replay). Anything
else keeps the chunk path, whole.
"""
from __future__ import annotations

import logging
from typing import Any

from prfaas_sgl.srt.backend.layerwise import LayerwiseStreamer, span

log = logging.getLogger(__name__)
RUN_BATCH = "sglang.srt.managers.scheduler.Scheduler.run_batch"
_HOOKED = "_prfaas_layerwise_hooks"  # set on the model once its attention layers carry our hook


def register(HookRegistry, HookType) -> None:
    HookRegistry.register(RUN_BATCH, around_run_batch, HookType.AROUND)


def around_run_batch(original, scheduler, batch, *args, **kwargs):
    streamer = _streamer_of(scheduler, batch)
    if streamer is None:
        return original(scheduler, batch, *args, **kwargs)
    gates = streamer.begin()
    try:
        split = streamer.splitter(gates)
        for req in batch.reqs:
            _stream(scheduler, streamer, req, split)
        result = original(scheduler, batch, *args, **kwargs)
    except BaseException:
        streamer.end(gates, ok=False)  # nothing of this forward is known to be written
        raise
    streamer.end(gates)
    return result


def _streamer_of(scheduler, batch) -> LayerwiseStreamer | None:
    """The streamer that serves every request of `batch`, or None: the batch keeps the chunk path."""
    reqs = getattr(batch, "reqs", None)
    if not reqs or not _is_prefill(scheduler) or not batch.forward_mode.is_extend():
        return None
    found = {id(s): s for s in map(_req_streamer, reqs)}
    streamer = next(iter(found.values()))
    if len(found) != 1 or streamer is None:
        return None
    _hook_model(scheduler, streamer)
    if not all(streamer.streams(len(r.origin_input_ids)) for r in reqs) or _replays_graph(scheduler, batch):
        return None
    return streamer


def _req_streamer(req) -> LayerwiseStreamer | None:
    sender = getattr(req, "disagg_kv_sender", None)
    if sender is None or getattr(req, "pending_bootstrap", False) or _finished(req):
        return None
    return getattr(getattr(sender, "kv_mgr", None), "layerwise", None)


def _finished(req) -> bool:
    try:
        return bool(req.finished())
    except Exception:  # a request SGLang can answer nothing about streams nothing
        return True


def _is_prefill(scheduler) -> bool:
    mode = getattr(scheduler, "disaggregation_mode", None)
    return getattr(mode, "value", mode) == "prefill"


def _replays_graph(scheduler, batch) -> bool:
    """A batch a prefill CUDA graph may replay runs no module forward: no hook would fire. Conservative:
    any batch within the graphs' captured token count (model_runner.py:2036 decides the rest)."""
    runner = getattr(_model_runner(scheduler), "prefill_cuda_graph_runner", None)
    if runner is None or type(runner).__name__ == "EagerRunner":
        return False
    return int(getattr(batch, "extend_num_tokens", 0) or 0) <= int(getattr(runner, "max_num_tokens", 0) or 0)


def _model_runner(scheduler) -> Any:
    return getattr(getattr(scheduler, "tp_worker", None), "model_runner", None)


def _hook_model(scheduler, streamer: LayerwiseStreamer) -> None:
    """A forward hook on every RadixAttention (once per model), as SGLang's own PytHooks attach; the
    streamer's groups come from the same modules' layer ids."""
    model = getattr(_model_runner(scheduler), "model", None)
    if model is None or getattr(model, _HOOKED, False):
        return
    setattr(model, _HOOKED, True)
    from sglang.srt.layers.radix_attention import RadixAttention

    layers = [m for m in model.modules() if isinstance(m, RadixAttention)]
    problem = streamer.bind([m.layer_id for m in layers],
                            [m.layer_id for m in layers if int(getattr(m, "sliding_window_size", -1) or -1) <= 0])
    if problem:
        log.warning("prfaas_zmq layer-wise streaming off (every chunk leaves after its forward): %s", problem)
        return
    for m in layers:
        m.register_forward_hook(lambda module, _args, _out: streamer.on_layer(module.layer_id))
    log.info("prfaas_zmq layer-wise: %d attention layers hooked, layer groups %s", len(layers),
             [g.layers for g in streamer.groups])


def _stream(scheduler, streamer: LayerwiseStreamer, req, split) -> None:
    """Queue this forward's pages of `req` (see `layerwise.span`) as layer-group sends."""
    sender = req.disagg_kv_sender
    page_size = scheduler.token_to_kv_pool_allocator.page_size
    room = sender.bootstrap_room
    sp = span(int(req.disagg_decode_prefix_len), streamer.queued(room, int(sender.curr_idx)), page_size,
              int(req.extend_end), len(req.origin_input_ids))
    if sp is None:
        return
    pages, event = _page_ids(scheduler, req, sp.tok_from, sp.tok_to, page_size)
    sender.kv_mgr.stream_groups(room, pages, sp.page_from, split, event)


def _page_ids(scheduler, req, tok_from: int, tok_to: int, page_size: int) -> tuple[Any, Any]:
    """Page ids of tokens [tok_from, tok_to) of `req`, as SGLang's `_send_kv_chunk` takes them; on GPUs
    copied to pinned memory behind an event (the stager syncs it), so this thread does not wait."""
    kv = scheduler.req_to_token_pool.req_to_token[req.kv.req_pool_idx, tok_from:tok_to]
    kv = scheduler.token_to_kv_pool_allocator.translate_kv_indices_for_transfer(kv)
    if not kv.is_cuda:
        return (kv[::page_size] // page_size).numpy(), None
    import torch

    dev = kv[::page_size] // page_size
    host = torch.empty(dev.shape, dtype=dev.dtype, device="cpu", pin_memory=True)
    host.copy_(dev, non_blocking=True)
    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream())
    return host, event
