"""Thin wrappers over FlashInfer's batch paged-KV prefill and decode (flashinfer_python 0.7.2).

flashinfer is imported only when a runner is built: it imports on a machine without a GPU, but every
kernel call there fails, so nothing in this module runs on CPU tensors.

Cost model: `plan()` reads the page table on the host and writes a schedule into the wrapper's
workspace; `run()` launches the kernel. A runner plans once per (batch, spec, dtypes) and reuses
the plan for every layer that passes the same PagedBatch object, as FlashInfer intends.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from .spec import AttentionSpec, PagedBatch

DEFAULT_WORKSPACE_BYTES = 128 * 1024 * 1024  # FlashInfer's recommended float workspace (split-k partials)
# The kernel family SGLang 0.5.23's flashinfer backend builds its paged prefill and decode wrappers with
# (FlashInferAttnBackend: prefill_backend = decode_backend = "fa2"). FlashInfer's default, "auto", picks
# the Hopper FA3 kernels on sm_90: another kernel than SGLang runs, and its JIT build did not finish in
# 240 s per module on an H200 (the GPU check, 2026-11-26), where the FA2 decode modules built in seconds.
PAGED_BACKEND = "fa2"
# Head dims whose paged prefill and decode were checked against the reference on an H100 (see the
# GPU tests). FlashInfer 0.7.2 itself validates nothing: its FA2 prefill faults (illegal memory
# access, which poisons the CUDA context) for head dims that are not multiples of 64, e.g. 80, and
# returns wrong numbers for ones not a multiple of 16 (flashinfer-ai/flashinfer#4299, seen here
# with head_dim 80), so the wrapper refuses them before any kernel is planned.
SUPPORTED_HEAD_DIMS = (64, 128, 256)


@dataclass(frozen=True, slots=True)
class _Planned:
    batch: PagedBatch
    spec: AttentionSpec
    q_dtype: torch.dtype
    kv_dtype: torch.dtype


class PlanCache:
    """What each wrapper's current plan was made for. A plan is reused only for the SAME PagedBatch
    object (held here, so its id cannot be recycled): comparing page tables by value would cost a
    device sync or a host walk per layer, which is what planning once per batch avoids."""

    def __init__(self) -> None:
        self._last: dict[str, _Planned] = {}

    def stale(self, slot: str, batch: PagedBatch, spec: AttentionSpec, q_dtype: torch.dtype,
              kv_dtype: torch.dtype) -> bool:
        """True (and records the new key) when wrapper `slot` must plan before it runs."""
        prev = self._last.get(slot)
        if (prev is not None and prev.batch is batch and prev.spec == spec
                and prev.q_dtype == q_dtype and prev.kv_dtype == kv_dtype):
            return False
        self._last[slot] = _Planned(batch, spec, q_dtype, kv_dtype)
        return True


class FlashInferPagedAttention:
    """One per device (per process): one zeroed float workspace, allocated here and never again,
    shared by the prefill and decode wrappers (their kernels run one after another on one stream).
    Wrappers are built on first use; FlashInfer keeps its own small int workspace per wrapper."""

    def __init__(self, device: torch.device | str, workspace_bytes: int = DEFAULT_WORKSPACE_BYTES) -> None:
        import flashinfer  # lazy: see the module docstring

        self._fi = flashinfer
        self.device = torch.device(device)
        if self.device.type != "cuda":
            raise ValueError(f"FlashInfer kernels need a CUDA device, got {self.device}; "
                             f"use kernels.paged_attention.naive on CPU")
        # decode's wrapper requires a zero-initialised workspace on first use
        self.workspace = torch.zeros(workspace_bytes, dtype=torch.uint8, device=self.device)
        self._prefill: Any = None
        self._decode: dict[bool, Any] = {}
        self._plans = PlanCache()

    def prefill(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                batch: PagedBatch, spec: AttentionSpec, out: torch.Tensor | None = None) -> torch.Tensor:
        """Causal attention of q [total_q, Hq, D] over NHD pages; see `paged_prefill`."""
        check_supported(spec)
        if self._prefill is None:
            self._prefill = self._fi.BatchPrefillWithPagedKVCacheWrapper(self.workspace, "NHD",
                                                                     backend=PAGED_BACKEND)
        w = self._prefill
        if self._plans.stale("prefill", batch, spec, q.dtype, k_cache.dtype):
            w.plan(batch.qo_indptr, batch.kv_indptr, batch.kv_indices, batch.kv_last_page_len,
                   spec.num_qo_heads, spec.num_kv_heads, spec.head_dim, spec.page_size,
                   causal=True, **_common_plan_args(spec, q, k_cache))
        return w.run(q, (k_cache, v_cache), out=out)

    def decode(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
               batch: PagedBatch, spec: AttentionSpec, out: torch.Tensor | None = None) -> torch.Tensor:
        """One query per request, q [B, Hq, D]; see `paged_decode`."""
        check_supported(spec)
        tensor_cores = use_tensor_cores(spec, k_cache.dtype)
        w = self._decode.get(tensor_cores)
        if w is None:
            w = self._fi.BatchDecodeWithPagedKVCacheWrapper(self.workspace, "NHD", backend=PAGED_BACKEND,
                                                            use_tensor_cores=tensor_cores)
            self._decode[tensor_cores] = w
        if self._plans.stale(f"decode-tc{int(tensor_cores)}", batch, spec, q.dtype, k_cache.dtype):
            w.plan(batch.kv_indptr, batch.kv_indices, batch.kv_last_page_len,
                   spec.num_qo_heads, spec.num_kv_heads, spec.head_dim, spec.page_size,
                   **_common_plan_args(spec, q, k_cache))
        return w.run(q, (k_cache, v_cache), out=out)


def check_supported(spec: AttentionSpec) -> None:
    """Raise before a head dim FlashInfer would fault on or get wrong reaches it. Checked on every
    call, ahead of the plan cache: checking only when replanning would let a retry with the same
    batch and spec find the key already recorded and run on the previous plan."""
    if spec.head_dim not in SUPPORTED_HEAD_DIMS:
        raise ValueError(f"FlashInfer paged attention supports head_dim in {SUPPORTED_HEAD_DIMS}, got "
                         f"{spec.head_dim} (flashinfer 0.7.2 faults or returns wrong results for it); "
                         f"run this layer with kernels.paged_attention.naive instead")


def _common_plan_args(spec: AttentionSpec, q: torch.Tensor, k: torch.Tensor) -> dict[str, Any]:
    return {"sm_scale": spec.scale, "window_left": spec.window_left,
            "logits_soft_cap": spec.logits_soft_cap, "q_data_type": q.dtype, "kv_data_type": k.dtype}


def use_tensor_cores(spec: AttentionSpec, kv_dtype: torch.dtype) -> bool:
    """SGLang's rule (flashinfer_backend.should_use_tensor_core): with 16-bit KV, decode through the
    prefill (tensor-core) kernels once >= 4 query heads share a KV head; CUDA-core decode otherwise."""
    return kv_dtype in (torch.float16, torch.bfloat16) and spec.group_size >= 4
