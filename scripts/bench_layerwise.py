"""Chunk-pipelined vs layer-wise prfaas_zmq, side by side, on real SGLang servers (CPU, tiny models).

Two prefill servers run in an emulated remote datacenter (`tools/netns`: a network namespace behind a
veth pair with `tc tbf` on both ends; needs root), one with `--prfaas-layerwise-layers-per-group`, one
without; one decode and one colocated server run on the host. Per link rate and prompt length, requests
alternate between the two paths (a fresh prompt each time: nothing is cached), one at a time:

    TTFT      client -> decode answer with max_new_tokens=1 (the first token reaches the client only
              once the KV and states landed and were verified)
    tail      TTFT - the colocated server's TTFT for the same prompt (the same chunked prefill, no
              transfer): the time from the prompt's last forward to the decode's first token, the
              part layer-wise streaming exists to remove (derived, not timestamped in the servers)

    decode CPU  CPU seconds the decode's scheduler process used during that PD request (a scheduler that
              spins while it waits for the KV takes them from the prefill's forward on shared cores)

Round-trip delay is not emulated (this kernel's tc has no netem): only the rate. JSON to --out.

    sudo PYTHONPATH=. .venv/bin/python scripts/bench_layerwise.py --rates 50mbit,200mbit --lengths 1024,4096,7936 --reps 3
"""
from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import time
from pathlib import Path

import psutil

from prfaas_sgl.tools import netns
from prfaas_sgl.tools.launch import SGLangServer, ServerSpec, free_port, stop_together
from prfaas_sgl.tools.models.tiny import ensure
from tests.sglang.pd import generate_body, pd_generate, post
from tests.sglang.prompts import prompt_ids

ZMQ = ("--prfaas-zmq-insecure", "--prfaas-zmq-timeout-s", "300")
NO_CACHE = ("--disable-radix-cache",)  # every prompt is computed in full: a prefix hit would hide the compute


def servers(model: str, link: netns.Link, chunk: int, group: int, log_dir: Path) -> dict[str, SGLangServer]:
    path = str(ensure(model))

    def prefill(name: str, extra: tuple[str, ...]) -> ServerSpec:
        return ServerSpec(path, free_port(), host=link.remote_ip, mode="prefill", transfer_backend="prfaas_zmq",
                          bootstrap_port=free_port(), chunked_prefill_size=chunk, netns=link.netns,
                          extra_args=ZMQ + NO_CACHE + extra, log_path=str(log_dir / f"{name}.log"))

    specs = {
        "chunk": prefill("prefill_chunk", ()),
        "layerwise": prefill("prefill_layerwise", ("--prfaas-layerwise-layers-per-group", str(group),
                                                   "--prfaas-layerwise-min-tokens", "1")),
        "decode": ServerSpec(path, free_port(), host=link.local_ip, mode="decode", transfer_backend="prfaas_zmq",
                             max_running_requests=1, extra_args=ZMQ, log_path=str(log_dir / "decode.log")),
        "colocated": ServerSpec(path, free_port(), chunked_prefill_size=chunk, extra_args=NO_CACHE,
                                log_path=str(log_dir / "colocated.log")),
    }
    return {name: SGLangServer(s) for name, s in specs.items()}


def set_rate(link: netns.Link, rate: str) -> None:
    tbf = ["root", "tbf", "rate", rate, "burst", netns.BURST, "latency", "50ms"]
    subprocess.run(["tc", "qdisc", "change", "dev", link.local_dev, *tbf], check=True)
    subprocess.run([*link.exec_prefix, "tc", "qdisc", "change", "dev", link.remote_dev, *tbf], check=True)


def timed(fn) -> tuple[float, dict]:
    start = time.perf_counter()
    out = fn()
    return time.perf_counter() - start, out


def scheduler_of(server: SGLangServer) -> psutil.Process:
    return next(c for c in psutil.Process(server.proc.pid).children(recursive=True)
                if "scheduler" in " ".join(c.cmdline()))


def cpu_s(proc: psutil.Process) -> float:
    t = proc.cpu_times()
    return t.user + t.system


def one_round(srv: dict, path: str, length: int, seed: int) -> dict[str, float]:
    """TTFT of one fresh prompt on the colocated server and through each prefill path."""
    body = generate_body(prompt_ids(path, length, seed=seed), 1)
    row = {}
    row["colocated"], ref = timed(lambda: post(srv["colocated"].url + "/generate", body))
    decode = scheduler_of(srv["decode"])
    for name in random.Random(seed).sample(["chunk", "layerwise"], 2):
        p = srv[name]
        cpu0 = cpu_s(decode)
        row[name], out = timed(lambda: pd_generate(p.url, srv["decode"].url, p.spec.bootstrap_port, body,
                                                   host=p.spec.host))
        row[f"decode_cpu_{name}"] = cpu_s(decode) - cpu0
        if out.get("output_ids") != ref.get("output_ids"):
            raise RuntimeError(f"{name} at {length} tokens: {out.get('output_ids')} != colocated {ref.get('output_ids')}")
    return row


def summarize(rows: list[dict[str, float]]) -> dict:
    out = {}
    for name in ("colocated", "chunk", "layerwise"):
        out[f"ttft_{name}_s"] = statistics.median(r[name] for r in rows)
    for name in ("chunk", "layerwise"):
        out[f"tail_{name}_s"] = statistics.median(r[name] - r["colocated"] for r in rows)
        out[f"decode_cpu_{name}_s"] = statistics.median(r[f"decode_cpu_{name}"] for r in rows)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="tiny-llama")
    ap.add_argument("--rates", default="50mbit,200mbit")
    ap.add_argument("--lengths", default="1024,4096,7936", help="tokens; the tiny models hold 8,192 positions")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--chunk", type=int, default=512)
    ap.add_argument("--layers-per-group", type=int, default=1)
    ap.add_argument("--out", default="out/bench_layerwise.json")
    ap.add_argument("--log-dir", default="out/bench_layerwise_logs")
    args = ap.parse_args()
    problem = netns.root_problem()
    if problem:
        raise SystemExit(f"bench_layerwise: {problem}")
    log_dir = Path(args.log_dir)
    log_dir.mkdir(parents=True, exist_ok=True)
    path = str(ensure(args.model))
    results = {"model": args.model, "chunk": args.chunk, "layers_per_group": args.layers_per_group,
               "load_before": os.getloadavg(), "rtt_emulated": False, "rows": []}
    with netns.emulated_link(args.rates.split(",")[0]) as link:
        srv = servers(args.model, link, args.chunk, args.layers_per_group, log_dir)
        try:
            for s in srv.values():
                s.start()
            for s in srv.values():
                s.wait_healthy(timeout_s=600)
            one_round(srv, path, 256, seed=1)  # warm-up: first-request costs out of the table
            for r, rate in enumerate(args.rates.split(",")):
                set_rate(link, rate)
                for length in map(int, args.lengths.split(",")):
                    rows = [one_round(srv, path, length, seed=100_000 * r + 1000 * length + k)
                            for k in range(args.reps)]
                    row = {"rate": rate, "tokens": length, "reps": args.reps, **summarize(rows), "raw": rows}
                    print(json.dumps({k: v for k, v in row.items() if k != "raw"}), flush=True)
                    results["rows"].append(row)
        finally:
            stop_together(list(srv.values()))
    results["load_after"] = os.getloadavg()
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(results, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
