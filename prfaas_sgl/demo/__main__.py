"""`make demo`: a real PrfaaS deployment on one machine, measured under three routing policies.

    python -m prfaas_sgl.demo [--sessions 24] [--link-mbit 20] [--out out/demo]
    python -m prfaas_sgl.demo --quick          # one CPU server, one chat request

A "remote" PrfaaS prefill server runs in its own network namespace behind a `tc tbf`-limited veth link;
a local prefill server, a local decode server and the router run on the host. A scaled paper-shaped
workload (truncated log-normal input lengths x 1/64, 16 output tokens) is replayed, with the same seed,
under PrfaaS (threshold + bandwidth-aware), homogeneous PD (everything local) and naive (every prefill
remote). Results: a side-by-side table, JSON and PNG plots under --out.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import time
import urllib.request
from pathlib import Path

from prfaas_sgl import netns
from prfaas_sgl.demo import monitor, quick
from prfaas_sgl.demo.table import format_side_by_side
from prfaas_sgl.demo.topology import DemoLink, deployment
from prfaas_sgl.deploy.up import Stack, resolve_model
from prfaas_sgl.transfer.security import generate_keys

POLICIES = (("PrfaaS (threshold + bandwidth-aware)", "bandwidth_aware"),
            ("homogeneous PD (all local)", "local_only"),
            ("naive (all prefill remote)", "all_remote"))


def say(msg: str) -> None:
    print(f"[demo {time.strftime('%H:%M:%S')}] {msg}", flush=True)


@contextlib.contextmanager
def demo_link(mbit: float):
    problem = netns.root_problem()
    if problem:
        say(f"no emulated link ({problem}): every server on 127.0.0.1, KV crosses loopback uncapped")
        yield DemoLink("127.0.0.1", "127.0.0.1", None, None)
        return
    with netns.emulated_link(rate=f"{mbit:g}mbit", tag="demo") as link:
        say(f"emulated inter-DC link: namespace {link.netns}, {link.remote_ip} <-> {link.local_ip}, "
            f"tc tbf {mbit:g} Mbit/s")
        yield DemoLink(link.remote_ip, link.local_ip, link.netns, link.rate)


def set_policy(router_url: str, policy: str) -> None:
    req = urllib.request.Request(router_url + "/admin/routing", json.dumps({"policy": policy}).encode(),
                                 {"content-type": "application/json"})
    with urllib.request.urlopen(req, timeout=10) as r:
        got = json.loads(r.read())["policy"]
    if got != policy:
        raise RuntimeError(f"router kept policy {got!r} after POST /admin/routing {{'policy': {policy!r}}}")


def run_policy(router_url: str, tokenizer: str, args, out: Path, policy: str, prom=None) -> dict:
    from prfaas_sgl.loadgen.cli import bench
    from prfaas_sgl.loadgen.config import BenchConfig
    from prfaas_sgl.loadgen.plots import write_plots

    set_policy(router_url, policy)
    cfg = BenchConfig(
        url=router_url, api="completions", input_len="paper", output_len="fixed:1024", scale=args.scale,
        num_sessions=args.sessions, rate=args.rate, seed=args.seed, tokenizer=tokenizer,
        router_metrics=router_url + "/metrics", metrics_interval=0.5, request_timeout=300.0,
        slo_ttft=args.slo_ttft, slo_tpot=args.slo_tpot, progress=True,
    )
    results = asyncio.run(bench(cfg))
    monitor.read_back(prom, results)  # the table's link and offload numbers as Prometheus stored them
    (out / policy).mkdir(parents=True, exist_ok=True)
    (out / policy / "results.json").write_text(json.dumps(results, indent=1))
    write_plots(results, out / policy)
    return results


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="one CPU server, one chat request")
    ap.add_argument("--sessions", type=int, default=24, help="requests per policy")
    ap.add_argument("--rate", type=float, default=0.5, help="Poisson arrivals, requests/s")
    ap.add_argument("--scale", type=float, default=1 / 64, help="scale of the paper's lengths")
    ap.add_argument("--threshold", type=int, default=300, help="t in tokens (paper 19.4K x 1/64)")
    ap.add_argument("--link-mbit", type=float, default=20.0, help="emulated inter-DC link rate")
    ap.add_argument("--backend", default="prfaas_zmq", help="KV transfer backend (prfaas_zmq or mooncake)")
    ap.add_argument("--slo-ttft", type=float, default=10.0, help="goodput SLO: TTFT seconds (CPU scale)")
    ap.add_argument("--slo-tpot", type=float, default=0.5, help="goodput SLO: TPOT seconds (CPU scale)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=Path("out/demo"))
    args = ap.parse_args(argv)
    if args.quick:
        return quick.main([])
    args.out.mkdir(parents=True, exist_ok=True)
    model = resolve_model("tiny:tiny-qwen35-hybrid")
    t0 = time.monotonic()
    keys = args.out / "keys"
    generate_keys(str(keys))  # the demo runs secure, as a deployment must on routable addresses
    with demo_link(args.link_mbit) as link:
        dep = deployment(link, "tiny:tiny-qwen35-hybrid", args.backend, args.threshold, args.link_mbit, str(keys))
        stack = Stack(monitor.with_metrics(dep), None, args.out / "logs", say=say)
        prom = None
        try:
            say("starting 3 SGLang servers on CPU + the router (1-3 min) ...")
            stack.start()
            prom = monitor.start(stack.dep, args.out, say)
            rows = []
            for i, (label, policy) in enumerate(POLICIES, 1):
                say(f"phase {i}/3: {label}: {args.sessions} requests")
                rows.append((label, run_policy(stack.router.url, f"{model}/tokenizer.json", args, args.out, policy,
                                               prom)))
        finally:
            say("stopping servers")
            if prom is not None:
                prom.stop()
            stack.stop()
    print()
    print(format_side_by_side(rows))
    (args.out / "summary.json").write_text(json.dumps({label: r["summary"] | {"router": r["router"], "routes": {
        k: v["requests"] for k, v in r["routes"].items()}} for label, r in rows}, indent=1))
    say(f"done in {time.monotonic() - t0:.0f}s; results and plots in {args.out}/")
    return 0 if all(r["summary"]["errors"] == 0 for _, r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
