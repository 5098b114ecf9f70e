"""The load generator's one config object; its argparse flags are generated from the fields.

Each field's ``metadata["help"]`` is the flag's help; ``--foo-bar`` maps to ``foo_bar``. Validation lives
in ``__post_init__`` (it builds the typed specs the library uses, each of which checks its own fields).
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from prfaas_sgl.cliargs import add_fields, build, knob
from prfaas_sgl.tools.loadgen.client import APIS, ClientSpec
from prfaas_sgl.tools.loadgen.runner import RunSpec
from prfaas_sgl.tools.loadgen.stats import Slo
from prfaas_sgl.tools.loadgen.workload import SyntheticSpec
from prfaas_sgl.router.names import ROUTE_HEADER
from prfaas_sgl.workload.arrivals import ArrivalSpec


@dataclass(frozen=True, slots=True)
class BenchConfig:
    # endpoint
    url: str = knob("http://127.0.0.1:30000", "server or router base URL (without /v1)")
    api: str = knob("completions", "OpenAI API to call", choices=APIS)
    model: str = knob("", "model name; empty: the first of GET /v1/models")
    request_timeout: float = knob(600.0, "per-request limit for the whole stream, seconds")
    include_usage: bool = knob(True, "ask for stream_options.include_usage (token counts from the server)")
    ignore_eos: bool = knob(True, "send ignore_eos so every request generates exactly its output length")
    route_header: str = knob(ROUTE_HEADER, "response header naming the route, for the per-route breakdown")
    # workload
    trace: str = knob("", "Mooncake-style JSONL trace to replay instead of a synthetic workload")
    trace_speedup: float = knob(1.0, "divide trace timestamps by this")
    num_sessions: int = knob(100, "synthetic sessions (each of --turns requests)")
    input_len: str = knob("paper", "input length: fixed:N | uniform:LO:HI | lognormal:MU:SIGMA:LO:HI | paper")
    output_len: str = knob("fixed:1024", "output length spec (same forms as --input-len)")
    scale: float = knob(1.0, "multiply every length and the block size by this (e.g. 0.015625 = 1/64)")
    turns: int = knob(1, "turns per session; later turns extend the previous prompt")
    followup_len: str = knob("fixed:256", "new user tokens per later turn (length spec)")
    think_time: float = knob(0.0, "seconds between a turn's end and the next turn")
    shared_prefix: int = knob(0, "tokens of system prompt shared within a prefix group (whole blocks)")
    prefix_groups: int = knob(1, "number of distinct shared prefixes; session i uses group i %% G")
    block_size: int = knob(512, "tokens per trace hash id (before --scale)")
    max_context: int = knob(131072, "multi-turn: end a session before its prompt passes this (before --scale)")
    tokenizer: str = knob("auto", "tokenizer.json path for exact prompt lengths; auto: <model>/tokenizer.json "
                          "if the model name is a local dir; none: ~1 token per word")
    seed: int = knob(0, "seed for lengths, arrivals and prompt text")
    # arrivals
    arrival: str = knob("poisson", "open-loop arrival process (ignored with --concurrency)",
                        choices=("poisson", "uniform", "bursty"))
    rate: float = knob(1.0, "mean session arrival rate, sessions/s")
    burst_on: float = knob(5.0, "bursty: mean ON period, seconds")
    burst_off: float = knob(5.0, "bursty: mean OFF period, seconds")
    concurrency: int = knob(0, "closed loop with this many concurrent sessions; 0: open loop")
    # run
    max_requests: int = knob(0, "stop sending after this many requests; 0: no cap")
    max_duration: float = knob(0.0, "stop sending after this many seconds; 0: no cap")
    drain_timeout: float = knob(60.0, "after --max-duration, seconds to let in-flight requests finish")
    warmup: int = knob(0, "warmup requests (private prompts, excluded from results)")
    progress: bool = knob(True, "show a progress bar")
    # results
    slo_ttft: float = knob(2.0, "goodput SLO: time to first token, seconds")
    slo_tpot: float = knob(0.025, "goodput SLO: time per output token, seconds (0.025 = 40 tok/s)")
    router_metrics: str = knob("", "router Prometheus URL (e.g. http://127.0.0.1:8000/metrics)")
    metrics_interval: float = knob(1.0, "seconds between router metrics scrapes")
    out_dir: str = knob("", "write results.json and PNG plots here; empty: print the table only")
    plots: bool = knob(True, "write PNG plots into --out-dir")

    def __post_init__(self) -> None:
        self.client_spec(), self.run_spec(), self.slo()
        if self.concurrency == 0:
            self.arrival_spec()
        if not self.trace:
            self.synthetic_spec()
        if self.trace_speedup <= 0 or self.metrics_interval <= 0:
            raise ValueError("--trace-speedup and --metrics-interval must be > 0")

    def client_spec(self) -> ClientSpec:
        return ClientSpec(self.url.rstrip("/"), self.api, self.model, self.request_timeout, self.include_usage,
                          self.ignore_eos, self.route_header)

    def run_spec(self) -> RunSpec:
        return RunSpec(self.concurrency, self.max_requests, self.max_duration, self.drain_timeout, self.warmup,
                       self.progress)

    def arrival_spec(self) -> ArrivalSpec | None:
        return None if self.concurrency else ArrivalSpec(self.arrival, self.rate, self.burst_on, self.burst_off)

    def synthetic_spec(self) -> SyntheticSpec:
        return SyntheticSpec(self.num_sessions, self.input_len, self.output_len, self.scale, self.turns,
                             self.followup_len, self.think_time, self.shared_prefix, self.prefix_groups,
                             self.block_size, self.max_context)

    def slo(self) -> Slo:
        return Slo(self.slo_ttft, self.slo_tpot)

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> BenchConfig:
        return build(cls, args)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """One flag per BenchConfig field, defaults and types taken from the dataclass."""
    add_fields(parser, BenchConfig, help_suffix=" (default: %(default)s)")
