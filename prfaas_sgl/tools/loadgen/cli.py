"""``prfaas bench``: run a load test and report.

Hook into the ``prfaas`` CLI with ``add_parser(subparsers)``; ``run(args)`` returns the exit code
(0 ok, 1 when every measured request failed, 2 on a
configuration, trace or connection-setup error). ``main()`` is the standalone entry (scripts/loadgen.py).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import sys
from pathlib import Path

from prfaas_sgl.tools.loadgen.client import OpenAIClient
from prfaas_sgl.tools.loadgen.config import BenchConfig, add_arguments
from prfaas_sgl.tools.loadgen.prom import MetricsSampler
from prfaas_sgl.tools.loadgen.prompts import PromptBuilder, resolve_tokenizer
from prfaas_sgl.tools.loadgen.report import build_results, format_table, write_json
from prfaas_sgl.tools.loadgen.runner import Runner
from prfaas_sgl.tools.loadgen.workload import Workload, from_trace, synthesize
from prfaas_sgl.workload.traces import read_trace

DESCRIPTION = "Load-test an OpenAI-compatible endpoint (router or plain SGLang server)."


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("bench", help=DESCRIPTION, description=DESCRIPTION)
    add_arguments(p)
    p.set_defaults(func=run)
    return p


def build_workload(cfg: BenchConfig) -> Workload:
    if cfg.trace:
        return from_trace(read_trace(cfg.trace), cfg.block_size, cfg.scale, cfg.trace_speedup)
    return synthesize(cfg.synthetic_spec(), cfg.arrival_spec(), cfg.seed)


async def bench(cfg: BenchConfig) -> dict:
    """Run the configured load test; returns the results document (see report.py)."""
    workload = build_workload(cfg)
    sampler = MetricsSampler(cfg.router_metrics, interval_s=cfg.metrics_interval) if cfg.router_metrics else None
    client = OpenAIClient(cfg.client_spec())
    await client.start()  # resolves the model name, which "--tokenizer auto" needs
    try:
        tokenizer = resolve_tokenizer(cfg.tokenizer, client.spec.model)
        builder = PromptBuilder(cfg.seed, workload.block_size, tokenizer)
        result = await Runner(client, builder, workload, cfg.run_spec(), sampler).run()
    finally:
        await client.close()
    config = dataclasses.asdict(cfg) | {"resolved_model": client.spec.model, "resolved_tokenizer": tokenizer}
    return build_results(result, cfg.slo(), config)


def run(args: argparse.Namespace) -> int:
    try:
        cfg = BenchConfig.from_args(args)
        results = asyncio.run(bench(cfg))
    except (ValueError, RuntimeError, OSError) as e:  # config, trace, tokenizer, model lookup: say what to change
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(format_table(results))
    if cfg.out_dir:
        write_json(Path(cfg.out_dir) / "results.json", results)
        written = [Path(cfg.out_dir) / "results.json"]
        if cfg.plots:
            from prfaas_sgl.tools.loadgen.plots import write_plots

            written += write_plots(results, cfg.out_dir)
        print("wrote " + ", ".join(str(p) for p in written))
    s = results["summary"]
    return 1 if s["requests"] and s["ok"] == 0 else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="loadgen", description=DESCRIPTION)
    add_arguments(parser)
    return run(parser.parse_args(argv))
