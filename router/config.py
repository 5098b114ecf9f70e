"""Router configuration: one frozen dataclass; argparse and the TOML/JSON file reader derive from it.

Precedence: dataclass defaults < config file (``--config``) < command-line flags. Field metadata carries
the help text; every validation message names the flag to change.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, get_args, get_origin

from prfaas_sgl.cliargs import add_fields, build, dest_names, knob, nested, same_names
from prfaas_sgl.config import is_loopback

from .actuators.decide import DecideConfig
from .controller import ControllerConfig
from .cost import STREAMING_FLAGS, ModelCost, Streaming
from .kv_accounting import account_path
from .policy import POLICIES, PolicyParams


@dataclass(frozen=True, slots=True)
class InstanceSpec:
    """One SGLang server. Flag form: ``URL[;bootstrap=PORT][;kv_events=tcp://H:P][;name=N]``."""

    url: str
    bootstrap_port: int | None = None  # prefill servers only (SGLang default 8998)
    kv_events: str | None = None  # ZMQ PUB endpoint of --kv-events-config, e.g. tcp://10.0.0.1:5557
    name: str = ""

    @classmethod
    def parse(cls, text: str) -> "InstanceSpec":
        url, *opts = text.split(";")
        kw: dict[str, Any] = {}
        for opt in opts:
            key, _, val = opt.partition("=")
            if key not in ("bootstrap", "kv_events", "name"):
                raise ValueError(f"instance spec {text!r}: unknown option {key!r} (bootstrap, kv_events, name)")
            kw["bootstrap_port" if key == "bootstrap" else key] = int(val) if key == "bootstrap" else val
        return cls(url=url, **kw)

    @classmethod
    def coerce(cls, obj: Any) -> "InstanceSpec":
        if isinstance(obj, InstanceSpec):
            return obj
        if isinstance(obj, str):
            return cls.parse(obj)
        return cls(**obj)


ADMIN_TOKEN_ENV = "PRFAAS_ROUTER_ADMIN_TOKEN"  # the admin token's usual source: argv is visible in `ps`
SUPERVISOR_TOKEN_ENV = "PRFAAS_SUPERVISOR_TOKEN"  # the same value on the router's machine and every supervisor's
ACTUATORS = ("none", "supervisor")
BODY_BYTES_PER_TOKEN = 16  # generous JSON bytes per context token: \uXXXX escapes, token-id lists
BODY_SLACK = 1 << 20  # bytes on top: field names, sampling params, tool definitions
BODIES_IN_FLIGHT = 32  # default body budget, in largest bodies: 48 MiB at the default 32K context
# The paper's case study (H20 fits, Kimi-Linear-like KV); --model-path derives the two byte counts instead.
CASE_STUDY_COST = ModelCost(17_100.0, 180e6, (0.468, 1.3e-4, 2.98e-10), (0.35, 5.4e-5, 1.5e-10))


@dataclass(frozen=True, slots=True)
class RouterConfig:
    host: str = knob("127.0.0.1", "address to listen on")
    port: int = knob(8000, "port to listen on (0 = pick a free one)")
    prfaas: tuple[InstanceSpec, ...] = knob((), "PrfaaS (remote) prefill server spec, repeatable")
    local_prefill: tuple[InstanceSpec, ...] = knob((), "local prefill server spec, repeatable")
    decode: tuple[InstanceSpec, ...] = knob((), "local decode server spec, repeatable")
    tokenizer_path: str = knob("", "directory with tokenizer.json and tokenizer_config.json (chat_template)")
    served_model_name: str = knob("", "model name clients must send (default: tokenizer directory name)")
    context_length: int = knob(32768, "max prompt + output tokens; longer requests get HTTP 400")
    max_body_bytes: int = knob(0, f"largest request body; larger ones get HTTP 413 unread (0 = context_length x "
                               f"{BODY_BYTES_PER_TOKEN} + {BODY_SLACK >> 20} MiB)")
    max_chars_per_token: int = knob(16, "a prompt string longer than context_length x this many characters gets "
                                    "HTTP 400 before it is tokenized")
    admin_token: str = knob("", f"bearer token for /admin/* (or env {ADMIN_TOKEN_ENV}); without one, /admin/* "
                            "answers only when --host is a loopback address", secret=True)
    policy: str = knob("bandwidth_aware", f"routing policy: {', '.join(POLICIES)}")
    # The policy's tunables: one flag per PolicyParams field (--threshold, ..., --link-budget-s for budget_s).
    policy_params: PolicyParams = nested(PolicyParams(), same_names(PolicyParams, budget_s="link_budget_s"))
    decode_affinity_slack: int = knob(-1, "decode servers cache prefixes (prfaas_hybrid / SGLang decode radix "
                                      "cache): prefer the one holding the prompt's longest prefix unless it runs "
                                      "more than this many requests beyond the least-loaded decode; -1 = off")
    block_size: int = knob(64, "prefix-hash block size in tokens (= SGLang --page-size)")
    prefix_capacity_tokens: int = knob(1 << 20, "modelled prefix-cache capacity per instance (tokens)")
    store_instances: str = knob("", "prefill servers (names, comma-separated) sharing one store tier that they "
                                "write what they compute through to and load prefixes from (router/crossfetch.py)")
    store_capacity_tokens: int = knob(1 << 24, "modelled capacity of that shared store (tokens)")
    # its layer count also gives --attention-layers its default (model_costs)
    model_path: str = knob("", "model directory (config.json): --kv-bytes-per-token and --state-bytes default to "
                           "what its layers move (router/kv_accounting.py); those flags still override")
    cost: ModelCost = nested(CASE_STUDY_COST, {
        "kv_bytes_per_token": "kv_bytes_per_token", "state_bytes": "state_bytes",
        "local_coef": "local_prefill_coef", "remote_coef": "remote_prefill_coef"})
    # how the PrfaaS prefills stream KV, in their own settings: what of a remote request's KV still has to
    # cross the link after its last forward (the router's remote-route estimate; see model_cost)
    kv_stream: Streaming = nested(Streaming(), STREAMING_FLAGS)
    link_gbps: float = knob(100.0, "inter-datacenter link capacity PrfaaS -> decode (Gbit/s)")
    transport_stats_url: str = knob(
        "", "remote prefills' prfaas_zmq stats endpoints (http://HOST:PORT/stats), comma-separated; summed as the link")
    loads_interval_s: float = knob(0.5, "seconds between GET /v1/loads polls")
    health_interval_s: float = knob(2.0, "seconds between GET /health probes")
    health_timeout_s: float = knob(10.0, "a /health probe slower than this fails (SGLang answers in 1-2 s under load)")
    unhealthy_after: int = knob(3, "consecutive failed /health probes before an instance leaves rotation")
    connect_timeout_s: float = knob(3.0, "TCP connect timeout to servers (s)")
    prefill_timeout_s: float = knob(300.0, "max seconds for a prefill server to answer")
    request_timeout_s: float = knob(600.0, "max seconds for a whole request")
    max_concurrent_requests: int = knob(2048, "generation requests the router handles at once; more get HTTP 503 "
                                        "with Retry-After")
    max_body_bytes_in_flight: int = knob(0, "request body bytes being read and parsed at once; a request waits for "
                                         "room (within --body-timeout-s), then gets HTTP 503 (0 = "
                                         f"{BODIES_IN_FLIGHT} x the largest body)")
    body_timeout_s: float = knob(60.0, "seconds for a request body to arrive (and wait for room); HTTP 408 after")
    breaker_failures: int = knob(5, "consecutive failed attempts through one server (its prefill's KV never reached "
                                 "decode, or its decode answered 5xx) before it leaves rotation for "
                                 "--breaker-cooldown-s (0 = never)")
    breaker_cooldown_s: float = knob(30.0, "seconds a server stays out after its breaker opens; then one trial "
                                     "request decides whether it serves again")
    controller: str = knob("none", "long-term controller: none or planner (router/controller.py)")
    controller_params: ControllerConfig = nested(ControllerConfig(), {"interval_s": "controller_interval_s"})
    controller_scenario: str = knob("", "planner scenario TOML describing the deployment (--controller planner)")
    actuator: str = knob("none", "what acts on the controller's recommended split: none, or supervisor (the "
                         "supervisors `prfaas up` keeps, see --supervisor-urls; needs --controller planner)")
    supervisor_urls: str = knob("", "SERVER=http://HOST:PORT pairs, comma-separated: the supervisor owning each local "
                                "server (`prfaas up` derives them from the deployment's [supervisor] port)")
    supervisor_token: str = knob("", "key the router signs supervisor requests with, >= 32 bytes, or "
                                 f"http://HOST:PORT=TOKEN pairs per machine (or env {SUPERVISOR_TOKEN_ENV})",
                                 secret=True)
    switch_params: DecideConfig = nested(DecideConfig(), {"confirm": "switch_confirm", "dwell_s": "switch_dwell_s"})
    log_level: str = knob("info", "python logging level")

    def __post_init__(self) -> None:
        for name in ("prfaas", "local_prefill", "decode"):
            specs = tuple(InstanceSpec.coerce(s) for s in getattr(self, name))
            specs = tuple(dataclasses.replace(s, name=s.name or f"{name}{i}") for i, s in enumerate(specs))
            object.__setattr__(self, name, specs)
        self._validate()

    def _validate(self) -> None:
        if not self.decode:
            raise ValueError("--decode: at least one decode server is required")
        if not (self.prfaas or self.local_prefill):
            raise ValueError("--prfaas / --local-prefill: at least one prefill server is required")
        for s in self.prfaas + self.local_prefill:
            if s.bootstrap_port is None:
                raise ValueError(f"--prfaas/--local-prefill {s.url}: add ';bootstrap=PORT' (SGLang default 8998)")
        names = [s.name for s in self.prfaas + self.local_prefill + self.decode]
        if len(set(names)) != len(names):
            raise ValueError(f"instance names must be unique, got {names}; set ';name=...'")
        if not self.tokenizer_path or not (Path(self.tokenizer_path) / "tokenizer.json").is_file():
            raise ValueError(f"--tokenizer-path {self.tokenizer_path!r}: need a directory with tokenizer.json")
        if self.policy not in POLICIES:
            raise ValueError(f"--policy {self.policy!r}: choose one of {sorted(POLICIES)}")
        if self.controller not in ("none", "planner"):
            raise ValueError("--controller must be none or planner")
        if self.controller == "planner" and not Path(self.controller_scenario).is_file():
            raise ValueError("--controller planner needs --controller-scenario PATH (a planner scenario TOML)")
        self._check_actuator()
        self._check_store()
        for name in ("block_size", "context_length", "max_chars_per_token", "prefix_capacity_tokens", "link_gbps",
                     "loads_interval_s", "health_interval_s", "connect_timeout_s", "prefill_timeout_s",
                     "request_timeout_s", "max_concurrent_requests", "body_timeout_s", "breaker_cooldown_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"--{name.replace('_', '-')} must be > 0")
        if self.max_body_bytes < 0 or self.max_body_bytes_in_flight < 0:
            raise ValueError("--max-body-bytes and --max-body-bytes-in-flight must be >= 0 (0 = derived)")
        if self.breaker_failures < 0:
            raise ValueError("--breaker-failures must be >= 0 (0 = the breaker never opens)")
        if self.decode_affinity_slack < -1:
            raise ValueError("--decode-affinity-slack must be >= 0 requests, or -1 (off)")

    def _check_store(self) -> None:
        prefills = {s.name for s in self.prfaas + self.local_prefill}
        members = {n.strip() for n in self.store_instances.split(",") if n.strip()}
        if members - prefills:
            raise ValueError(f"--store-instances {sorted(members - prefills)}: not prefill servers "
                             f"(these are: {sorted(prefills)})")
        if self.store_capacity_tokens <= 0:
            raise ValueError("--store-capacity-tokens must be > 0")

    def _check_actuator(self) -> None:
        if self.actuator not in ACTUATORS:
            raise ValueError(f"--actuator must be one of {ACTUATORS}, got {self.actuator!r}")
        urls = parse_supervisor_urls(self.supervisor_urls)
        if self.actuator == "supervisor":
            if self.controller == "none":
                raise ValueError("--actuator supervisor acts on the controller's split: add --controller planner")
            local = {s.name for s in self.local_prefill + self.decode}
            if not urls or set(urls) - local:
                raise ValueError(f"--actuator supervisor needs --supervisor-urls naming local servers {sorted(local)}, "
                                 f"got {sorted(urls)}")

    @classmethod
    def from_flags(cls, **values: Any) -> "RouterConfig":
        """A config from flat keys: the flags' names in snake_case, as a ``--config`` file and a deployment's
        [router] table spell them. A sub-config's keys go into it; errors name the flag to change."""
        unknown = set(values) - set(dest_names(cls))
        if unknown:
            raise TypeError(f"RouterConfig: unknown keys {sorted(unknown)}")
        return build(cls, values)

    @property
    def model_name(self) -> str:
        return self.served_model_name or Path(self.tokenizer_path).resolve().name

    @property
    def model_cost(self) -> ModelCost:
        """The cost model the router prices routes with: ``cost`` streaming as ``kv_stream`` says."""
        return dataclasses.replace(self.cost, streaming=self.kv_stream)

    @property
    def body_limit(self) -> int:
        """Largest request body in bytes (``--max-body-bytes``, or derived from the context length)."""
        return self.max_body_bytes or self.context_length * BODY_BYTES_PER_TOKEN + BODY_SLACK

    @property
    def body_budget(self) -> int:
        """Bytes of request bodies read and parsed at once (``--max-body-bytes-in-flight``, or derived)."""
        return self.max_body_bytes_in_flight or BODIES_IN_FLIGHT * self.body_limit

    @property
    def admin_open(self) -> bool:
        """Whether /admin/* answers without a token: only on a loopback listener, where the host is the boundary."""
        return not self.admin_token and is_loopback(self.host)


# ---------------------------------------------------------------- argparse / file


def _flag_kwargs(hint: Any) -> dict[str, Any] | None:
    if get_origin(hint) is tuple and get_args(hint)[0] is InstanceSpec:
        return {"action": "append", "type": InstanceSpec.parse}
    if get_origin(hint) is tuple:
        return {"nargs": 3, "type": float}
    if get_origin(hint) is Literal:
        return {"type": str}
    return None


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="prfaas-router", description="PrfaaS router in front of SGLang servers")
    p.add_argument("--config", default=None, help="TOML or JSON file with the same keys as the flags (snake_case)")
    add_fields(p, RouterConfig, default=argparse.SUPPRESS, by_type=_flag_kwargs)
    return p


def load_file(path: str) -> dict[str, Any]:
    raw = Path(path).read_bytes()
    data = tomllib.loads(raw.decode()) if path.endswith(".toml") else json.loads(raw)
    unknown = set(data) - set(dest_names(RouterConfig))
    if unknown:
        raise ValueError(f"--config {path}: unknown keys {sorted(unknown)}")
    return data


def parse_config(argv: list[str] | None = None) -> RouterConfig:
    ns = vars(build_parser().parse_args(argv))
    path = ns.pop("config", None)
    merged = load_file(path) if path else {}
    merged.update(ns)
    if merged.get("model_path"):  # model-derived link accounting under any explicit value
        merged = {**model_costs(merged["model_path"]), **merged}
    if not merged.get("admin_token") and os.environ.get(ADMIN_TOKEN_ENV):
        merged["admin_token"] = os.environ[ADMIN_TOKEN_ENV]
    if not merged.get("supervisor_token") and os.environ.get(SUPERVISOR_TOKEN_ENV):
        merged["supervisor_token"] = os.environ[SUPERVISOR_TOKEN_ENV]
    return RouterConfig.from_flags(**merged)


def parse_supervisor_urls(text: str) -> dict[str, str]:
    """``--supervisor-urls``: ``SERVER=URL`` pairs, comma-separated (the supervisor owning each server)."""
    out: dict[str, str] = {}
    for item in filter(None, (x.strip() for x in text.split(","))):
        name, sep, url = item.partition("=")
        if not sep or not name.strip() or not url.strip().startswith(("http://", "https://")):
            raise ValueError(f"--supervisor-urls: expected SERVER=http://HOST:PORT, got {item!r}")
        out[name.strip()] = url.strip().rstrip("/")
    return out


def model_costs(model_path: str) -> dict[str, float | int]:
    """`kv_bytes_per_token`, `state_bytes` and `attention_layers` (the layers layer-wise streaming groups) of
    the model at `model_path` (KV in its config's dtype)."""
    acct = account_path(model_path)
    return {"kv_bytes_per_token": float(acct.kv_bytes_per_token), "state_bytes": float(acct.fixed_bytes),
            "attention_layers": acct.kv_layers}
