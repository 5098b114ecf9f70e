"""Paged prefill and decode over pool-shaped pages: FlashInfer on CUDA, the torch reference on CPU.

One seeded batch (pages handed out in shuffled order, as a pool does after churn), a warmup, then
`--repeats` timed calls; the plan is made once per batch, as a serving step would. On CUDA the torch
reference runs on the same GPU beside FlashInfer (speedup, max abs difference). Prints one JSON object
(median ms per call, tokens/s) that can be compared across runs on the same device kind.
Run:  /work/main/.venv/bin/python scripts/bench_paged_attention.py --device cuda --out pa.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from dataclasses import asdict, dataclass

import torch
from prfaas_sgl.kernels.paged_attention import (
    AttentionSpec,
    FlashInferPagedAttention,
    build_paged_batch,
    naive_paged_attention,
    paged_decode,
    paged_prefill,
)


@dataclass(frozen=True, slots=True)
class BenchConfig:
    device: str = "cpu"
    dtype: str = "bfloat16"
    seed: int = 0
    batch: int = 8
    context: int = 4096  # kv_len per request (tokens)
    chunk: int = 512  # prefill q_len per request (tokens)
    page_size: int = 64
    num_qo_heads: int = 16
    num_kv_heads: int = 2
    head_dim: int = 256
    warmup: int = 3
    repeats: int = 20

    def __post_init__(self) -> None:
        if not 1 <= self.chunk <= self.context:
            raise ValueError(f"chunk={self.chunk} must be in [1, context={self.context}]")
        if self.repeats < 1 or self.warmup < 0:
            raise ValueError("set --repeats >= 1 and --warmup >= 0")


def make_pages(cfg: BenchConfig, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, list[list[int]]]:
    gen = torch.Generator().manual_seed(cfg.seed)
    per_req = -(-cfg.context // cfg.page_size)
    perm = torch.randperm(per_req * cfg.batch, generator=gen).tolist()
    tables = [perm[i * per_req:(i + 1) * per_req] for i in range(cfg.batch)]
    shape = (per_req * cfg.batch, cfg.page_size, cfg.num_kv_heads, cfg.head_dim)
    k, v = (torch.randn(shape, generator=gen).to(dtype).to(cfg.device) for _ in range(2))
    return k, v, tables


def time_calls(fn, cfg: BenchConfig) -> float:
    """Median wall ms per call (CUDA synchronised around each call)."""
    sync = torch.cuda.synchronize if cfg.device.startswith("cuda") else (lambda: None)
    for _ in range(cfg.warmup):
        fn()
    samples = []
    for _ in range(cfg.repeats):
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        samples.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(samples)


def run(cfg: BenchConfig) -> dict:
    """On CUDA: FlashInfer and the torch reference side by side on the same pages and queries
    (speedup = reference ms / FlashInfer ms, and their max abs difference); on CPU: the reference."""
    dtype = getattr(torch, cfg.dtype)
    spec = AttentionSpec(cfg.num_qo_heads, cfg.num_kv_heads, cfg.head_dim, cfg.page_size)
    k, v, tables = make_pages(cfg, dtype)
    runner = FlashInferPagedAttention(cfg.device) if cfg.device.startswith("cuda") else None
    kv_lens = [cfg.context] * cfg.batch
    gen = torch.Generator().manual_seed(cfg.seed + 1)
    results = {}
    for name, q_len, call in (("prefill", cfg.chunk, paged_prefill), ("decode", 1, paged_decode)):
        batch = build_paged_batch(tables, kv_lens, [q_len] * cfg.batch, cfg.page_size)
        q = torch.randn(q_len * cfg.batch, spec.num_qo_heads, spec.head_dim, generator=gen)
        q = q.to(dtype).to(cfg.device)
        ref_ms = time_calls(lambda: naive_paged_attention(q, k, v, batch, spec), cfg)  # noqa: B023
        row = {"reference_median_ms": round(ref_ms, 4),
               "reference_q_tokens_per_s": round(q.shape[0] / ref_ms * 1e3, 1)}
        if runner is not None:
            ms = time_calls(lambda: call(q, k, v, batch, spec, runner), cfg)  # noqa: B023 (called now)
            diff = (call(q, k, v, batch, spec, runner).float()
                    - naive_paged_attention(q, k, v, batch, spec).float()).abs().max().item()
            row |= {"flashinfer_median_ms": round(ms, 4),
                    "flashinfer_q_tokens_per_s": round(q.shape[0] / ms * 1e3, 1),
                    "speedup_vs_reference": round(ref_ms / ms, 2), "max_abs_diff": diff}
        results[name] = row
    return {"config": asdict(cfg), "device_name": _device_name(cfg.device), **results}


def _device_name(device: str) -> str:
    return torch.cuda.get_device_name(device) if device.startswith("cuda") else "cpu"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for f, default in asdict(BenchConfig()).items():
        p.add_argument(f"--{f.replace('_', '-')}", type=type(default), default=default)
    p.add_argument("--out", default=None, help="also write the JSON here")
    args = vars(p.parse_args())
    out = args.pop("out")
    text = json.dumps(run(BenchConfig(**args)), indent=2)
    print(text)
    if out:
        with open(out, "w") as fh:
            fh.write(text + "\n")


if __name__ == "__main__":
    main()
