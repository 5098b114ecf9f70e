"""`make demo`: a real PrfaaS deployment on one machine, emulated heterogeneous hardware, measured under three
routing policies beside the planner's prediction.

    python -m prfaas_sgl.tools.demo [--reps 3] [--sessions 64] [--link-mbit 6] [--out out/demo]
    python -m prfaas_sgl.tools.demo --quick          # one CPU server, one chat request

A "remote" PrfaaS prefill server runs in its own network namespace behind a `tc tbf`-limited veth link;
two local prefill servers, a local decode server and the router run on the host. Each server gets a CPU
share emulating its GPU kind (hardware.py: compute-dense H200-like prefill, bandwidth-optimised H20-like
local servers); without root or the cgroup cpu controller the demo says so and runs unshared.

1. Profiling (cached): each kind's prefill curve and decode rate on the tiny model (profile.py).
2. The planner on those profiles and the emulated link: threshold t and Λ_max per policy (plan.py).
3. The measured table: PrfaaS at the planner's t, homogeneous PD (the same number of servers, all local) and
   naive (every prefill remote), closed-loop, --reps repetitions each, measured beside predicted (measure.py).
4. A last phase shifts the workload from long to short prompts mid-run; the controller switches a local
   prefill server to decode while requests keep coming.
Results: tables, JSON and PNG plots under --out.
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
from prfaas_sgl.tools.demo import hardware, measure, monitor, plan, profile, quick, shift
from prfaas_sgl.tools.demo.live import LiveRouter, forget_caches, use_servers
from prfaas_sgl.tools.demo.table import NOT_EMULATED, format_side_by_side
from prfaas_sgl.tools.demo.topology import EQUAL_COST, PHASES, DemoLink, Phase, deployment
from prfaas_sgl.tools.deploy.up import Stack, resolve_model
from prfaas_sgl.router.config import RouterConfig
from prfaas_sgl.transfer.security import generate_keys

SWITCH_WAIT_S = 240.0  # the shift phase waits this long at most for the switched server to come back
OUTPUT_TOKENS = 1024  # per request, before --scale (16 at 1/64): the measured runs and the planner


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


def set_policy(router_url: str, policy: str, threshold: int | None = None) -> None:
    body = {"policy": policy} | ({"threshold": threshold} if threshold is not None else {})
    req = urllib.request.Request(router_url + "/admin/routing", json.dumps(body).encode(),
                                 {"content-type": "application/json"})
    with urllib.request.urlopen(req, timeout=10) as r:
        got = json.loads(r.read())["policy"]
    if got != policy:
        raise RuntimeError(f"router kept policy {got!r} after POST /admin/routing {{'policy': {policy!r}}}")


def run_policy(router_url: str, tokenizer: str, args, out: Path, policy: str, prom=None, name: str = "",
               threshold: int | None = None, **bench_kw) -> dict:
    from prfaas_sgl.tools.loadgen.cli import bench
    from prfaas_sgl.tools.loadgen.config import BenchConfig
    from prfaas_sgl.tools.loadgen.plots import write_plots

    set_policy(router_url, policy, threshold)
    cfg = BenchConfig(
        url=router_url, api="completions", input_len="paper", output_len=f"fixed:{OUTPUT_TOKENS}",
        scale=args.scale,
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

    control = LaunchedServers(stack.servers, decode_host=link.local_ip, share_for=hardware.pool_share)
    acting = router.call(lambda r: close_loop(r, lambda cluster, report: ProcessesActuator(
        cluster, control, report), DecideConfig(confirm=2, dwell_s=0.0)))
    router.controller.active = True
    t0, parts = time.time(), []
    try:
        for label, kw, mult in shift.PARTS:
            if label.startswith("C"):  # after the switch: wait (bounded) until it ended, however it ended
                deadline = time.monotonic() + SWITCH_WAIT_S
                while time.monotonic() < deadline and not shift.switch_ended(acting.actions):
                    time.sleep(1)
            say(f"  {label}")
            res = run_policy(router.url, tokenizer, args, args.out, phase.policy, prom, name=f"shift-{label[0]}",
                             num_sessions=max(2, int(args.shift_sessions * mult)), **kw)
            res["servers"] = router.call(lambda r: "1 + {0.prefill}/{0.decode}".format(acting.actuator.current()))
            parts.append((label, res))
    finally:
        router.controller.active = False
    lines = shift.describe(acting.actions, acting.action_times, t0)
    shift.plot_timeline(parts, acting.actions, acting.action_times, args.out / "shift" / "timeline.png")
    return parts, lines


def use_shares(args) -> bool:
    """Whether the servers get their emulated hardware; says why not when they cannot."""
    if args.no_shares:
        say("emulated hardware: off (--no-shares): every server runs unshared on the same cores")
        return False
    why = hardware.shares_problem()
    if why:
        say(f"emulated hardware: cannot apply CPU shares ({why}); falling back: every server runs unshared "
            f"on the same cores, so the table compares routing on equal hardware, not the paper's gain")
        return False
    for line in hardware.describe():
        say(f"emulated hardware: {line}")
    return True


def planner_step(model: str, args, shared: bool) -> tuple[dict[str, plan.Prediction], dict]:
    """Profile (cached), then the planner's predictions for the demo's configurations and the router's
    prefill-time model from the same profile."""
    prof = profile.load_or_measure(model, args.profile_cache, args.out / "logs" / "profile.log", say, shared,
                                   str(args.out / "keys"))
    preds = plan.predict(workload_system(prof, args))
    print(plan.format_predictions(preds), flush=True)
    return preds, plan.router_cost(prof)


def workload_system(prof: dict, args) -> plan.System:
    """The planner's view of the measured runs: the profile, the emulated link, the paper's lengths x --scale."""
    return plan.system(prof, args.link_mbit, args.scale, OUTPUT_TOKENS * args.scale)


def measured_phases(router: LiveRouter, stack: Stack, args, tokenizer: str, prom, preds,
                    shared: bool) -> tuple[list, dict]:
    """--reps rounds of the policy phases (the equal-cost one with shares only), caches flushed before each
    run. Returns the last round's (label, results) rows and the measured runs per phase key."""
    phases = [p for p in PHASES if not p.shift] + ([EQUAL_COST] if shared and not args.no_equal_cost else [])
    runs = {p.key: measure.Runs(p.key, p.label) for p in phases}
    rows = []
    for rep in range(args.reps):
        rows = []
        for i, phase in enumerate(phases, 1):
            say(f"repetition {rep + 1}/{args.reps}, phase {i}/{len(phases)}: {phase.label} on "
                f"{', '.join(phase.servers)}")
            router.call(lambda r: use_servers(r.cluster, phase.servers))
            measure.flush_caches([s.url for s in stack.dep.servers])
            router.call(lambda r: forget_caches(r.cluster))
            for name in phase.merged:
                stack.servers[name].cpu.set_cores(2 * stack.servers[name].cpu.share.cores)
            try:
                res = measured_run(router, tokenizer, args, prom, preds, phase, rep)
            finally:
                for name in phase.merged:
                    stack.servers[name].cpu.cap()
            res["servers"] = servers_of(stack.dep, phase.servers)
            runs[phase.key].add(res)
            rows.append((phase.label, res))
    return rows, runs


def measured_run(router: LiveRouter, tokenizer: str, args, prom, preds, phase: Phase, rep: int) -> dict:
    """One closed-loop run of ``phase``; a run with failed requests is no throughput measurement (its failures
    end in milliseconds and cut it short), so it runs once more and the table counts what still failed."""
    run = lambda: run_policy(router.url, tokenizer, args, args.out / f"rep{rep + 1}", phase.policy,  # noqa: E731
                             prom, name=phase.key, threshold=preds[phase.key].threshold,
                             concurrency=args.concurrency, warmup=2)
    res = run()
    if res["summary"]["errors"]:
        say(f"  {res['summary']['errors']} of {args.sessions} requests failed: running this phase again")
        res = run()
    return res


def parse_args(argv):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="one CPU server, one chat request")
    ap.add_argument("--sessions", type=int, default=64, help="requests per measured run")
    ap.add_argument("--reps", type=int, default=3, help="repetitions of the three measured policies")
    ap.add_argument("--concurrency", type=int, default=24, help="requests in flight in a measured run (closed loop)")
    ap.add_argument("--rate", type=float, default=0.5, help="shift phase: Poisson arrivals, requests/s")
    ap.add_argument("--shift-sessions", type=int, default=24,
                    help="shift phase: its parts A / B / C send this x 0.5 / 2 / 0.5 requests")
    ap.add_argument("--scale", type=float, default=1 / 64, help="scale of the paper's lengths")
    ap.add_argument("--threshold", type=int, default=300, help="t in tokens when the planner gives none "
                    "(paper 19.4K x 1/64)")
    # 6 Mbit/s carries naive's ~250 kB requests at ~2.9 req/s, below what the compute-dense prefill sustains
    # (~7.5): naive is link-bound, as in the paper, while PrfaaS prefills short prompts locally. At 20 Mbit/s
    # naive is compute-bound and PrfaaS can add only the 0.105-core local server's work (<= ~1.15x).
    ap.add_argument("--link-mbit", type=float, default=6.0, help="emulated inter-DC link rate")
    ap.add_argument("--backend", default="prfaas_zmq", help="KV transfer backend (prfaas_zmq or mooncake)")
    ap.add_argument("--slo-ttft", type=float, default=10.0, help="goodput SLO: TTFT seconds (CPU scale)")
    ap.add_argument("--slo-tpot", type=float, default=0.5, help="goodput SLO: TPOT seconds (CPU scale)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-shares", action="store_true", help="run every server unshared (no emulated hardware)")
    ap.add_argument("--no-equal-cost", action="store_true", help="skip the equal-cost homogeneous phase")
    ap.add_argument("--profile-cache", type=Path, default=Path("out/demo-profile.json"),
                    help="the profiling step's cache (delete it to profile again)")
    ap.add_argument("--no-shift", action="store_true", help="skip the workload-shift phase (a restart under load "
                    "takes minutes here: the CI smoke test skips it; tests/sglang/role_switch_e2e.py proves it)")
    ap.add_argument("--out", type=Path, default=Path("out/demo"))
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.quick:
        return quick.main([])
    args.out.mkdir(parents=True, exist_ok=True)
    model = resolve_model("tiny:tiny-qwen35-hybrid")
    t0 = time.monotonic()
    keys = args.out / "keys"
    generate_keys(str(keys))  # the demo runs secure, as a deployment must on routable addresses
    shared = use_shares(args)
    preds, cost = planner_step(model, args, shared)
    threshold = preds["bandwidth_aware"].threshold or args.threshold
    with demo_link(args.link_mbit) as link:
        dep = deployment(link, "tiny:tiny-qwen35-hybrid", args.backend, threshold, args.link_mbit, str(keys),
                         shares=shared, cost=cost)
        stack = Stack(monitor.with_metrics(dep), "demo", args.out / "logs", say=say)  # servers; router below
        prom = router = None
        rows, runs, parts, lines = [], {}, [], []
        try:
            say(f"starting {len(dep.servers)} SGLang servers on CPU + the router (1-3 min) ...")
            stack.start()
            rcfg = RouterConfig.from_flags(**stack.dep.router_fields(tokenizer_path=model))
            router = LiveRouter(rcfg, shift.LengthRule((2, 1), threshold)).start()
            prom = monitor.start(stack.dep, args.out, say)
            tokenizer = f"{model}/tokenizer.json"
            rows, runs = measured_phases(router, stack, args, tokenizer, prom, preds, shared)
            report_measured(args, runs, preds, shared)  # now: the shift phase takes minutes more
            shift_phase = next(p for p in PHASES if p.shift)
            if not args.no_shift:
                say(f"phase 4/4: {shift_phase.label} on {', '.join(shift_phase.servers)}")
                router.call(lambda r: use_servers(r.cluster, shift_phase.servers))
                parts, lines = run_shift(router, stack, link, shift_phase, args, tokenizer, prom)
        finally:
            say("stopping servers")
            if prom is not None:
                prom.stop()
            if router is not None:
                router.close()
            stack.stop()
    report(args, rows, runs, preds, parts, lines, shared)
    say(f"done in {time.monotonic() - t0:.0f}s; results and plots in {args.out}/ (switch: {args.out}/shift/)")
    switched = any(line.split("] ")[1].startswith("applied") for line in lines)
    return 0 if all(r["summary"]["errors"] == 0 for _, r in rows + parts) and (switched or args.no_shift) else 1


def report_measured(args, runs, preds, shared: bool) -> None:
    print(f"\nmeasured ({args.reps} repetition(s), {args.sessions} requests each, {args.concurrency} in flight) "
          f"vs predicted (planner on the measured profile){'' if shared else ' — UNSHARED fallback'}:")
    print(measure.format_measured(runs, preds))
    print(measure.stability(runs, preds), flush=True)
    (args.out / "measured.json").write_text(measure.to_json(runs, preds))


def report(args, rows, runs, preds, parts, lines, shared: bool) -> None:
    print()
    print(f"last repetition ({args.reps} of {args.reps}):")
    print(format_side_by_side(rows))
    report_measured(args, runs, preds, shared)
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


if __name__ == "__main__":
    raise SystemExit(main())
