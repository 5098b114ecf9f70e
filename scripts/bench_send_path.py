"""Send path of prfaas_zmq: scheduler-thread cost of one prefill chunk, and end-to-end goodput (issue 13).

Pool layout like Qwen3-Next at TP 1: 24 K/V buffers (12 full-attention layers × K, V; 2 KV heads × 256 dim
in bf16 = 1 KiB per token) + 36 GDN state buffers + 1 aux buffer. Pages: page size 1 or 64; "contiguous"
= one run, "fragmented" = a random permutation of a pool 4× the chunk (what a long-running server holds).

    .venv/bin/python scripts/bench_send_path.py --out out/bench_send_path.json            # everything
    .venv/bin/python scripts/bench_send_path.py --only scheduler --repeat 5                 # thread cost only

Measured per configuration:
- `legacy_ms`: the pre-issue-13 scheduler-thread work of `add_transfer_request` — `flat()`, byte regions
  per page and buffer (`item_regions`), the state/aux tail, and `ZmqSender.send`'s `check_region` per region
  — rebuilt here from the still-present layout helpers, so it can be measured beside the new path;
- `ours_ms`: `PrefillManager.add_transfer_request` as SGLang calls it (a real manager and `ZmqSender`
  without SGLang's constructor, as in tests/fast/test_backend_hardening.py), up to its return;
- `mooncake_ms`: SGLang's `MooncakeKVManager.add_transfer_request` on the same indices (see `_mooncake`),
  plus `mooncake_group_ms`, its worker-thread run grouping (`group_concurrent_contiguous`) per chunk;
- goodput (`--only goodput`): a whole request (chunks + states + aux) over loopback TCP through real
  `ZmqSender`/`ZmqReceiver` threads, from the first add_transfer_request to the receiver's DONE.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import time
from dataclasses import dataclass
from types import SimpleNamespace

import numpy as np

KV_BUFFERS = 24
KV_BYTES_PER_TOKEN = 1024  # 2 heads × 256 dim × 2 B
STATE_BUFFERS = 36
CONV_STATE_BYTES = 3 * 2 * 2048 * 2  # per GDN layer, per slot (an approximation of Qwen3-Next's conv state)
TEMPORAL_STATE_BYTES = 16 * 128 * 128 * 4  # 1 MiB per GDN layer, per slot (fp32 recurrent state)
AUX_BYTES = 64


@dataclass(frozen=True)
class Case:
    tokens: int
    page_size: int
    fragmented: bool

    @property
    def name(self) -> str:
        return f"{self.tokens}tok-page{self.page_size}-{'fragmented' if self.fragmented else 'contiguous'}"

    @property
    def pages(self) -> int:
        return self.tokens // self.page_size


def kv_args(case: Case, arrays: list[np.ndarray] | None = None, slots: int = 4):
    """SGLang-shaped `KVArgs` over host numpy arrays (allocated unless `arrays` is given)."""
    pool_pages = 4 * case.pages + 1
    item = KV_BYTES_PER_TOKEN * case.page_size
    states = [CONV_STATE_BYTES] * (STATE_BUFFERS // 2) + [TEMPORAL_STATE_BYTES] * (STATE_BUFFERS // 2)
    sizes = [item * pool_pages] * KV_BUFFERS + [s * slots for s in states] + [AUX_BYTES * 8]
    if arrays is None:
        arrays = [np.zeros(n, np.uint8) for n in sizes]
    ptrs = [a.ctypes.data for a in arrays]
    k = KV_BUFFERS
    args = SimpleNamespace(
        kv_data_ptrs=ptrs[:k], kv_data_lens=sizes[:k], kv_item_lens=[item] * k,
        state_data_ptrs=[ptrs[k:k + STATE_BUFFERS]], state_data_lens=[sizes[k:k + STATE_BUFFERS]],
        state_item_lens=[states], state_types=["mamba"],
        aux_data_ptrs=ptrs[-1:], aux_data_lens=sizes[-1:], aux_item_lens=[AUX_BYTES], page_size=case.page_size,
        engine_rank=0, gpu_id=0)
    return args, arrays


def chunk_pages(case: Case, seed: int = 0) -> np.ndarray:
    if not case.fragmented:
        return np.arange(1, case.pages + 1, dtype=np.int32)
    rng = np.random.default_rng(seed)
    return (rng.permutation(4 * case.pages)[: case.pages] + 1).astype(np.int32)


def timed(fn, repeat: int) -> float:
    """Median wall time of `fn()` in ms."""
    out = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        out.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(out)


# -- the pre-issue-13 scheduler-thread work -------------------------------------------------------------
def legacy_ms(case: Case, repeat: int) -> float:
    from prfaas_sgl.backend.memory import KVMemory, flat
    from prfaas_sgl.transfer.layout import item_regions

    args, _ = kv_args(case)
    mem = KVMemory.of(args)
    pages = chunk_pages(case)

    def run() -> None:
        regions = item_regions(mem.layout, mem.kv_ids, flat(pages))
        for ids in mem.state_ids:
            regions += item_regions(mem.layout, ids, flat([np.array([0])]))
        regions += item_regions(mem.layout, mem.aux_ids, [0])
        for r in regions:  # ZmqSender.send checked every region on the caller's thread
            mem.layout.check_region(r)

    return timed(run, repeat)


def _mooncake(case: Case, repeat: int) -> dict:
    """SGLang's mooncake `add_transfer_request` (a queue put after status checks) on a manager built
    without its constructor (a real one needs a Mooncake transfer engine and a bootstrap server), and its
    transfer worker's per-chunk index grouping, which is the CPU work mooncake moves off the scheduler."""
    import queue

    from sglang.srt.disaggregation.base.conn import KVPoll
    from sglang.srt.disaggregation.common.utils import group_concurrent_contiguous
    from sglang.srt.disaggregation.mooncake.conn import MooncakeKVManager
    from sglang.srt.disaggregation.utils import DisaggregationMode

    m = object.__new__(MooncakeKVManager)
    m.disaggregation_mode = DisaggregationMode.PREFILL
    m.request_status = {7: KVPoll.WaitingForInput}
    m.transfer_infos = {7: {"10.0.0.2:5555": object()}}
    m.transfer_queues = [queue.SimpleQueue() for _ in range(4)]
    m.failure_records, m.failure_lock = {}, __import__("threading").Lock()
    pages = chunk_pages(case)
    dst = chunk_pages(Case(case.tokens, case.page_size, True), seed=1)

    def put() -> None:
        m.add_transfer_request(7, pages, slice(0, len(pages)), False)

    out = {"mooncake_ms": timed(put, repeat),
           "mooncake_group_ms": timed(lambda: group_concurrent_contiguous(pages, dst), repeat)}
    for q in m.transfer_queues:
        while not q.empty():
            q.get()
    return out


def scheduler_case(case: Case, repeat: int) -> dict:
    row = {"case": case.name, "legacy_ms": legacy_ms(case, repeat)}
    try:
        row.update(_mooncake(case, repeat))
    except Exception as e:  # noqa: BLE001 - reported in the JSON, the run goes on
        row["mooncake_error"] = f"{type(e).__name__}: {e}"
    return row


def cases(tokens: int) -> list[Case]:
    return [Case(tokens, p, f) for p in (1, 64) for f in (False, True)]


def environment() -> dict:
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    return {"commit": commit, "host": platform.node(), "cpus": os.cpu_count(), "loadavg": os.getloadavg(),
            "python": platform.python_version()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=8192, help="tokens per prefill chunk")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--only", choices=["scheduler", "goodput"], default=None)
    ap.add_argument("--out", default="out/bench_send_path.json")
    a = ap.parse_args()
    result = {"env": environment(), "scheduler": [], "goodput": []}
    if a.only in (None, "scheduler"):
        for case in cases(a.tokens):
            row = scheduler_case(case, a.repeat)
            print(json.dumps(row))
            result["scheduler"].append(row)
    result["env"]["loadavg_end"] = os.getloadavg()
    os.makedirs(os.path.dirname(a.out) or ".", exist_ok=True)
    with open(a.out, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
