"""What one shared pool buys: three CPU SGLang servers with the SAME memory, one workload
that shifts between many short requests and a few long ones with a shared prefix.

    sglang     SGLang's own prefix cache (MambaRadixCache), its fixed split: --max-total-tokens KV tokens
               + --max-mamba-cache-size state slots, decided at start-up
    hybrid     `--radix-cache-backend prfaas_hybrid` over the same fixed split
    unified    prfaas_hybrid + `--prfaas-unified-pool`: the same bytes re-laid as one slab, one free list
               for KV blocks and state blocks (docs/unified-memory.md)

Each phase sends all its requests at once to one server at a time (the servers do not share the cores
while measured; odd rounds take the servers in reverse order, so a load trend on a shared machine does
not always fall on the same one). Per phase and server: wall time, requests/s, the most requests running
at once and the longest queue, prefill passes and the prompt tokens they computed (from SGLang's "Prefill
batch" log lines: the work, which load does not change), the CPU seconds of the server's processes (they
leave out time spent waiting for a core, not the time a busy machine adds to each operation), prefix hit
rate (cached / prompt tokens), and
whether the greedy outputs equal the `sglang` server's. SGLang's own unified pool is not a peer here: it
refuses torch_native, the CPU attention backend (docs/unified-memory.md section 2).

    .venv/bin/python scripts/bench_unified_pool.py --profile memory-bound --out out/bench_unified_pool.json
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
import psutil

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
MEMORY = dict(max_total_tokens=4096, max_mamba_slots=24)  # equal memory: the same bytes on every server
# chunk-bound: the first run's shape, where a 64-token prefill chunk, not memory, bounds admission.
# memory-bound: a prefill batch takes many short prompts at once and more rows than the fixed split has
# state slots, and the long prompts' KV (896 shared + 6 x 600 tokens) overfills its 4,096 KV tokens.
PROFILES = {
    "chunk-bound": dict(sched=dict(max_running_requests=32, chunked_prefill_size=64),
                        short=40, short_len=32, suffix=300, new=8, rounds=1),
    "memory-bound": dict(sched=dict(max_running_requests=48, chunked_prefill_size=512),
                         short=96, short_len=32, suffix=600, new=16, rounds=3),
}
CONFIGS = {
    "sglang": (),
    "hybrid": ("--radix-cache-backend", "prfaas_hybrid"),
    "unified": ("--radix-cache-backend", "prfaas_hybrid", "--prfaas-unified-pool"),
}
ATTENTION = {"stock": (), "query-only": ("--prfaas-cpu-query-only-attention",)}  # the same on every server
BATCH = re.compile(r"#new-seq: (\d+), #new-token: (\d+).*?#running-req: (\d+), #queue-req: (\d+)")


def phases(vocab: int, seed: int, profile: dict) -> list[tuple[str, list[list[int]], int]]:
    """(name, prompts, new tokens): many short (state-bound), a few long sharing a prefix (KV-bound), short."""
    rng = np.random.default_rng(seed)

    def ids(n: int) -> list[int]:
        return rng.integers(100, vocab - 100, n).tolist()

    n, length, new = profile["short"], profile["short_len"], profile["new"]
    short = [ids(length) for _ in range(n)]
    prefix = ids(896)
    long = [prefix + ids(profile["suffix"]) for _ in range(6)]
    return [("short", short, new), ("long", long, new), ("short again", [ids(length) for _ in range(n)], new)]


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a process and its live descendants (SGLang's scheduler, tokenizer
    and detokenizer are children of the server process)."""
    procs = [psutil.Process(pid)]
    procs += procs[0].children(recursive=True)
    total = 0.0
    for p in procs:
        try:
            t = p.cpu_times()
        except psutil.NoSuchProcess:
            continue
        total += t.user + t.system
    return total


def batch_stats(log_text: str) -> dict:
    """From SGLang's "Prefill batch" lines: the most requests running and queued, prefill passes, and the
    prompt tokens those passes computed (hits excluded)."""
    batches = [tuple(map(int, m.groups())) for m in BATCH.finditer(log_text)]
    return {"max_running": max((n + r for n, _, r, _ in batches), default=0),
            "max_queued": max((q for *_, q in batches), default=0),
            "prefill_passes": len(batches), "prefill_tokens": sum(t for _, t, _, _ in batches)}


def server_env(omp_threads: int | None) -> dict:
    return {} if omp_threads is None else {"OMP_NUM_THREADS": str(omp_threads)}


def server_order(names: list[str], rnd: int) -> list[str]:
    """Odd rounds reversed: the per-round ratio compares runs a few seconds apart either way round."""
    return list(names) if rnd % 2 == 0 else list(reversed(names))


def run_phase(server: SGLangServer, prompts: list[list[int]], new: int, warm_first: bool) -> dict:
    """All `prompts` at once; `warm_first`: the first one alone before the rest (its shared prefix is then
    cached when the others arrive, as for a system prompt already seen)."""
    start = server.log_path.stat().st_size
    cpu0 = cpu_seconds(server.pid)
    t0 = time.monotonic()

    def send(p: list[int]) -> dict:
        return post(server.url + "/generate", generate_body(p, new), 1800)

    first = [send(prompts[0])] if warm_first else []
    with ThreadPoolExecutor(len(prompts)) as ex:
        outs = first + list(ex.map(send, prompts[len(first):]))
    wall = time.monotonic() - t0
    cpu = cpu_seconds(server.pid) - cpu0
    with open(server.log_path, errors="replace") as f:
        f.seek(start)
        stats = batch_stats(f.read())
    ok = [o for o in outs if "output_ids" in o]
    prompt_tokens = sum(o["meta_info"]["prompt_tokens"] for o in ok)
    return {
        "requests": len(prompts), "ok": len(ok), "wall_s": round(wall, 2),
        "requests_per_s": round(len(ok) / wall, 3), "cpu_s": round(cpu, 2), **stats,
        "prefix_hit_rate": round(sum(o["meta_info"]["cached_tokens"] for o in ok) / max(prompt_tokens, 1), 3),
        "outputs": [o.get("output_ids") for o in outs],
    }


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seed", type=int, default=17)
    ap.add_argument("--profile", choices=sorted(PROFILES), default="memory-bound")
    ap.add_argument("--rounds", type=int, default=None, help="rounds of the three phases (default: the profile's)")
    ap.add_argument("--out", default="out/bench_unified_pool.json")
    ap.add_argument("--log-dir", default="out/bench_unified_pool_logs")
    ap.add_argument("--servers", default=",".join(CONFIGS),
                    help="comma-separated subset of the servers (sglang, the reference, is always run)")
    ap.add_argument("--fork", action="store_true",
                    help="fork SGLang's scheduler and detokenizer instead of spawning them (starts ~3x faster)")
    ap.add_argument("--omp-threads", type=int, default=None,
                    help="OMP_NUM_THREADS of every server (default: torch's, all cores). On a machine shared with "
                         "other work, 1 makes a busy core slow a server down evenly instead of stalling its OpenMP "
                         "regions on a descheduled thread (decode steps of 0.8-2 s instead of 20 ms were seen)")
    ap.add_argument("--attention", choices=sorted(ATTENTION), default="stock",
                    help="every server's extend attention: SGLang's torch_native as is (each chunk's queries padded "
                         "to its whole context), or --prfaas-cpu-query-only-attention (the new queries only, as "
                         "a GPU backend computes them)")
    args = ap.parse_args()
    args.names = ["sglang"] + [n for n in args.servers.split(",") if n and n != "sglang"]
    unknown = sorted(set(args.names) - set(CONFIGS))
    if unknown:
        ap.error(f"unknown servers {unknown}; choose from {sorted(CONFIGS)}")
    return args


def main() -> None:
    args = parse_args()
    path = ensure(MODEL)
    vocab = json.loads((Path(path) / "config.json").read_text())["vocab_size"]
    Path(args.log_dir).mkdir(parents=True, exist_ok=True)
    profile = {**PROFILES[args.profile], **({"rounds": args.rounds} if args.rounds else {})}
    args.profile_used = profile
    servers = {name: SGLangServer(ServerSpec(str(path), free_port(), **MEMORY, **profile["sched"],
                                             log_path=f"{args.log_dir}/{name}.log", fork_children=args.fork,
                                             env=server_env(args.omp_threads),
                                             extra_args=CONFIGS[name] + ("--enable-cache-report",)
                                             + ATTENTION[args.attention]))
               for name in args.names}
    try:
        for srv in servers.values():
            srv.start()
        for srv in servers.values():
            srv.wait_healthy(timeout_s=900)
        results = {name: [] for name in servers}
        for rnd in range(profile["rounds"]):  # fresh prompts each round: the phases' shift, repeated
            for phase, prompts, new in phases(vocab, args.seed + rnd, profile):
                for name in server_order(list(servers), rnd):
                    row = run_phase(servers[name], prompts, new, warm_first=phase == "long")
                    results[name].append({"round": rnd, "phase": phase, **row})
    finally:
        stop_together(list(servers.values()))
    report(results, args)


def report(results: dict, args) -> None:
    ref_outputs = [row["outputs"] for row in results["sglang"]]
    for rows in results.values():
        for row, base in zip(rows, ref_outputs):
            row["same_outputs_as_sglang"] = sum(a == b and a is not None for a, b in zip(row.pop("outputs"), base))
    summary = {name: summarize(rows, results["sglang"]) for name, rows in results.items()}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"model": MODEL, "memory": MEMORY, "profile": args.profile,
                                          **args.profile_used, "seed": args.seed, "fork": args.fork,
                                          "attention": args.attention,
                                          "omp_threads": args.omp_threads, "summary": summary,
                                          "results": results}, indent=1))
    print("| phase | server | ok | req/s median [min, max] | x sglang (per round) | CPU x sglang (per round) "
          "| prefill passes / tokens | max running | max queued | hit rate | same outputs |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for phase in summary["sglang"]:
        for name in results:
            r = summary[name][phase]
            print(f"| {phase} | {name} | {r['ok']}/{r['requests']} | {r['rps_median']} [{r['rps_min']}, "
                  f"{r['rps_max']}] | {r['x_sglang']} ({_listed(r['x_rounds'])}) | {r['cpu_x_sglang']} "
                  f"({_listed(r['cpu_x_rounds'])}) | {r['prefill_passes']} / {r['prefill_tokens']} | "
                  f"{r['max_running']} | {r['max_queued']} | {r['hit_rate']} | {r['same']}/{r['requests']} |")


def _listed(values: list[float]) -> str:
    return ", ".join(f"{v:.2f}" for v in values)


def summarize(rows: list[dict], ref: list[dict]) -> dict:
    """Per phase over the rounds: median [min, max] requests/s, the per-round ratios to `ref` and their
    median (the same prompts, measured back to back: a load spike skews one round, not the median), the
    same for the servers' CPU seconds (ref's / ours: above 1, ours used less), the median prefill passes
    and prompt tokens computed per round, the most running/queued, tokens hit."""
    out: dict = {}
    for phase in dict.fromkeys(r["phase"] for r in rows):
        mine = [r for r in rows if r["phase"] == phase]
        base = [r for r in ref if r["phase"] == phase]
        rps = sorted(r["requests_per_s"] for r in mine)
        x = [round(a["requests_per_s"] / b["requests_per_s"], 2) for a, b in zip(mine, base)]
        cpu_x = [round(b["cpu_s"] / a["cpu_s"], 2) if a["cpu_s"] > 0 else 0.0 for a, b in zip(mine, base)]
        out[phase] = {"rounds": len(mine), "ok": sum(r["ok"] for r in mine), "requests": sum(r["requests"] for r in mine),
                      "rps_median": rps[len(rps) // 2], "rps_min": rps[0], "rps_max": rps[-1],
                      "x_sglang": round(float(np.median(x)), 2), "x_rounds": x,
                      "cpu_x_sglang": round(float(np.median(cpu_x)), 2), "cpu_x_rounds": cpu_x,
                      "prefill_passes": int(np.median([r["prefill_passes"] for r in mine])),
                      "prefill_tokens": int(np.median([r["prefill_tokens"] for r in mine])),
                      "max_running": max(r["max_running"] for r in mine),
                      "max_queued": max(r["max_queued"] for r in mine),
                      "hit_rate": round(sum(r["prefix_hit_rate"] for r in mine) / len(mine), 3),
                      "same": sum(r["same_outputs_as_sglang"] for r in mine)}
    return out


if __name__ == "__main__":
    main()
