"""What one shared pool buys (issue 17, item 4): three CPU SGLang servers with the SAME memory, one workload
that shifts between many short requests and a few long ones with a shared prefix.

    sglang     SGLang's own prefix cache (MambaRadixCache), its fixed split: --max-total-tokens KV tokens
               + --max-mamba-cache-size state slots, decided at start-up
    hybrid     `--radix-cache-backend prfaas_hybrid` over the same fixed split
    unified    prfaas_hybrid + `--prfaas-unified-pool`: the same bytes re-laid as one slab, one free list
               for KV blocks and state blocks (docs/unified-memory.md)

Each phase sends all its requests at once to one server at a time (the servers do not share the cores
while measured). Per phase and server: wall time, requests/s, the most requests running at once and the
longest queue (from SGLang's "Prefill batch" log lines), prefix hit rate (cached / prompt tokens), and
whether the greedy outputs equal the `sglang` server's. SGLang's own unified pool is not a peer here: it
refuses torch_native, the CPU attention backend (docs/unified-memory.md section 2).

    .venv/bin/python scripts/bench_unified_pool.py --out out/bench_unified_pool.json
"""
from __future__ import annotations

import argparse
import json
import re
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

from prfaas_sgl.tools.launch import ServerSpec, SGLangServer, free_port, stop_together
from prfaas_sgl.tools.models.tiny import ensure


def post(url: str, body: dict, timeout: float) -> dict:
    req = urllib.request.Request(url, json.dumps(body).encode(), {"content-type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return json.loads(r.read())
    except urllib.error.HTTPError as e:
        return {"http_status": e.code, "error": e.read().decode(errors="replace")}


def generate_body(ids: list[int], new: int) -> dict:
    return {"input_ids": ids, "sampling_params": {"max_new_tokens": new, "temperature": 0.0, "ignore_eos": True}}

MODEL = "tiny-qwen35-hybrid"
MEMORY = dict(max_total_tokens=4096, max_mamba_slots=24, max_running_requests=32, chunked_prefill_size=64)
CONFIGS = {
    "sglang": (),
    "hybrid": ("--radix-cache-backend", "prfaas_hybrid"),
    "unified": ("--radix-cache-backend", "prfaas_hybrid", "--prfaas-unified-pool"),
}
BATCH = re.compile(r"#new-seq: (\d+).*?#running-req: (\d+), #queue-req: (\d+)")


def phases(vocab: int, seed: int) -> list[tuple[str, list[list[int]], int]]:
    """(name, prompts, new tokens): many short (state-bound), a few long sharing a prefix (KV-bound), short."""
    rng = np.random.default_rng(seed)

    def ids(n: int) -> list[int]:
        return rng.integers(100, vocab - 100, n).tolist()

    short = [ids(32) for _ in range(40)]
    prefix = ids(896)
    long = [prefix + ids(300) for _ in range(6)]
    return [("short", short, 8), ("long", long, 8), ("short again", [ids(32) for _ in range(40)], 8)]


def run_phase(server: SGLangServer, prompts: list[list[int]], new: int) -> dict:
    start = server.log_path.stat().st_size
    t0 = time.monotonic()
    with ThreadPoolExecutor(len(prompts)) as ex:
        outs = list(ex.map(lambda p: post(server.url + "/generate", generate_body(p, new), 1800), prompts))
    wall = time.monotonic() - t0
    with open(server.log_path, errors="replace") as f:
        f.seek(start)
        batches = [tuple(map(int, m.groups())) for m in BATCH.finditer(f.read())]
    ok = [o for o in outs if "output_ids" in o]
    prompt_tokens = sum(o["meta_info"]["prompt_tokens"] for o in ok)
    return {
        "requests": len(prompts), "ok": len(ok), "wall_s": round(wall, 2),
        "requests_per_s": round(len(ok) / wall, 3),
        "max_running": max((n + r for n, r, _ in batches), default=0),
        "max_queued": max((q for _, _, q in batches), default=0),
        "prefix_hit_rate": round(sum(o["meta_info"]["cached_tokens"] for o in ok) / max(prompt_tokens, 1), 3),
        "outputs": [o.get("output_ids") for o in outs],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seed", type=int, default=17)
    ap.add_argument("--out", default="out/bench_unified_pool.json")
    ap.add_argument("--log-dir", default="out/bench_unified_pool_logs")
    args = ap.parse_args()
    path = ensure(MODEL)
    vocab = json.loads((Path(path) / "config.json").read_text())["vocab_size"]
    Path(args.log_dir).mkdir(parents=True, exist_ok=True)
    servers = {name: SGLangServer(ServerSpec(str(path), free_port(), **MEMORY, log_path=f"{args.log_dir}/{name}.log",
                                             extra_args=extra + ("--enable-cache-report",)))
               for name, extra in CONFIGS.items()}
    try:
        for srv in servers.values():
            srv.start()
        for srv in servers.values():
            srv.wait_healthy(timeout_s=900)
        results = {name: [] for name in servers}
        for phase, prompts, new in phases(vocab, args.seed):
            for name, srv in servers.items():
                results[name].append({"phase": phase, **run_phase(srv, prompts, new)})
    finally:
        stop_together(list(servers.values()))
    report(results, args)


def report(results: dict, args) -> None:
    ref = results["sglang"]
    ref_outputs = [row["outputs"] for row in ref]
    for rows in results.values():
        for row, base in zip(rows, ref_outputs):
            row["same_outputs_as_sglang"] = sum(a == b and a is not None for a, b in zip(row.pop("outputs"), base))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"model": MODEL, "memory": MEMORY, "seed": args.seed,
                                          "results": results}, indent=1))
    print("| phase | server | ok | wall s | req/s | max running | max queued | hit rate | same outputs |")
    print("|---|---|---|---|---|---|---|---|---|")
    for i, phase in enumerate(r["phase"] for r in ref):
        for name, rows in results.items():
            r = rows[i]
            same = r["same_outputs_as_sglang"]
            print(f"| {phase} | {name} | {r['ok']}/{r['requests']} | {r['wall_s']} | {r['requests_per_s']} | "
                  f"{r['max_running']} | {r['max_queued']} | {r['prefix_hit_rate']} | {same}/{r['requests']} |")


if __name__ == "__main__":
    main()
