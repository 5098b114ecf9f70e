"""`make demo`: a real PrfaaS deployment on one machine, measured under three routing policies.

    python -m prfaas_sgl.tools.demo [--sessions 24] [--link-mbit 20] [--out out/demo]
    python -m prfaas_sgl.tools.demo --quick          # one CPU server, one chat request

A "remote" PrfaaS prefill server runs in its own network namespace behind a `tc tbf`-limited veth link;
two local prefill servers, a local decode server and the router run on the host. A scaled paper-shaped
workload (truncated log-normal input lengths x 1/64, 16 output tokens) is replayed, with the same seed,
under PrfaaS (threshold + bandwidth-aware), homogeneous PD (the same number of servers, all local) and naive
(every prefill remote). A last phase shifts the workload from long to short prompts mid-run; the controller
switches a local prefill server to decode while requests keep coming. Results: side-by-side tables, JSON and
PNG plots under --out, and which results need heterogeneous hardware the demo cannot emulate.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import time
import urllib.request
from pathlib import Path

from prfaas_sgl.tools import netns
from prfaas_sgl.tools.demo import monitor, quick, shift
from prfaas_sgl.tools.demo.live import LiveRouter, use_servers
from prfaas_sgl.tools.demo.table import NOT_EMULATED, format_side_by_side
from prfaas_sgl.tools.demo.topology import PHASES, DemoLink, Phase, deployment
from prfaas_sgl.tools.deploy.up import Stack, resolve_model
from prfaas_sgl.router.config import RouterConfig
from prfaas_sgl.transfer.security import generate_keys

SWITCH_WAIT_S = 240.0  # the shift phase waits this long at most for the switched server to come back


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


def run_policy(router_url: str, tokenizer: str, args, out: Path, policy: str, prom=None, name: str = "",
               **bench_kw) -> dict:
    from prfaas_sgl.tools.loadgen.cli import bench
    from prfaas_sgl.tools.loadgen.config import BenchConfig
    from prfaas_sgl.tools.loadgen.plots import write_plots

    set_policy(router_url, policy)
    cfg = BenchConfig(
        url=router_url, api="completions", input_len="paper", output_len="fixed:1024", scale=args.scale,
        num_sessions=args.sessions, rate=args.rate, seed=args.seed, tokenizer=tokenizer,
        router_metrics=router_url + "/metrics", metrics_interval=0.5, request_timeout=300.0,
        slo_ttft=args.slo_ttft, slo_tpot=args.slo_tpot, progress=True,
    )
    results = asyncio.run(bench(dataclasses.replace(cfg, **bench_kw)))
    monitor.read_back(prom, results)  # the table's link and offload numbers as Prometheus stored them
    (out / (name or policy)).mkdir(parents=True, exist_ok=True)
    (out / (name or policy) / "results.json").write_text(json.dumps(results, indent=1))
    write_plots(results, out / (name or policy))
    return results


def servers_of(dep, names: tuple[str, ...]) -> str:
    pools = {s.name: s.pool for s in dep.servers}
    n = [sum(pools[x] == p for x in names) for p in ("prfaas", "local_prefill", "decode")]
    return f"{n[0]} + {n[1]}/{n[2]}"


def run_shift(router: LiveRouter, stack: Stack, link: DemoLink, phase: Phase, args, tokenizer: str,
              prom) -> tuple[list, list[str]]:
    """The shift phase: parts A, B, C of ``shift.PARTS``; B's short prompts make the controller move a local
    prefill server to decode; C runs once it serves again. Returns ([(label, results)], action lines)."""
    from prfaas_sgl.router.actuators.decide import DecideConfig
    from prfaas_sgl.router.actuators.processes import ProcessesActuator
    from prfaas_sgl.router.controller_glue import close_loop
    from prfaas_sgl.tools.server_control import LaunchedServers

    control = LaunchedServers(stack.servers, decode_host=link.local_ip)
    acting = router.call(lambda r: close_loop(r, lambda cluster, report: ProcessesActuator(
        cluster, control, report), DecideConfig(confirm=2, dwell_s=0.0)))
    router.controller.active = True
    t0, parts = time.time(), []
    try:
        for label, kw, mult in shift.PARTS:
            if label.startswith("C"):  # after the switch: wait (bounded) until it ended, however it ended
                deadline = time.monotonic() + SWITCH_WAIT_S
                while time.monotonic() < deadline and not any(a.outcome != "in_progress" for a in acting.actions):
                    time.sleep(1)
            say(f"  {label}")
            res = run_policy(router.url, tokenizer, args, args.out, phase.policy, prom, name=f"shift-{label[0]}",
                             num_sessions=max(2, int(args.sessions * mult)), **kw)
            res["servers"] = router.call(lambda r: "1 + {0.prefill}/{0.decode}".format(acting.actuator.current()))
            parts.append((label, res))
    finally:
        router.controller.active = False
    lines = shift.describe(acting.actions, acting.action_times, t0)
    shift.plot_timeline(parts, acting.actions, acting.action_times, args.out / "shift" / "timeline.png")
    return parts, lines


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
    ap.add_argument("--no-shift", action="store_true", help="skip the workload-shift phase (a restart under load "
                    "takes minutes here: the CI smoke test skips it; tests/sglang/role_switch_e2e.py proves it)")
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
        stack = Stack(monitor.with_metrics(dep), "demo", args.out / "logs", say=say)  # servers; router below
        prom = router = None
        rows, parts, lines = [], [], []
        try:
            say(f"starting {len(dep.servers)} SGLang servers on CPU + the router (1-3 min) ...")
            stack.start()
            rcfg = RouterConfig.from_flags(**stack.dep.router_fields(tokenizer_path=model))
            router = LiveRouter(rcfg, shift.LengthRule((2, 1), args.threshold)).start()
            prom = monitor.start(stack.dep, args.out, say)
            tokenizer = f"{model}/tokenizer.json"
            for i, phase in enumerate(PHASES, 1):
                if phase.shift and args.no_shift:
                    continue
                say(f"phase {i}/{len(PHASES)}: {phase.label} on {', '.join(phase.servers)}")
                router.call(lambda r: use_servers(r.cluster, phase.servers))
                if phase.shift:
                    parts, lines = run_shift(router, stack, link, phase, args, tokenizer, prom)
                    continue
                res = run_policy(router.url, tokenizer, args, args.out, phase.policy, prom)
                res["servers"] = servers_of(dep, phase.servers)
                rows.append((phase.label, res))
        finally:
            say("stopping servers")
            if prom is not None:
                prom.stop()
            if router is not None:
                router.close()
            stack.stop()
    print()
    print(format_side_by_side(rows))
    if args.no_shift:
        print("\nworkload shift + controller: skipped (--no-shift)")
    else:
        print("\nworkload shift + controller (local prefill -> decode under load):")
        print(format_side_by_side(parts))
        print("\n".join(["controller actions:", *lines] if lines else ["controller actions: none (no switch)"]))
    print("\n" + "\n".join(NOT_EMULATED))
    for path, table in ((args.out / "summary.json", rows), (args.out / "shift" / "summary.json", parts)):
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({label: r["summary"] | {"router": r["router"], "servers": r.get("servers"),
                                                          "routes": {k: v["requests"] for k, v in r["routes"].items()}}
                                    for label, r in table}, indent=1))
    (args.out / "shift" / "actions.txt").write_text("\n".join(lines) + "\n")
    say(f"done in {time.monotonic() - t0:.0f}s; results and plots in {args.out}/ (switch: {args.out}/shift/)")
    switched = any(line.split("] ")[1].startswith("applied") for line in lines)
    return 0 if all(r["summary"]["errors"] == 0 for _, r in rows + parts) and (switched or args.no_shift) else 1


if __name__ == "__main__":
    raise SystemExit(main())
