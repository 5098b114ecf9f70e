"""What the lower tiers buy on multi-turn traffic: a seeded conversation trace whose working set is several
times the device pool, served by CPU SGLang servers with the SAME device memory, measured one at a time in
one invocation:

    hybrid        `--radix-cache-backend prfaas_hybrid`, device pool only
    hybrid+host   prfaas_hybrid + a host tier that holds the whole working set
    hybrid+file   prfaas_hybrid + a small host tier over SGLang's `file` storage tier (most entries spill)
    sglang        SGLang's own prefix cache for the model (MambaRadixCache, no_buffer)
    sglang+hicache  SGLang + `--enable-hierarchical-cache` (HiCache); where SGLang refuses it on this machine
                  the refusal (its log's last error lines) is the row

The trace: N conversations, each a private long context; turn t's prompt is the previous turn's prompt plus
that turn's assistant reply plus a new user message. The assistant replies are part of the seeded trace (not
the model's output), so every server gets the same prompts and the greedy outputs can be compared token
for token. Turns go in rounds: round t sends turn t of every conversation, `--concurrency` at a time, so a
conversation's turns are sequential and between two of its turns the others' prompts (several device pools'
worth) pass through the device pool: its prefix is reused only if some tier kept it.

Per server: hit rate (cached_tokens / prompt_tokens from the responses' meta_info), TTFT p50/p90 (first
streamed chunk), wall time and prompt tokens/s over the trace, and outputs equal to the `sglang` server's.

    .venv/bin/python scripts/bench_cachepool_tiers.py --out docs/results/bench_cachepool_tiers.json
"""
from __future__ import annotations

import argparse
import json
import os
import re
import tempfile
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from prfaas_sgl.tools.launch import ServerSpec, SGLangServer, free_port, stop_together
from prfaas_sgl.tools.models.tiny import ensure

MODEL = "tiny-qwen35-hybrid"
POOL_TOKENS = 1024  # device KV tokens, every server
DEVICE = dict(max_total_tokens=POOL_TOKENS, max_mamba_slots=24, max_running_requests=4, chunked_prefill_size=64)
REPORT = ("--enable-cache-report",)
HYBRID = ("--radix-cache-backend", "prfaas_hybrid")


@dataclass(frozen=True)
class Turn:
    conversation: int
    turn: int
    prompt: tuple[int, ...]


def conversation_trace(seed: int, conversations: int, turns: int, context: int, user: int, reply: int,
                       vocab: int) -> list[list[Turn]]:
    """rounds[t][c]: turn t of conversation c. Turn 0 is the context plus a user message; each later turn
    extends the previous prompt by the assistant's reply (seeded tokens) and a new user message."""
    rng = np.random.default_rng(seed)

    def ids(n: int) -> list[int]:
        return rng.integers(100, vocab - 100, n).tolist()

    prompts = [ids(context) + ids(user) for _ in range(conversations)]
    rounds = [[Turn(c, 0, tuple(p)) for c, p in enumerate(prompts)]]
    for t in range(1, turns):
        prompts = [p + ids(reply) + ids(user) for p in prompts]
        rounds.append([Turn(c, t, tuple(p)) for c, p in enumerate(prompts)])
    return rounds


def working_set_tokens(rounds: list[list[Turn]]) -> int:
    """Distinct prompt tokens the trace asks the cache to keep: every conversation's last prompt."""
    return sum(len(turn.prompt) for turn in rounds[-1])


def conversations_for(ratio: float, pool_tokens: int, turns: int, context: int, user: int, reply: int) -> int:
    """The fewest conversations whose working set is at least `ratio` device pools."""
    per = context + turns * user + (turns - 1) * reply
    return max(1, -(-int(ratio * pool_tokens) // per))


def configs(storage_dir: str) -> dict[str, tuple[str, ...]]:
    return {
        "hybrid": HYBRID,
        "hybrid+host": (*HYBRID, "--prfaas-tier-host-bytes", str(64 << 20)),
        # ~16 entries of ~33 KB in host memory; the rest of the working set goes to the file tier
        "hybrid+file": (*HYBRID, "--prfaas-tier-host-bytes", str(512 << 10), "--prfaas-tier-storage", "file",
                        "--prfaas-tier-storage-path", storage_dir),
        "sglang": (),
        "sglang+hicache": ("--enable-hierarchical-cache",),
    }


def stream(url: str, ids: tuple[int, ...], new: int, timeout: float) -> dict:
    """One streamed greedy request: TTFT (first chunk), the last chunk's cumulative output_ids and meta."""
    body = {"input_ids": list(ids), "stream": True,
            "sampling_params": {"max_new_tokens": new, "temperature": 0.0, "ignore_eos": True}}
    req = urllib.request.Request(url + "/generate", json.dumps(body).encode(), {"content-type": "application/json"})
    t0 = time.monotonic()
    ttft, last = None, None
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            for raw in r:
                line = raw.decode().strip()
                if not line.startswith("data:") or line == "data: [DONE]":
                    continue
                ttft = ttft if ttft is not None else time.monotonic() - t0
                last = json.loads(line[5:])
    except Exception as e:  # noqa: BLE001 -- a refused or broken server is a row, not a crash
        return {"error": f"{type(e).__name__}: {e}"[:500]}
    if not last or "output_ids" not in last:
        return {"error": f"no output: {str(last)[:500]}"}
    meta = last["meta_info"]
    return {"ttft_s": ttft, "e2e_s": time.monotonic() - t0, "output_ids": last["output_ids"],
            "prompt_tokens": meta["prompt_tokens"], "cached_tokens": meta.get("cached_tokens", 0)}


def run_trace(url: str, rounds: list[list[Turn]], new: int, concurrency: int, timeout: float) -> dict:
    t0 = time.monotonic()
    outs: dict[str, dict] = {}
    broken: list[str] = []  # a broken server: its first error is the row; later requests are not sent

    def send(turn: Turn) -> dict:
        out = {"error": "not sent: " + broken[0]} if broken else stream(url, turn.prompt, new, timeout)
        if "error" in out and not broken:
            broken.append(out["error"])
        return out

    with ThreadPoolExecutor(concurrency) as ex:
        for rnd in rounds:
            for turn, out in zip(rnd, ex.map(send, rnd)):
                outs[f"{turn.conversation}/{turn.turn}"] = out
    wall = time.monotonic() - t0
    ok = [o for o in outs.values() if "error" not in o]
    prompt = sum(o["prompt_tokens"] for o in ok)
    ttft = [o["ttft_s"] for o in ok]
    return {
        "requests": sum(len(r) for r in rounds), "ok": len(ok), "wall_s": round(wall, 2),
        "hit_rate": round(sum(o["cached_tokens"] for o in ok) / max(prompt, 1), 3),
        "cached_tokens": sum(o["cached_tokens"] for o in ok), "prompt_tokens": prompt,
        "ttft_p50_s": round(float(np.percentile(ttft, 50)), 3) if ttft else None,
        "ttft_p90_s": round(float(np.percentile(ttft, 90)), 3) if ttft else None,
        "prompt_tokens_per_s": round(prompt / wall, 1), "requests_per_s": round(len(ok) / wall, 3),
        "errors": sorted({o["error"] for o in outs.values() if "error" in o})[:3],
        "outputs": {k: o.get("output_ids") for k, o in outs.items()},
    }


def refusal(srv: SGLangServer, err: Exception) -> str:
    """Why a start failed, from its log: the last traceback's innermost frame and its exception line."""
    lines = srv.log_path.read_text(errors="replace").splitlines() if srv.log_path.exists() else []
    exc = [i for i, ln in enumerate(lines) if re.match(r"^\w+(Error|Exception): ", ln)]
    if not exc:
        return "\n".join(lines[-4:] or [str(err)])[-2000:]
    frames = [ln.strip() for ln in lines[:exc[-1]] if ln.strip().startswith('File "')]
    return "\n".join(frames[-5:] + [lines[exc[-1]]])[:2000]


def start_all(servers: dict[str, SGLangServer], timeout_s: float) -> dict[str, str]:
    """Start every server together (the idle ones sleep while another is measured); {name: refusal}."""
    for srv in servers.values():
        srv.start()
    refused: dict[str, str] = {}
    deadline = time.monotonic() + timeout_s
    for name, srv in servers.items():
        try:
            srv.wait_healthy(timeout_s=max(deadline - time.monotonic(), 1))
        except (RuntimeError, TimeoutError) as e:
            refused[name] = refusal(srv, e)
            srv.stop()
    return refused


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seed", type=int, default=23)
    ap.add_argument("--ratio", type=float, default=5.0, help="working set / device pool (sets the conversations)")
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--user", type=int, default=64)
    ap.add_argument("--reply", type=int, default=32)
    ap.add_argument("--new", type=int, default=8, help="tokens generated per turn")
    ap.add_argument("--concurrency", type=int, default=2)
    ap.add_argument("--only", default="", help="comma-separated subset of the configs")
    ap.add_argument("--start-timeout", type=float, default=420)
    ap.add_argument("--request-timeout", type=float, default=120)
    ap.add_argument("--out", default="out/bench_cachepool_tiers.json")
    ap.add_argument("--log-dir", default="out/bench_cachepool_tiers_logs")
    args = ap.parse_args()
    path = ensure(MODEL)
    vocab = json.loads((Path(path) / "config.json").read_text())["vocab_size"]
    n = conversations_for(args.ratio, POOL_TOKENS, args.turns, args.context, args.user, args.reply)
    rounds = conversation_trace(args.seed, n, args.turns, args.context, args.user, args.reply, vocab)
    Path(args.log_dir).mkdir(parents=True, exist_ok=True)
    storage = tempfile.mkdtemp(prefix="prfaas-tier-bench-")  # 0700: the file tier refuses a shared dir
    chosen = {k: v for k, v in configs(storage).items() if not args.only or k in args.only.split(",")}
    servers = {name: SGLangServer(ServerSpec(str(path), free_port(), **DEVICE, log_path=f"{args.log_dir}/{name}.log",
                                             extra_args=extra + REPORT))
               for name, extra in chosen.items()}
    uptime_before = os.getloadavg()
    try:
        refused = start_all(servers, args.start_timeout)
        results = {name: {"refused": why} for name, why in refused.items()}
        for name, srv in servers.items():
            if name not in refused:
                results[name] = run_trace(srv.url, rounds, args.new, args.concurrency, args.request_timeout)
                results[name]["server_log_tail"] = tier_lines(srv)
    finally:
        stop_together(list(servers.values()))
    report(results, chosen, rounds, n, args, uptime_before)


def tier_lines(srv: SGLangServer) -> list[str]:
    """The tier's own account of what it loaded (the last few 'hit extended' lines)."""
    text = srv.log_path.read_text(errors="replace")
    return [ln[-200:] for ln in text.splitlines() if "hit extended" in ln][-3:]


def report(results: dict, chosen: dict, rounds, n: int, args, load_before) -> None:
    ref = results.get("sglang", {}).get("outputs") or next((r["outputs"] for r in results.values() if "outputs" in r), {})
    for row in results.values():
        if "outputs" in row:
            outs = row.pop("outputs")
            row["same_outputs_as_ref"] = sum(outs.get(k) == v and v is not None for k, v in ref.items())
    trace = {"seed": args.seed, "conversations": n, "turns": args.turns, "context": args.context,
             "user": args.user, "reply": args.reply, "new": args.new, "concurrency": args.concurrency,
             "working_set_tokens": working_set_tokens(rounds),
             "working_set_x_pool": round(working_set_tokens(rounds) / POOL_TOKENS, 2)}
    doc = {"model": MODEL, "device": DEVICE, "trace": trace, "flags": {k: list(v) for k, v in chosen.items()},
           "reference_outputs": "sglang" if "sglang" in results else "first config measured",
           "loadavg_before": load_before, "loadavg_after": os.getloadavg(), "results": results}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(doc, indent=1))
    print(json.dumps(trace))
    print("| server | ok | hit rate | TTFT p50 / p90 (s) | wall (s) | prompt tok/s | req/s | outputs == sglang |")
    print("|---|---|---|---|---|---|---|---|")
    for name, r in results.items():
        if "refused" in r:
            print(f"| {name} | refused: {r['refused'].splitlines()[-1][:160] if r['refused'] else '?'} |")
            continue
        print(f"| {name} | {r['ok']}/{r['requests']} | {r['hit_rate']} | {r['ttft_p50_s']} / {r['ttft_p90_s']} | "
              f"{r['wall_s']} | {r['prompt_tokens_per_s']} | {r['requests_per_s']} | "
              f"{r['same_outputs_as_ref']}/{r['requests']} |")


if __name__ == "__main__":
    main()
