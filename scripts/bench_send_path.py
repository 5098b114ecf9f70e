"""Send path of prfaas_zmq: scheduler-thread cost of one prefill chunk, and end-to-end goodput (the staged path).

Pool layout like Qwen3-Next at TP 1: 24 K/V buffers (12 full-attention layers × K, V; 2 KV heads × 256 dim
in bf16 = 1 KiB per token) + 36 GDN state buffers + 1 aux buffer. Pages: page size 1 or 64; "contiguous"
= one run, "fragmented" = a random permutation of a pool 4× the chunk (what a long-running server holds).

    .venv/bin/python scripts/bench_send_path.py --out out/bench_send_path.json            # loopback (+ tbf as root)
    .venv/bin/python scripts/bench_send_path.py --only scheduler --repeat 5                 # thread cost only
    .venv/bin/python scripts/bench_send_path.py --only link --rates 1gbit                   # tc tbf link only (root)

Measured per configuration:
- `legacy_ms`: the scheduler-thread work before the staged path of `add_transfer_request` — `flat()`, byte regions
  per page and buffer (`item_regions`), the state/aux tail, and `ZmqSender.send`'s `check_region` per region
  — rebuilt here from the still-present layout helpers, so it can be measured beside the new path;
- `ours_ms`: `PrefillManager.add_transfer_request` as SGLang calls it (a real manager and `ZmqSender`
  without SGLang's constructor, as in tests/fast/backend_stubs.py), up to its return;
- `mooncake_ms`: SGLang's `MooncakeKVManager.add_transfer_request` on the same indices (see `_mooncake`),
  plus `mooncake_group_ms`, its worker-thread run grouping (`group_concurrent_contiguous`) per chunk;
- `ours_ms` comes from whole requests (two chunks of --tokens tokens, the second with the 36 state slots and
  the aux row) sent through add_transfer_request over loopback TCP to a `ZmqReceiver` in a child process
  (the decode's place): the median over all chunks (`ours_ms_max`: the slowest); `gbit_s`: the request's
  bytes over (first add_transfer_request → sender DONE); `frames_per_mib`: chunk messages per MiB;
- link (`--only link`, root): the same requests to a receiver process in a network namespace behind a
  `tc tbf` veth link (prfaas_sgl/tools/netns.py); `fraction_of_link` (tbf's ceiling is ~0.956).
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import platform
import statistics
import subprocess
import sys
import threading
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


POOL_CHUNKS = 3  # a pool holds this many chunks' pages (fragmented pages are drawn from all of it)


def kv_args(case: Case, arrays: list[np.ndarray] | None = None, slots: int = 4, seed: int | None = None):
    """SGLang-shaped `KVArgs` over host numpy arrays (zeros, or random bytes from `seed`)."""
    pool_pages = POOL_CHUNKS * case.pages + 1
    item = KV_BYTES_PER_TOKEN * case.page_size
    states = [CONV_STATE_BYTES] * (STATE_BUFFERS // 2) + [TEMPORAL_STATE_BYTES] * (STATE_BUFFERS // 2)
    sizes = [item * pool_pages] * KV_BUFFERS + [s * slots for s in states] + [AUX_BYTES * 8]
    if arrays is None:
        rng = np.random.default_rng(seed)
        arrays = [np.zeros(n, np.uint8) if seed is None else rng.integers(0, 256, n, dtype=np.uint8) for n in sizes]
    ptrs = [a.ctypes.data for a in arrays]
    k = KV_BUFFERS
    args = SimpleNamespace(
        kv_data_ptrs=ptrs[:k], kv_data_lens=sizes[:k], kv_item_lens=[item] * k,
        state_data_ptrs=[ptrs[k:k + STATE_BUFFERS]], state_data_lens=[sizes[k:k + STATE_BUFFERS]],
        state_item_lens=[states], state_types=["mamba"],
        aux_data_ptrs=ptrs[-1:], aux_data_lens=sizes[-1:], aux_item_lens=[AUX_BYTES], page_size=case.page_size,
        engine_rank=0, gpu_id=0)
    return args, arrays


def chunk_pages(case: Case, seed: int = 0, chunks: int = 1) -> np.ndarray:
    """Page ids of `chunks` chunks (request order): one run, or drawn at random from the whole pool."""
    n = chunks * case.pages
    if not case.fragmented:
        return np.arange(1, n + 1, dtype=np.int32)
    rng = np.random.default_rng(seed)
    return (rng.permutation(POOL_CHUNKS * case.pages)[:n] + 1).astype(np.int32)


def timed(fn, repeat: int) -> float:
    """Median wall time of `fn()` in ms."""
    out = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        out.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(out)


# -- the scheduler-thread work before the staged path ----------------------------------------------------------
def legacy_ms(case: Case, repeat: int) -> float:
    from _legacy_regions import check_region, item_regions  # the pre-staged path, kept only to be measured

    from prfaas_sgl.srt.backend.memory import KVMemory, flat

    args, _ = kv_args(case)
    mem = KVMemory.of(args)
    pages = chunk_pages(case)

    def run() -> None:
        regions = item_regions(mem.layout, mem.kv_ids, flat(pages))
        for ids in mem.state_ids:
            regions += item_regions(mem.layout, ids, flat([np.array([0])]))
        regions += item_regions(mem.layout, mem.aux_ids, [0])
        for r in regions:  # ZmqSender.send checked every region on the caller's thread
            check_region(mem.layout, r)

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


# -- ours: PrefillManager.add_transfer_request on the staged path ------------------------------------------
CFG_KW = dict(timeout_s=120)
ROOM_BASE, DECODE_PORT = 1000, 5555  # the decode's control port; its address is the receiver's host


def prefill_manager(args, cfg):
    """A real PrefillManager and ZmqSender without SGLang's constructor (as the backend tests build it)."""
    from prfaas_sgl.srt.backend.admission import Admission, PeerBook
    from prfaas_sgl.srt.backend.memory import KVMemory
    from prfaas_sgl.srt.backend.prefill import PrefillManager
    from prfaas_sgl.srt.backend.rooms import Unstarted
    from prfaas_sgl.transfer.sender import ZmqSender

    m = object.__new__(PrefillManager)
    m.kv_args, m.memory, m.transfer_config, m.register_secret = args, KVMemory.of(args), cfg, None
    m.request_status, m.failure_records, m.failure_lock = {}, {}, threading.Lock()
    m._deferred_ack_targets, m._deferred_ack_poisoned_rooms = {}, set()
    m._staging_outstanding, m.deferred_bootstrap = collections.defaultdict(int), None
    m.local_ip, m.rank_port, m.attn_tp_size, m._stopped, m.is_mla_backend = "127.0.0.1", DECODE_PORT, 1, False, False
    m.send_kv_status_message = lambda **kw: None
    m._init_liveness()
    m.peers = PeerBook(Admission(None, None), fit=m._fit)
    m._open, m._lock, m._wake = {}, threading.Lock(), threading.Event()
    m.transfer_infos, m.req_to_decode_prefix_len, m._unstarted, m._room_ttl_s = {}, {}, Unstarted(), 600.0
    m.sender = m.data_plane = ZmqSender(m.memory.layout, m.memory.buffers, cfg, devices=m.memory.devices,
                                        on_terminal=lambda _tid: m._wake.set())
    return m


def _register(m, host: str, data_port: int, layout) -> None:
    """The decode at `host` registers, as seen from its own address (a prefill admits a Register only from
    the host it names: on the tbf link that is the namespace's address, not loopback)."""
    from prfaas_sgl.srt.backend import control

    reg = control.Register(endpoint=host, dst_port=DECODE_PORT, data_host=host, data_port=data_port,
                           server_key=None, layout=layout, page_size=m.kv_args.page_size, attn_tp_size=1, tp_rank=0)
    m._on_control(control.encode(reg), host)
    if m.rejections or reg.session not in m.peers:  # refused: every transfer would wait out its timeout
        raise RuntimeError(m.rejections or m.peers.unregistered(reg.session))


def _open_room(m, host: str, room: int, npages: int) -> None:
    from sglang.srt.disaggregation.base.conn import KVPoll

    from prfaas_sgl.srt.backend import control

    meta = control.Metadata(room=room, endpoint=host, dst_port=DECODE_PORT, npages=npages, aux_index=0,
                            state_indices=[[0]], decode_prefix_len=0, required_dst_info_num=1, is_dummy=False)
    m.request_status[room] = KVPoll.Bootstrapping
    m._on_control(control.encode(meta), host)


def request_bytes(mem, npages: int) -> int:
    kv = sum(mem.layout.buffers[b].item_len for b in mem.kv_ids) * npages
    return kv + sum(mem.layout.buffers[b].item_len for ids in mem.state_ids for b in ids) + \
        sum(mem.layout.buffers[b].item_len for b in mem.aux_ids)


def ours_requests(case: Case, repeat: int, host: str, child, rate: str | None = None) -> dict:
    """`repeat` whole requests (2 chunks; the 36 state slots + aux row with the second) through
    PrefillManager.add_transfer_request to a receiver process (`child`, see serve_receiver) at `host`:
    scheduler-thread ms per chunk, goodput (first call → sender DONE), frames per MiB."""
    from prfaas_sgl.srt.backend.memory import KVMemory, transfer_id
    from prfaas_sgl.transfer.config import TransferConfig

    cfg = TransferConfig(**CFG_KW)
    src_args, src_arrays = kv_args(case, seed=1)  # the arrays must outlive the transport: it holds raw pointers
    mem = KVMemory.of(src_args)
    m = prefill_manager(src_args, cfg)
    sched, rates, frames = [], [], []
    try:
        child.stdin.write(json.dumps([case.tokens, case.page_size, case.fragmented, repeat]) + "\n")
        child.stdin.flush()
        _register(m, host, json.loads(child.stdout.readline())["port"], mem.layout)
        nbytes = request_bytes(mem, 2 * case.pages)
        for r in range(repeat):
            room, tid = ROOM_BASE + r, transfer_id(ROOM_BASE + r, host, DECODE_PORT)
            src = chunk_pages(case, seed=r, chunks=2)
            _open_room(m, host, room, len(src))
            t0 = time.perf_counter()
            for k, last in ((0, False), (1, True)):
                pages = src[k * case.pages: (k + 1) * case.pages]
                t = time.perf_counter()
                m.add_transfer_request(room, pages, slice(k * case.pages, (k + 1) * case.pages), last,
                                       aux_index=2 if last else None, state_indices=[np.array([2])] if last else None)
                sched.append((time.perf_counter() - t) * 1e3)
            status = m.sender.wait(tid, 300)
            dt = time.perf_counter() - t0
            if status.state.value != "done":
                raise RuntimeError(f"transfer ended {status}")
            rates.append(nbytes * 8 / dt / 1e9)
            frames.append(m.sender._book.transfers[tid].next_seq / (nbytes / 2**20))
            m._watch_step()
        received = [json.loads(child.stdout.readline()) for _ in range(repeat)]
    finally:
        m.sender.close()
        del src_arrays
    row = {"ours_ms": statistics.median(sched), "ours_ms_max": max(sched), "ours_chunks": len(sched),
           "gbit_s": statistics.median(rates), "gbit_s_min": min(rates), "frames_per_mib": max(frames),
           "request_mib": nbytes / 2**20, "receiver": sorted({x["state"] for x in received})}
    if rate is not None:
        row["fraction_of_link"] = row["gbit_s"] / _gbit(rate)
    return row


def receiver_process(prefix: list[str], host: str) -> subprocess.Popen:
    cmd = prefix + [sys.executable, os.path.abspath(__file__), "--serve-receiver", host]
    return subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)


def scheduler_case(case: Case, repeat: int, child) -> dict:
    row = {"case": case.name, "legacy_ms": legacy_ms(case, repeat)}
    try:
        row.update(_mooncake(case, repeat))
    except Exception as e:  # noqa: BLE001 - reported in the JSON, the run goes on
        row["mooncake_error"] = f"{type(e).__name__}: {e}"
    row.update(ours_requests(case, repeat, "127.0.0.1", child))
    return row


# -- the decode side: a receiver process (on loopback, or in a network namespace behind a tc tbf link) -----
def serve_receiver(host: str) -> None:
    """Child process: per case line read from stdin, one ZmqReceiver expecting `repeat` requests; prints
    its port, then one result line per request.

    A case's receiver is closed only when the parent moves on (the next case line, or end of input), never
    right after its last request: the receiver is DONE when it queues its Done reply, and closing it then
    (LINGER 0) discards that reply before it leaves, so the parent's last request of each case timed out."""
    from prfaas_sgl.srt.backend.memory import KVMemory, transfer_id
    from prfaas_sgl.transfer.config import TransferConfig

    from prfaas_sgl.transfer.receiver import ZmqReceiver

    rx = arrays = None
    try:
        for line in sys.stdin:
            if rx is not None:
                rx.close()
            tokens, page_size, fragmented, repeat = json.loads(line)
            case = Case(tokens, page_size, fragmented)
            args, arrays = kv_args(case)  # kept alive until the receiver is closed (raw pointers)
            mem = KVMemory.of(args)
            rx = ZmqReceiver(mem.layout, mem.buffers, TransferConfig(**CFG_KW), host=host)
            tids = [transfer_id(ROOM_BASE + r, host, DECODE_PORT) for r in range(repeat)]
            for r, tid in enumerate(tids):
                rx.expect(tid, mem.batch(chunk_pages(case, seed=100 + r, chunks=2), [np.array([1])], 1))
            print(json.dumps({"port": rx.address.port}), flush=True)
            for tid in tids:
                status = rx.wait(tid, 300)
                print(json.dumps({"state": status.state.value, "reason": status.reason}), flush=True)
    finally:
        if rx is not None:
            rx.close()
        del arrays


def _gbit(rate: str) -> float:
    return float(rate.removesuffix("gbit")) if rate.endswith("gbit") else float(rate.removesuffix("mbit")) / 1e3


def link_runs(rates: list[str], tokens: int, repeat: int) -> list[dict]:
    from prfaas_sgl.tools import netns

    problem = netns.root_problem()
    if problem:
        return [{"skipped": problem}]
    rows = []
    for rate in rates:
        with netns.emulated_link(rate) as link:
            child = receiver_process(link.exec_prefix, link.remote_ip)
            try:
                for case in cases(tokens):
                    row = {"case": case.name, "rate": rate, **ours_requests(case, repeat, link.remote_ip, child, rate)}
                    print(json.dumps(row), flush=True)
                    rows.append(row)
            finally:
                child.stdin.close()
                child.wait(60)
    return rows


def cases(tokens: int) -> list[Case]:
    return [Case(tokens, p, f) for p in (1, 64) for f in (False, True)]


def environment() -> dict:
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    return {"commit": commit, "host": platform.node(), "cpus": os.cpu_count(), "loadavg": os.getloadavg(),
            "python": platform.python_version()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=8192, help="tokens per prefill chunk")
    ap.add_argument("--repeat", type=int, default=3, help="requests per case (2 chunks each)")
    ap.add_argument("--only", choices=["scheduler", "link"], default=None)
    ap.add_argument("--rates", default="1gbit", help="tbf link rates, comma-separated")
    ap.add_argument("--out", default="out/bench_send_path.json")
    ap.add_argument("--serve-receiver", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.serve_receiver:
        serve_receiver(a.serve_receiver)
        return
    result = {"env": environment(), "scheduler": [], "link": []}
    if a.only in (None, "scheduler"):
        child = receiver_process([], "127.0.0.1")
        try:
            for case in cases(a.tokens):
                row = scheduler_case(case, a.repeat, child)
                print(json.dumps(row), flush=True)
                result["scheduler"].append(row)
        finally:
            child.stdin.close()
            child.wait(60)
    if a.only in (None, "link"):
        result["link"] = link_runs(a.rates.split(","), a.tokens, a.repeat)
    result["env"]["loadavg_end"] = os.getloadavg()
    os.makedirs(os.path.dirname(a.out) or ".", exist_ok=True)
    with open(a.out, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
