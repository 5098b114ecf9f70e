"""The cache pool's differential test at length (not a test; tests/sglang runs it at CI size): for each
hybrid family, a random prompt tree (prfaas_sgl/workload/prompt_trees.py) through every route that serves
`--radix-cache-backend prfaas_hybrid`, each prompt compared with a colocated server without prefix caching
on the same weights (chunk 512): greedy tokens must be equal, log-probs within 1e-4 (why not bit-exact:
tests/sglang/prompt_trees.py).

    family   model                 routes
    gdn      tiny-qwen35-hybrid    colocated pool (chunk 64), PD with the pool on prefill (chunk 64) and decode
    kimi     tiny-kimi-linear      colocated pool (chunk 64), PD with the pool on prefill (chunk 512) and decode
    swa      tiny-mimo-v2-swa      colocated pool (chunk 64), PD with the pool on prefill (chunk 512) and decode,
                                   page size 16 (SGLang's SWA decode preallocates only the window tail then)
    dense: not served by the pool (it refuses models without linear or sliding-window layers; SGLang's own
           radix cache is the tool there)

The pools are small (4,096 tokens), so entries are evicted between hits. One family's servers at a time;
the report is rewritten after each family, so a run cut short keeps the families it finished.

    python3 scripts/pool_differential.py --prompts 60 --out docs/results/pool_differential.json
"""
from __future__ import annotations

import argparse
import json
import random
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

from prfaas_sgl.tools.launch import SGLangServer, ServerSpec, free_port, stop_together
from prfaas_sgl.tools.models.tiny import corpus, ensure
from prfaas_sgl.workload.prompt_trees import kinds, prompt_tree

FAMILIES = {"gdn": ("tiny-qwen35-hybrid", 64), "kimi": ("tiny-kimi-linear", 512), "swa": ("tiny-mimo-v2-swa", 512)}
PD_PAGE = {"tiny-mimo-v2-swa": 16}  # SGLang's SWA decode at page size 1 preallocates the whole prompt
POOL = ("--radix-cache-backend", "prfaas_hybrid", "--enable-cache-report")
CHECK = {"PRFAAS_CACHEPOOL_CHECK": "1"}
BOUND = 1e-4
NEW = 8


def specs(model: str, pd_chunk: int, log_dir: Path) -> dict[str, ServerSpec]:
    path = str(ensure(model))
    slots = dict(max_mamba_slots=24) if "mimo" not in model else {}

    def s(name: str, **kw) -> ServerSpec:
        return ServerSpec(path, free_port(), log_path=str(log_dir / f"{model}_{name}.log"), **kw)

    out = {"reference": s("reference", chunked_prefill_size=512, max_running_requests=1,
                          extra_args=("--disable-radix-cache",)),
           "pool": s("pool", chunked_prefill_size=64, max_total_tokens=4096, max_running_requests=1, env=CHECK,
                     extra_args=POOL, **slots)}
    if pd_chunk:
        zmq = ("--prfaas-zmq-timeout-s", "120")
        slots = {**slots, "page_size": PD_PAGE.get(model, 1)}
        out["prefill"] = s("prefill", mode="prefill", transfer_backend="prfaas_zmq", bootstrap_port=free_port(),
                           chunked_prefill_size=pd_chunk, max_total_tokens=4096, env=CHECK, extra_args=zmq + POOL,
                           **slots)
        out["decode"] = s("decode", mode="decode", transfer_backend="prfaas_zmq", max_running_requests=1,
                          max_total_tokens=4096, env=CHECK, **slots,
                          extra_args=zmq + POOL + ("--disaggregation-decode-enable-radix-cache",))
    return out


def post(url: str, body: dict) -> dict:
    req = urllib.request.Request(url + "/generate", json.dumps(body).encode(), {"content-type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=600) as r:
            return json.loads(r.read())
    except urllib.error.HTTPError as e:
        return {"error": f"HTTP {e.code}: {e.read().decode(errors='replace')[:300]}"}


def pd(prefill: SGLangServer, decode: SGLangServer, body: dict) -> dict:
    body = {**body, "bootstrap_host": "127.0.0.1", "bootstrap_port": prefill.spec.bootstrap_port,
            "bootstrap_room": random.getrandbits(63)}
    side: dict = {}
    t = threading.Thread(target=lambda: side.update(p=post(prefill.url, body)))
    t.start()
    out = post(decode.url, body)
    t.join()
    out["prefill"] = side.get("p", {})
    return out


def cached(out: dict) -> int:
    own = out.get("meta_info", {}).get("cached_tokens", 0)
    return own + out.get("prefill", {}).get("meta_info", {}).get("cached_tokens", 0)


def compare(prompts: list[list[int]], through, reference: list[dict]) -> dict:
    rows = []
    for ids, ref in zip(prompts, reference):
        got = through(body(ids))
        toks = got.get("output_ids")
        diff = max((abs(a[0] - b[0]) for a, b in zip(got.get("meta_info", {}).get("output_token_logprobs", []),
                                                       ref["meta_info"]["output_token_logprobs"])), default=None)
        rows.append({"len": len(ids), "cached": cached(got), "equal": toks == ref["output_ids"],
                     "max_dlogprob": diff, "error": got.get("error")})
    worst = max((r["max_dlogprob"] or 0.0) for r in rows)
    return {"prompts": len(rows), "unequal": sum(not r["equal"] for r in rows),
            "hits": sum(r["cached"] > 0 for r in rows), "cached_tokens": sum(r["cached"] for r in rows), "worst_dlogprob": worst,
            "over_bound": sum((r["max_dlogprob"] or 0.0) > BOUND for r in rows), "rows": rows}


def body(ids: list[int]) -> dict:
    return {"input_ids": ids, "return_logprob": True,
            "sampling_params": {"max_new_tokens": NEW, "temperature": 0.0, "ignore_eos": True}}


def text_ids(model_path: str, seed: int) -> list[int]:
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(Path(model_path) / "tokenizer.json"))
    return [t for line in corpus(n_lines=4000, seed=seed) for t in tok.encode(line + "\n").ids][:8000]


def run_family(name: str, n: int, seed: int, log_dir: Path) -> dict:
    model, pd_chunk = FAMILIES[name]
    servers = {k: SGLangServer(s) for k, s in specs(model, pd_chunk, log_dir).items()}
    for srv in servers.values():
        srv.start()
    try:
        for srv in servers.values():
            srv.wait_healthy(timeout_s=900)
        prompts = prompt_tree(text_ids(str(ensure(model)), seed), seed, n)
        t0 = time.time()
        reference = [post(servers["reference"].url, body(ids)) for ids in prompts]
        routes = {"colocated_pool": compare(prompts, lambda b: post(servers["pool"].url, b), reference)}
        if "prefill" in servers:
            routes["pd_pools"] = compare(prompts, lambda b: pd(servers["prefill"], servers["decode"], b), reference)
        return {"model": model, "tree": kinds(prompts), "seconds": round(time.time() - t0, 1), "routes": routes}
    finally:
        stop_together(list(servers.values()))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--families", nargs="+", default=list(FAMILIES), choices=list(FAMILIES))
    ap.add_argument("--prompts", type=int, default=60)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="out/pool_differential.json")
    ap.add_argument("--log-dir", default="out/pool_differential_logs")
    a = ap.parse_args(argv)
    log_dir = Path(a.log_dir)
    log_dir.mkdir(parents=True, exist_ok=True)
    report = {"prompts_per_route": a.prompts, "seed": a.seed, "bound": BOUND, "families": {}}
    for name in a.families:
        report["families"][name] = fam = run_family(name, a.prompts, a.seed, log_dir)
        for route, r in fam["routes"].items():
            print(f"{name:5s} {route:15s} prompts {r['prompts']:3d}  unequal {r['unequal']}  over-bound "
                  f"{r['over_bound']}  hits {r['hits']}  worst |dlogprob| {r['worst_dlogprob']:.2e}", flush=True)
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(json.dumps(report, indent=1))
    bad = sum(r["unequal"] + r["over_bound"] for f in report["families"].values() for r in f["routes"].values())
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
