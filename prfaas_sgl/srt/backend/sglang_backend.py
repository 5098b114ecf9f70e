"""Registers `prfaas_zmq` with SGLang through its hook registry (no fork), in every SGLang process:

- REPLACE `disaggregation.utils.TransferBackend` with an enum holding every original member plus
  PRFAAS_ZMQ (SGLang builds `TransferBackend(args.disaggregation_transfer_backend)` in the scheduler,
  tokenizer and bootstrap service, and compares members with `==`; the registry rebinds every module
  that imported the old enum, so all comparisons see the same members);
- `--disaggregation-transfer-backend prfaas_zmq` as a CLI choice;
- AROUND `disaggregation.utils.get_kv_class`: our classes for PRFAAS_ZMQ, SGLang's for the rest;
- AROUND `Scheduler.run_batch`: layer-group streaming (`layerwise_hooks`), a pass-through unless a
  prfaas_zmq prefill runs with `--prfaas-layerwise-layers-per-group`;
- AROUND `Scheduler.on_idle`: a PD scheduler of ours that only waits on transfers parks instead of
  spinning (`idle_park`), with `--sleep-on-idle`;
- AROUND `PrefillBootstrapQueue.can_prefill_before_bootstrap` and `process_disagg_prefill_inflight_queue`:
  optimistic prefill counted and capped (`optimistic`, `--prfaas-optimistic-max-held-tokens`).

Every other place SGLang tests the backend name (`== "mooncake"` for staging buffers, HiSparse, DCP,
layer split, unified memory, prefill_complete allocation) concerns features prfaas_zmq does not offer,
and SGLang then rejects the combination with its own message.
"""
from __future__ import annotations

import enum

BACKEND = "prfaas_zmq"
MEMBER = "PRFAAS_ZMQ"
_UTILS = "sglang.srt.disaggregation.utils"


def register(HookRegistry, HookType) -> None:
    from sglang.srt.arg_groups import choices
    from sglang.srt.disaggregation import utils

    if BACKEND not in choices.DISAGG_TRANSFER_BACKEND_CHOICES:
        choices.add_disagg_transfer_backend_choices([BACKEND])
    if MEMBER not in utils.TransferBackend.__members__:
        HookRegistry.register(f"{_UTILS}.TransferBackend", extend_enum(utils.TransferBackend), HookType.REPLACE)
    HookRegistry.register(f"{_UTILS}.get_kv_class", _around_get_kv_class, HookType.AROUND)
    from prfaas_sgl.srt.backend import layerwise_hooks  # inert unless a prefill's streamer is on

    layerwise_hooks.register(HookRegistry, HookType)
    from prfaas_sgl.srt.backend import idle_park

    idle_park.register(HookRegistry, HookType)
    from prfaas_sgl.srt.backend import optimistic

    optimistic.register(HookRegistry, HookType)


def extend_enum(original: type[enum.Enum]) -> type[enum.Enum]:
    """`original`'s members (same names, values, order) plus MEMBER = BACKEND."""
    members = {m.name: m.value for m in original} | {MEMBER: BACKEND}
    return enum.Enum(original.__name__, members, module=original.__module__, qualname=original.__qualname__)


def _around_get_kv_class(original, transfer_backend, class_type, *args, **kwargs):
    if getattr(transfer_backend, "value", transfer_backend) != BACKEND or class_type.value == "kvargs":
        return original(transfer_backend, class_type, *args, **kwargs)
    from prfaas_sgl.srt.backend.conn import CLASSES

    return CLASSES.get(class_type.value)
