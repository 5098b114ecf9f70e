"""KV bytes on the wire per PD request with a decode-side prefix cache: prfaas_hybrid vs SGLang 0.5.23's
own decode radix cache vs none, same prefill, same seeded trace, in one run (not a test).

Real CPU SGLang servers, tiny hybrid GDN model, prfaas_zmq: one prefill (`--radix-cache-backend
prfaas_hybrid`, stats endpoint) and three decode servers that differ only in their decode cache:
  none    SGLang's default for decode (prefix caching off): every prompt page crosses the link
  sglang  --disaggregation-decode-enable-radix-cache (UnifiedRadixCache with its Mamba component)
  ours    the same flag + --radix-cache-backend prfaas_hybrid (full-attention KV index only: the
          prefill always sends the prompt-end state, so any block-aligned KV prefix is a hit)
  ours_host  ours + a host tier (--prfaas-tier-host-bytes): what the decode's device pool evicts is
          loaded back into it when a prompt comes again (tier_decode.py), so the prefill sends less
With --decode-tokens N every decode gets an N-token device pool (--max-total-tokens): a trace whose
working set is several times N shows what the tier adds over the device cache alone. --variants picks
a subset (the tier row: none,ours,ours_host).
A decode hit becomes SGLang's decode_prefix_len and the prefill skips those pages. Trace: a few long
system prompts shared by several multi-turn conversations (turn k+1 = turn k + answer + new message),
turns interleaved across conversations. Each request goes to the three pairs in turn; bytes are the
prefill's transport counters (GET /stats) before and after. Greedy outputs must agree across the three.

    python3 scripts/bench_decode_cache.py --out out/bench_decode_cache
    python3 scripts/bench_decode_cache.py --variants none,ours,ours_host --decode-tokens 1024 --systems 3 \
        --convs 6 --out out/bench_decode_tier
"""
from __future__ import annotations

import argparse
import json
import os
import random
import sys
import threading
import time
import urllib.request
from pathlib import Path

from prfaas_sgl.tools.launch import SGLangServer, ServerSpec, free_port
from prfaas_sgl.tools.models.tiny import ensure

VARIANTS = {
    "none": (),
    "sglang": ("--disaggregation-decode-enable-radix-cache",),
    "ours": ("--disaggregation-decode-enable-radix-cache", "--radix-cache-backend", "prfaas_hybrid"),
    "ours_host": ("--disaggregation-decode-enable-radix-cache", "--radix-cache-backend", "prfaas_hybrid",
                  "--prfaas-tier-host-bytes", str(256 << 20)),
}
ZMQ = ("--prfaas-zmq-timeout-s", "120")


def make_trace(seed: int, systems: int, convs: int, turns: int, system_len: int, msg: tuple[int, int]):
    """Per turn, per conversation: (conversation id, new user tokens); system prompts by conversation."""
    rng = random.Random(seed)
    toks = lambda n: [rng.randrange(16, 500) for _ in range(n)]  # noqa: E731 (ids clear of specials)
    sys_prompts = [toks(system_len) for _ in range(systems)]
    conv_system = [sys_prompts[c % systems] for c in range(convs)]
    steps = [(c, toks(rng.randint(*msg))) for _ in range(turns) for c in range(convs)]
    return conv_system, steps


def post(url: str, body: dict, timeout: float = 600.0) -> dict:
    req = urllib.request.Request(url, json.dumps(body).encode(), {"content-type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


def pd(prefill: SGLangServer, decode: SGLangServer, ids: list[int], new: int) -> dict:
    body = {"input_ids": ids, "sampling_params": {"max_new_tokens": new, "temperature": 0.0, "ignore_eos": True},
            "bootstrap_host": "127.0.0.1", "bootstrap_port": prefill.spec.bootstrap_port,
            "bootstrap_room": random.getrandbits(63)}
    side: dict = {}
    t = threading.Thread(target=lambda: side.update(p=post(prefill.url + "/generate", body)))
    t.start()
    out = post(decode.url + "/generate", body)
    t.join()
    out["prefill"] = side["p"]
    return out


def sent_bytes(stats_port: int) -> int:
    doc = json.loads(urllib.request.urlopen(f"http://127.0.0.1:{stats_port}/stats", timeout=10).read())
    return sum(link["bytes_total"] for link in doc["links"].values())


def start(log_dir: Path, chunk: int, variants: list[str], decode_tokens: int):
    model = str(ensure("tiny-qwen35-hybrid"))
    stats = free_port()
    servers = {"prefill": SGLangServer(ServerSpec(
        model, free_port(), mode="prefill", transfer_backend="prfaas_zmq", bootstrap_port=free_port(),
        chunked_prefill_size=chunk, log_path=str(log_dir / "prefill.log"),
        extra_args=ZMQ + ("--radix-cache-backend", "prfaas_hybrid", "--prfaas-zmq-stats-port", str(stats)),
        fork_children=True))}
    pool = {"max_total_tokens": decode_tokens} if decode_tokens else {}
    # SGLang reserves 512 decode tokens per admitted request: with a small pool a long prompt would wait in
    # the prealloc queue for good; a few answer tokens need far fewer
    reserve = ("--num-reserved-decode-tokens", "64") if decode_tokens else ()
    for name in variants:
        servers[name] = SGLangServer(ServerSpec(
            model, free_port(), mode="decode", transfer_backend="prfaas_zmq", max_running_requests=1,
            log_path=str(log_dir / f"decode_{name}.log"), fork_children=True, **pool,
            extra_args=ZMQ + ("--enable-cache-report",) + reserve + VARIANTS[name]))
    for s in servers.values():
        s.start()
    for s in servers.values():
        s.wait_healthy(timeout_s=900)
    return servers, stats


def run(args) -> dict:
    conv_system, steps = make_trace(args.seed, args.systems, args.convs, args.turns, args.system_len,
                                    (args.msg_min, args.msg_max))
    out_dir = Path(args.out)
    variants = args.variants.split(",")
    servers, stats = start(out_dir / "logs", args.chunk, variants, args.decode_tokens)
    history = [list(s) for s in conv_system]
    rows = []
    try:
        for conv, msg in steps:
            ids = history[conv] + msg
            row = {"conv": conv, "prompt_tokens": len(ids)}
            outputs = {}
            for name in variants:
                before, t0 = sent_bytes(stats), time.perf_counter()
                o = pd(servers["prefill"], servers[name], ids, args.new)
                row[name] = {"bytes": sent_bytes(stats) - before, "decode_cached": o["meta_info"]["cached_tokens"],
                             "latency_s": round(time.perf_counter() - t0, 3)}
                outputs[name] = o["output_ids"]
            row["outputs_agree"] = len({tuple(v) for v in outputs.values()}) == 1
            rows.append(row)
            history[conv] = ids + outputs[variants[0]]
            print(json.dumps(row), flush=True)
    finally:
        for s in servers.values():
            s.stop()
    # the trace's working set: each distinct system prompt once, plus each conversation's own turns
    distinct = {tuple(s) for s in conv_system}
    config = dict(vars(args), distinct_prompt_tokens=sum(map(len, distinct)) + sum(
        len(h) - len(s) for h, s in zip(history, conv_system)), load_end=os.getloadavg())
    return summarize(config, rows, variants)


def summarize(config: dict, rows: list[dict], variants: list[str]) -> dict:
    """Totals, and the prompt tokens each decode cache kept off the wire. Decode's `cached_tokens`
    is the larger of the prefill's and its own hit in PD, so the skipped tokens come from bytes:
    bytes = k * sent tokens + c, k fitted on the `none` rows (which send every prompt token)."""
    total = {n: sum(r[n]["bytes"] for r in rows) for n in variants}
    prompt = sum(r["prompt_tokens"] for r in rows)
    a, b = rows[0], next(r for r in rows if r["prompt_tokens"] != rows[0]["prompt_tokens"])
    k = (b["none"]["bytes"] - a["none"]["bytes"]) / (b["prompt_tokens"] - a["prompt_tokens"])
    skipped = {n: round(sum(r["none"]["bytes"] - r[n]["bytes"] for r in rows) / k) for n in variants}
    return {
        "config": config, "requests": len(rows), "prompt_tokens": prompt, "kv_bytes_per_token": k,
        "distinct_prompt_tokens": config.get("distinct_prompt_tokens"),
        "bytes": total, "bytes_vs_none": {n: round(total[n] / total["none"], 4) for n in variants},
        "prompt_tokens_not_sent": {n: round(skipped[n] / prompt, 4) for n in variants},
        "outputs_agree": all(r["outputs_agree"] for r in rows), "rows": rows,
    }


def table_row(result: dict) -> str:
    b, h = result["bytes_vs_none"], result["prompt_tokens_not_sent"]
    return (f"| {result['requests']} req, {result['prompt_tokens']} prompt tokens | "
            + " | ".join(f"{n}: {result['bytes'][n]:,} B ({b[n]:.3f}); {h[n]:.3f} not sent" for n in b)
            + f" | {result['outputs_agree']} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--systems", type=int, default=2, help="distinct system prompts")
    ap.add_argument("--convs", type=int, default=4, help="conversations (round-robin over system prompts)")
    ap.add_argument("--turns", type=int, default=3)
    ap.add_argument("--system-len", type=int, default=600)
    ap.add_argument("--msg-min", type=int, default=30)
    ap.add_argument("--msg-max", type=int, default=90)
    ap.add_argument("--new", type=int, default=8, help="answer tokens per turn")
    ap.add_argument("--chunk", type=int, default=64, help="prefill --chunked-prefill-size")
    ap.add_argument("--out", default="out/bench_decode_cache")
    ap.add_argument("--variants", default=",".join(VARIANTS), help="decode caches to compare; the first is "
                    "'none' (the byte model is fitted on its rows)")
    ap.add_argument("--decode-tokens", type=int, default=0, help="each decode's --max-total-tokens (0: default)")
    args = ap.parse_args()
    Path(args.out).mkdir(parents=True, exist_ok=True)
    result = run(args)
    (Path(args.out) / "result.json").write_text(json.dumps(result, indent=1))
    print(table_row(result))
    sys.exit(0 if result["outputs_agree"] else 1)


if __name__ == "__main__":
    main()
