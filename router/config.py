"""Router configuration: one frozen dataclass; argparse and the TOML/JSON file reader derive from it.

Precedence: dataclass defaults < config file (``--config``) < command-line flags. Field metadata carries
the help text; every validation message names the flag to change.
"""

from __future__ import annotations

import argparse
import dataclasses
import ipaddress
import json
import os
import re
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, get_args, get_origin

from prfaas_sgl.cliargs import add_fields, dest_names

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


def _f(default: Any, help: str, secret: bool = False) -> Any:
    return field(default=default, metadata={"help": help}, repr=not secret)


ADMIN_TOKEN_ENV = "PRFAAS_ROUTER_ADMIN_TOKEN"  # the admin token's usual source: argv is visible in `ps`
SUPERVISOR_TOKEN_ENV = "PRFAAS_SUPERVISOR_TOKEN"  # the same value on the router's machine and every supervisor's
ACTUATORS = ("none", "supervisor")
BODY_BYTES_PER_TOKEN = 16  # generous JSON bytes per context token: \uXXXX escapes, token-id lists
BODY_SLACK = 1 << 20  # bytes on top: field names, sampling params, tool definitions
BODIES_IN_FLIGHT = 32  # default body budget, in largest bodies: 48 MiB at the default 32K context


@dataclass(frozen=True, slots=True)
class RouterConfig:
    host: str = _f("127.0.0.1", "address to listen on")
    port: int = _f(8000, "port to listen on (0 = pick a free one)")
    prfaas: tuple[InstanceSpec, ...] = _f((), "PrfaaS (remote) prefill server spec, repeatable")
    local_prefill: tuple[InstanceSpec, ...] = _f((), "local prefill server spec, repeatable")
    decode: tuple[InstanceSpec, ...] = _f((), "local decode server spec, repeatable")
    tokenizer_path: str = _f("", "directory with tokenizer.json and tokenizer_config.json (chat_template)")
    served_model_name: str = _f("", "model name clients must send (default: tokenizer directory name)")
    context_length: int = _f(32768, "max prompt + output tokens; longer requests get HTTP 400")
    max_body_bytes: int = _f(0, f"largest request body; larger ones get HTTP 413 unread (0 = context_length x "
                             f"{BODY_BYTES_PER_TOKEN} + {BODY_SLACK >> 20} MiB)")
    max_chars_per_token: int = _f(16, "a prompt string longer than context_length x this many characters gets "
                                  "HTTP 400 before it is tokenized")
    admin_token: str = _f("", f"bearer token for /admin/* (or env {ADMIN_TOKEN_ENV}); without one, /admin/* "
                          "answers only when --host is a loopback address", secret=True)
    policy: str = _f("bandwidth_aware", f"routing policy: {', '.join(POLICIES)}")
    # The policy's tunables: one flag per PolicyParams field (--threshold, ..., --link-budget-s for budget_s).
    policy_params: PolicyParams = field(default_factory=PolicyParams)
    decode_affinity_slack: int = _f(-1, "decode servers cache prefixes (prfaas_hybrid / SGLang decode radix "
                                    "cache): prefer the one holding the prompt's longest prefix unless it runs "
                                    "more than this many requests beyond the least-loaded decode; -1 = off")
    block_size: int = _f(64, "prefix-hash block size in tokens (= SGLang --page-size)")
    prefix_capacity_tokens: int = _f(1 << 20, "modelled prefix-cache capacity per instance (tokens)")
    model_path: str = _f("", "model directory (config.json): --kv-bytes-per-token and --state-bytes default to "
                         "what its layers move (router/kv_accounting.py); those flags still override")
    kv_bytes_per_token: float = _f(17_100.0, "full-attention KV bytes per token (link accounting)")
    state_bytes: float = _f(180e6, "fixed per-request state bytes (linear/SWA states + aux)")
    local_prefill_coef: tuple[float, ...] = _f((0.468, 1.3e-4, 2.98e-10), "local prefill s = a + b*l + c*l^2")
    remote_prefill_coef: tuple[float, ...] = _f((0.35, 5.4e-5, 1.5e-10), "remote prefill s = a + b*l + c*l^2")
    link_gbps: float = _f(100.0, "inter-datacenter link capacity PrfaaS -> decode (Gbit/s)")
    transport_stats_url: str = _f(
        "", "remote prefills' prfaas_zmq stats endpoints (http://HOST:PORT/stats), comma-separated; summed as the link")
    loads_interval_s: float = _f(0.5, "seconds between GET /v1/loads polls")
    health_interval_s: float = _f(2.0, "seconds between GET /health probes")
    health_timeout_s: float = _f(10.0, "a /health probe slower than this fails (SGLang answers in 1-2 s under load)")
    unhealthy_after: int = _f(3, "consecutive failed /health probes before an instance leaves rotation")
    connect_timeout_s: float = _f(3.0, "TCP connect timeout to servers (s)")
    prefill_timeout_s: float = _f(300.0, "max seconds for a prefill server to answer")
    request_timeout_s: float = _f(600.0, "max seconds for a whole request")
    max_concurrent_requests: int = _f(2048, "generation requests the router handles at once; more get HTTP 503 "
                                      "with Retry-After")
    max_body_bytes_in_flight: int = _f(0, "request body bytes being read and parsed at once; a request waits for "
                                       "room (within --body-timeout-s), then gets HTTP 503 (0 = "
                                       f"{BODIES_IN_FLIGHT} x the largest body)")
    body_timeout_s: float = _f(60.0, "seconds for a request body to arrive (and wait for room); HTTP 408 after")
    breaker_failures: int = _f(5, "consecutive failed attempts through one server (its prefill's KV never reached "
                               "decode, or its decode answered 5xx) before it leaves rotation for "
                               "--breaker-cooldown-s (0 = never)")
    breaker_cooldown_s: float = _f(30.0, "seconds a server stays out after its breaker opens; then one trial "
                                   "request decides whether it serves again")
    controller: str = _f("none", "long-term controller: none or planner (router/controller.py)")
    controller_interval_s: float = _f(60.0, "seconds between controller updates")
    controller_scenario: str = _f("", "planner scenario TOML describing the deployment (--controller planner)")
    actuator: str = _f("none", "what acts on the controller's recommended split: none, or supervisor (the "
                       "supervisors `prfaas up` keeps, see --supervisor-urls; needs --controller planner)")
    supervisor_urls: str = _f("", "SERVER=http://HOST:PORT pairs, comma-separated: the supervisor owning each local "
                              "server (`prfaas up` derives them from the deployment's [supervisor] port)")
    supervisor_token: str = _f("", f"key the router signs supervisor requests with, >= 32 bytes, or http://HOST:PORT=TOKEN pairs per "
                                    f"machine (or env {SUPERVISOR_TOKEN_ENV})", secret=True)
    switch_confirm: int = _f(2, "recommendations in the same direction before a server switches role")
    switch_dwell_s: float = _f(600.0, "seconds after a role switch before the next one may start")
    log_level: str = _f("info", "python logging level")

    def __post_init__(self) -> None:
        for name in ("prfaas", "local_prefill", "decode"):
            specs = tuple(InstanceSpec.coerce(s) for s in getattr(self, name))
            specs = tuple(dataclasses.replace(s, name=s.name or f"{name}{i}") for i, s in enumerate(specs))
            object.__setattr__(self, name, specs)
        for name in ("local_prefill_coef", "remote_prefill_coef"):
            object.__setattr__(self, name, tuple(float(x) for x in getattr(self, name)))
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
        for name in ("block_size", "context_length", "max_chars_per_token", "prefix_capacity_tokens", "kv_bytes_per_token",
                     "link_gbps", "loads_interval_s", "health_interval_s", "connect_timeout_s",
                     "prefill_timeout_s", "request_timeout_s", "controller_interval_s", "max_concurrent_requests",
                     "body_timeout_s", "breaker_cooldown_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"--{name.replace('_', '-')} must be > 0")
        if self.max_body_bytes < 0 or self.max_body_bytes_in_flight < 0:
            raise ValueError("--max-body-bytes and --max-body-bytes-in-flight must be >= 0 (0 = derived)")
        if self.breaker_failures < 0:
            raise ValueError("--breaker-failures must be >= 0 (0 = the breaker never opens)")
        if self.decode_affinity_slack < -1:
            raise ValueError("--decode-affinity-slack must be >= 0 requests, or -1 (off)")
        for name in ("local_prefill_coef", "remote_prefill_coef"):
            if len(getattr(self, name)) != 3:
                raise ValueError(f"--{name.replace('_', '-')} takes three numbers a b c")

    def _check_actuator(self) -> None:
        if self.actuator not in ACTUATORS:
            raise ValueError(f"--actuator must be one of {ACTUATORS}, got {self.actuator!r}")
        if self.switch_confirm < 1 or self.switch_dwell_s < 0:
            raise ValueError("--switch-confirm must be >= 1 and --switch-dwell-s >= 0 seconds")
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
        [router] table spell them. Policy keys go into ``policy_params``; errors name the flag to change."""
        keys = _policy_keys()
        policy = {name: values.pop(key) for name, key in keys.items() if key in values}
        try:
            params = PolicyParams(**policy)
        except ValueError as e:
            raise ValueError(_flag_words(str(e))) from None
        return cls(**values, policy_params=params)

    @property
    def model_name(self) -> str:
        return self.served_model_name or Path(self.tokenizer_path).resolve().name

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


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name: it may resolve to anything
        return False


# ---------------------------------------------------------------- argparse / file


# PolicyParams fields whose router flag / --config key has another name (the flag predates the nesting).
POLICY_KEYS = {"budget_s": "link_budget_s"}


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
    add_fields(p, RouterConfig, rename=POLICY_KEYS, default=argparse.SUPPRESS, by_type=_flag_kwargs)
    return p


def _policy_keys() -> dict[str, str]:
    """PolicyParams field -> its router flag's dest (= --config key)."""
    return {f.name: POLICY_KEYS.get(f.name, f.name) for f in dataclasses.fields(PolicyParams)}


def _flag_words(message: str) -> str:
    """``message`` with PolicyParams field names spelled as the router flags that set them."""
    for name, key in _policy_keys().items():
        message = re.sub(rf"(?<![\w-]){name}(?!\w)", "--" + key.replace("_", "-"), message)
    return message


def load_file(path: str) -> dict[str, Any]:
    raw = Path(path).read_bytes()
    data = tomllib.loads(raw.decode()) if path.endswith(".toml") else json.loads(raw)
    unknown = set(data) - set(dest_names(RouterConfig, rename=POLICY_KEYS))
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


def model_costs(model_path: str) -> dict[str, float]:
    """`kv_bytes_per_token` and `state_bytes` of the model at `model_path` (KV in its config's dtype)."""
    acct = account_path(model_path)
    return {"kv_bytes_per_token": float(acct.kv_bytes_per_token), "state_bytes": float(acct.fixed_bytes)}
