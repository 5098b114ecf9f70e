"""prfaas_zmq's staged send path with the pools on CUDA vs on the host, in one invocation.

The layout and request of bench_send_path.py (Qwen3-Next at TP 1: 24 K/V buffers of 1 KiB per token, 36
GDN state buffers, one aux row; two chunks of --tokens tokens, the second with the 36 state slots and the
aux row; pages contiguous or fragmented over a pool 3x the chunk), sent by a `ZmqSender` to a
`ZmqReceiver` over loopback TCP, both in this process, pools of both sides on the same device:
  send_ms   wall time of `ZmqSender.send` per chunk (what `add_transfer_request` ends in, on the scheduler
            thread): the median over --repeat requests; `send_ms_max` the slowest
  gbit_s    the request's bytes over (first send -> receiver DONE), median
CUDA pools take the staged path's CUDA branches (side-stream gather into pinned slots, H2D landing);
host pools its numpy branches. Without SGLang (PrefillManager needs it), so it runs on a bare GPU machine.
Run:  python3 scripts/bench_send_device.py --devices cpu cuda --out send_device.json
"""
from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import sys
import time

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_send_path import (AUX_BYTES, CONV_STATE_BYTES, KV_BUFFERS, KV_BYTES_PER_TOKEN,  # noqa: E402
                             POOL_CHUNKS, STATE_BUFFERS, TEMPORAL_STATE_BYTES, Case, chunk_pages)

from prfaas_sgl.transfer.config import TransferConfig  # noqa: E402
from prfaas_sgl.transfer.items import ItemBatch, Items  # noqa: E402
from prfaas_sgl.transfer.layout import BufferSpec, MemoryLayout  # noqa: E402
from prfaas_sgl.transfer.receiver import ZmqReceiver  # noqa: E402
from prfaas_sgl.transfer.sender import ZmqSender  # noqa: E402
from prfaas_sgl.transfer.states import TransferState  # noqa: E402

CFG = TransferConfig(connections=4, timeout_s=60)
SLOTS = 4
IDS = itertools.count(1)


def layout(case: Case) -> MemoryLayout:
    item, pages = KV_BYTES_PER_TOKEN * case.page_size, POOL_CHUNKS * case.pages + 1
    states = [CONV_STATE_BYTES] * (STATE_BUFFERS // 2) + [TEMPORAL_STATE_BYTES] * (STATE_BUFFERS // 2)
    return MemoryLayout(tuple([BufferSpec("kv", item, pages)] * KV_BUFFERS
                              + [BufferSpec("state", s, SLOTS) for s in states] + [BufferSpec("aux", AUX_BYTES, 8)]))


def pools(lay: MemoryLayout, device: str, seed: int | None):
    """Tensors (K/V and states on `device`, aux on the host, as SGLang keeps them) and their registrations."""
    gen = torch.Generator().manual_seed(seed or 0)
    tensors, bufs, devs = [], [], []
    for spec in lay.buffers:
        dev = "cpu" if spec.kind == "aux" else device
        t = (torch.randint(0, 256, (spec.nbytes,), dtype=torch.uint8, generator=gen) if seed is not None
             else torch.zeros(spec.nbytes, dtype=torch.uint8)).to(dev)
        tensors.append(t)
        bufs.append(t.numpy() if dev == "cpu" else (t.data_ptr(), t.numel()))
        devs.append("cpu" if dev == "cpu" else "cuda:0")
    return tensors, bufs, devs


def request(case: Case, seed: int) -> tuple[ItemBatch, ItemBatch, ItemBatch]:
    """The two chunks the prefill sends and what the decode expects (the same items, one group per buffer)."""
    pages = chunk_pages(case, seed, chunks=2)
    kv, states = tuple(range(KV_BUFFERS)), tuple(range(KV_BUFFERS, KV_BUFFERS + STATE_BUFFERS))
    tail = (Items(states, np.array([1])), Items((KV_BUFFERS + STATE_BUFFERS,), np.array([2])))
    first = ItemBatch((Items(kv, pages[: case.pages]),))
    last = ItemBatch((Items(kv, pages[case.pages:]),) + tail)
    return first, last, ItemBatch((Items(kv, pages),) + tail)


def run_case(case: Case, device: str, repeat: int) -> dict:
    lay = layout(case)
    src, sbufs, sdevs = pools(lay, device, seed=1)
    dst, dbufs, ddevs = pools(lay, device, seed=None)
    rx = ZmqReceiver(lay, dbufs, CFG, devices=ddevs)
    tx = ZmqSender(lay, sbufs, CFG, devices=sdevs)
    send_ms, gbit = [], []
    nbytes = 2 * case.tokens * KV_BYTES_PER_TOKEN * KV_BUFFERS + sum(s.item_len for s in lay.buffers[KV_BUFFERS:-1])
    try:
        for r in range(repeat + 1):  # the first request warms the rings and the links
            first, last, whole = request(case, r)
            tid = next(IDS)
            rx.expect(tid, whole)
            t0 = time.perf_counter()
            tx.send(tid, rx.address, first)
            t1 = time.perf_counter()
            tx.send(tid, rx.address, last, last=True)
            t2 = time.perf_counter()
            status = rx.wait(tid, 120)
            t3 = time.perf_counter()
            assert status.state is TransferState.DONE, status
            if r:
                send_ms += [(t1 - t0) * 1e3, (t2 - t1) * 1e3]
                gbit.append(nbytes * 8 / (t3 - t0) / 1e9)
            rx.release(tid)
            tx.release(tid)
        kv0 = np.asarray(request(case, repeat)[0].groups[0].index)  # spot check: the last request's first chunk
        assert torch.equal(dst[0].view(-1, lay.buffers[0].item_len)[torch.as_tensor(kv0, device=dst[0].device)],
                           src[0].view(-1, lay.buffers[0].item_len)[torch.as_tensor(kv0, device=src[0].device)])
    finally:
        tx.close()
        rx.close()
    return {"case": case.name, "device": device, "request_mib": round(nbytes / 2**20, 1),
            "send_ms": round(statistics.median(send_ms), 3), "send_ms_max": round(max(send_ms), 3),
            "gbit_s": round(statistics.median(gbit), 2)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--devices", nargs="+", default=["cpu"] + (["cuda"] if torch.cuda.is_available() else []))
    ap.add_argument("--tokens", type=int, nargs="+", default=[4096])
    ap.add_argument("--page-sizes", type=int, nargs="+", default=[1, 64])
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--out")
    args = ap.parse_args()
    rows = []
    for tokens, page, frag in itertools.product(args.tokens, args.page_sizes, (False, True)):
        case = Case(tokens, page, frag)
        for dev in args.devices:
            rows.append(run_case(case, dev, args.repeat))
            host = next((r for r in rows if r["case"] == case.name and r["device"] == "cpu"), None)
            if host is not None and dev != "cpu":
                rows[-1]["send_ms_ratio_to_cpu"] = round(rows[-1]["send_ms"] / host["send_ms"], 2)
                rows[-1]["gbit_s_ratio_to_cpu"] = round(rows[-1]["gbit_s"] / host["gbit_s"], 2)
            print(json.dumps(rows[-1]), flush=True)
    result = {"device_name": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu only",
              "torch": torch.__version__, "rows": rows}
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
