"""The malformed-request campaign against real SGLang servers (not a test; the sglang tier runs a reduced one in
tests/sglang/test_router_e2e.py).

Starts, on 127.0.0.1, a PD deployment of tiny-qwen35-hybrid (a PrfaaS prefill, a local prefill and a decode over
prfaas_zmq), the router as its own process (`python -m prfaas_sgl.launch_router`, threshold policy) and a
colocated server. Then sends the catalog of prfaas_sgl/tools/chaos/hostile.py:
- every case through the router, which must answer each as the catalog expects (4xx with a message, or 200);
- every case to the colocated server directly (it must never fail: 4xx with a message or 200);
- the cases that crashed stock SGLang to each PD server directly (each must be refused);
after every answer every server must answer /health, and at the end the router must count every instance
healthy and serve a request on each route. Prints one JSON document; exit 1 on any finding.

    python scripts/fuzz_servers.py --out out/fuzz_servers.json
"""
from __future__ import annotations

import argparse
import json
import os
import re
import sys
import tempfile
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from prfaas_sgl.tools.chaos import hostile  # noqa: E402
from prfaas_sgl.tools.launch import ManagedProcess, SGLangServer, ServerSpec, free_port, stop_together  # noqa: E402
from prfaas_sgl.tools.models.tiny import ensure  # noqa: E402

CONTEXT = 8192  # the tiny model's max_position_embeddings
THRESHOLD = 200
ZMQ = ("--prfaas-zmq-timeout-s", "60")
POOLS = {"prfaas": "prfaas", "local_prefill": "local", "decode": "decode"}


def specs(model: str, log_dir: Path) -> dict[str, ServerSpec]:
    def one(name: str, **kw) -> ServerSpec:
        return ServerSpec(model_path=model, port=free_port(), log_path=str(log_dir / f"{name}.log"), **kw)

    pd = dict(transfer_backend="prfaas_zmq", extra_args=ZMQ)
    return {"prfaas": one("prfaas", mode="prefill", bootstrap_port=free_port(), **pd),
            "local": one("local", mode="prefill", bootstrap_port=free_port(), **pd),
            "decode": one("decode", mode="decode", **pd),
            "colocated": one("colocated", extra_args=("--disable-radix-cache",))}


def start_router(s: dict[str, ServerSpec], model: str, log_dir: Path) -> ManagedProcess:
    def inst(name: str) -> dict:
        return {"url": s[name].url, "name": name, **({"bootstrap_port": s[name].bootstrap_port}
                                                      if s[name].bootstrap_port else {})}

    port = free_port()
    cfg = {"host": "127.0.0.1", "port": port, "prfaas": [inst("prfaas")], "local_prefill": [inst("local")],
           "decode": [inst("decode")], "tokenizer_path": model, "served_model_name": "tiny",
           "context_length": CONTEXT, "policy": "threshold", "threshold": THRESHOLD, "block_size": 1,
           "request_timeout_s": 120, "prefill_timeout_s": 120, "health_interval_s": 5}
    path = log_dir / "router.json"
    path.write_text(json.dumps(cfg, indent=1))
    cmd = [sys.executable, "-m", "prfaas_sgl.launch_router", "--config", str(path)]
    return ManagedProcess(cmd, dict(os.environ), str(log_dir / "router.log"), f"http://127.0.0.1:{port}").start()


def healthy_counts(router_url: str) -> dict[str, float]:
    text = urllib.request.urlopen(router_url + "/metrics", timeout=10).read().decode()
    found = re.findall(r'prfaas_router_pool_healthy_instances\{pool="(\w+)"\} ([0-9.]+)', text)
    return {pool: float(n) for pool, n in found}


def serves_both_routes(router_url: str) -> dict[str, str]:
    routes = {}
    for n in (40, 400):  # below and above the threshold
        body = {"input_ids": [(7 * i) % 500 + 1 for i in range(n)], "sampling_params": {"max_new_tokens": 4}}
        req = urllib.request.Request(router_url + "/generate", json.dumps(body).encode(),
                                     {"content-type": "application/json"})
        with urllib.request.urlopen(req, timeout=300) as r:
            routes[str(n)] = r.headers.get("x-prfaas-route", "?") if r.status == 200 else f"HTTP {r.status}"
    return routes


def campaign(s: dict[str, SGLangServer], router: ManagedProcess, lim: hostile.Limits) -> dict:
    servers = {name: srv.spec.url for name, srv in s.items()}
    pd = {name: url for name, url in servers.items() if name != "colocated"}
    report = hostile.run({"router": router.url}, servers, hostile.cases(lim), strict=True, say=print)
    hostile.run({"colocated": servers["colocated"]}, servers, hostile.cases(lim), strict=False, say=print,
                report=report)
    hostile.run(pd, servers, hostile.crash_cases(lim), strict=False, say=print, report=report)
    counts = healthy_counts(router.url)
    out = report.summary()
    out.update(router_healthy_instances=counts, routes_after=serves_both_routes(router.url),
               servers_alive={name: srv.proc.poll() is None for name, srv in s.items()})
    out["ok"] = report.ok and all(counts.get(pool) == 1.0 for pool in POOLS) and all(out["servers_alive"].values())
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="", help="also write the JSON here")
    p.add_argument("--log-dir", default="", help="server logs (default: a temporary directory)")
    args = p.parse_args()
    model = str(ensure("tiny-qwen35-hybrid"))
    lim = hostile.Limits(vocab_size=hostile.vocab_size(model), context_length=CONTEXT, model="tiny")
    log_dir = Path(args.log_dir or tempfile.mkdtemp(prefix="fuzz_servers-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    servers = {name: SGLangServer(spec) for name, spec in specs(model, log_dir).items()}
    router = None
    try:
        for srv in servers.values():
            srv.start()
        for srv in servers.values():
            srv.wait_healthy(timeout_s=600)
        router = start_router({n: srv.spec for n, srv in servers.items()}, model, log_dir)
        router.wait_healthy(timeout_s=120)
        report = campaign(servers, router, lim)
    finally:
        stop_together([*servers.values(), *([router] if router else [])])
    report["log_dir"] = str(log_dir)
    text = json.dumps(report, indent=1)
    print(text)
    if args.out:
        os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
        Path(args.out).write_text(text + "\n")
    sys.exit(0 if report["ok"] else 1)


if __name__ == "__main__":
    main()
