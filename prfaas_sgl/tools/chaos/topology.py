"""The campaign's deployment: the remote prefill in a network namespace behind a `tc tbf` link, a local
prefill, two decodes (all prfaas_zmq), a colocated reference server (stopped before the load), and the
router as its own process.

    netns (remote DC)               host (local DC)
    remote_prefill  ==== link ====  decode_a, decode_b   (bind the link's host end: remote KV crosses it)
                                    local_prefill, router, colocated   (127.0.0.1)

Decodes run one request at a time (`--max-running-requests 1`, extra slots for transfers in flight):
batched CPU matmuls round differently from batch 1 and flip near-tie greedy tokens, so only batch-1
numerics make "wrong tokens" mean a real bug. The colocated reference runs batch 1 with the same chunked
prefill size. Servers are restarted on the same ports (the router's config is static).
"""
from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from prfaas_sgl.tools.launch import ManagedProcess, SGLangServer, ServerSpec, free_port, stop_together
from prfaas_sgl.tools.netns import BURST, Link

from .config import CampaignConfig

CONTEXT = 8192  # the tiny model's max_position_embeddings
PD_ROLES = ("remote_prefill", "local_prefill", "decode_a", "decode_b")
ZERO_RATE = "8bit"


def _zmq_args(cfg: CampaignConfig, keys_dir: str | None) -> tuple[str, ...]:
    args = ("--prfaas-zmq-timeout-s", str(cfg.zmq_timeout_s), "--prfaas-zmq-chunk-bytes", str(cfg.zmq_chunk_bytes))
    return args + (("--prfaas-zmq-curve-keys", keys_dir) if keys_dir else ())


def server_specs(cfg: CampaignConfig, link: Link, model: str, log_dir: Path,
                 keys_dir: str | None) -> dict[str, ServerSpec]:
    zmq = _zmq_args(cfg, keys_dir)

    def one(name: str, host: str, mode: str, role: str, **kw) -> ServerSpec:
        pd = dict(transfer_backend="prfaas_zmq") if mode != "colocated" else {}
        # --sleep-on-idle: an idle scheduler otherwise spins (~15% of a core each on 2 cores, 4-5 servers)
        extra = (("--sleep-on-idle",) + (zmq + ("--prfaas-role", role) if mode != "colocated" else ())
                 + kw.pop("extra", ()))
        return ServerSpec(model_path=model, port=free_port(), host=host, mode=mode, log_path=str(log_dir / f"{name}.log"),
                          extra_args=extra, **pd, **kw)

    prefill = dict(chunked_prefill_size=cfg.chunked_prefill)
    decode = dict(max_running_requests=1, extra=("--disaggregation-decode-extra-slots", str(cfg.decode_extra_slots)))
    return {
        "remote_prefill": one("remote_prefill", link.remote_ip, "prefill", "remote", netns=link.netns,
                              bootstrap_port=free_port(), **prefill),
        "local_prefill": one("local_prefill", "127.0.0.1", "prefill", "local", bootstrap_port=free_port(), **prefill),
        "decode_a": one("decode_a", link.local_ip, "decode", "local", **decode),
        "decode_b": one("decode_b", link.local_ip, "decode", "local", **decode),
        "colocated": one("colocated", "127.0.0.1", "colocated", "none", max_running_requests=1, **prefill),
    }


def router_config(cfg: CampaignConfig, specs: dict[str, ServerSpec], model: str, port: int) -> dict:
    """The router's --config JSON: threshold policy, so a prompt's length alone picks its route."""
    def inst(name: str) -> dict:
        s = specs[name]
        return {"url": s.url, "name": name, **({"bootstrap_port": s.bootstrap_port} if s.bootstrap_port else {})}

    return {
        "host": "127.0.0.1", "port": port, "prfaas": [inst("remote_prefill")], "local_prefill": [inst("local_prefill")],
        "decode": [inst("decode_a"), inst("decode_b")], "tokenizer_path": model, "context_length": CONTEXT,
        "policy": "threshold", "threshold": cfg.threshold, "block_size": 1,
        "request_timeout_s": cfg.request_timeout_s, "prefill_timeout_s": cfg.request_timeout_s,
        "connect_timeout_s": cfg.connect_timeout_s, "health_interval_s": cfg.health_interval_s,
    }


def start_router(cfg: CampaignConfig, specs: dict[str, ServerSpec], model: str, log_dir: Path) -> ManagedProcess:
    port = free_port()
    path = log_dir / "router.json"
    path.write_text(json.dumps(router_config(cfg, specs, model, port), indent=1))
    cmd = [sys.executable, "-m", "prfaas_sgl.launch_router", "--config", str(path)]
    return ManagedProcess(cmd, dict(os.environ), str(log_dir / "router.log"), f"http://127.0.0.1:{port}").start()


@dataclass
class Fleet:
    """The live servers; `restart` replaces a killed incarnation with a new one on the same spec."""

    specs: dict[str, ServerSpec]
    servers: dict[str, SGLangServer]
    restarts: dict[str, int]

    @classmethod
    def start(cls, specs: dict[str, ServerSpec]) -> "Fleet":
        return cls(specs, {n: SGLangServer(s).start() for n, s in specs.items()}, {n: 0 for n in specs})

    def restart(self, name: str) -> SGLangServer:
        self.restarts[name] += 1
        spec = self.specs[name]
        log = Path(spec.log_path).with_suffix(f".r{self.restarts[name]}.log")
        srv = SGLangServer(dataclasses.replace(spec, log_path=str(log)))
        self.servers[name] = srv.start()
        return srv

    def stop(self, name: str) -> None:
        self.servers[name].stop(grace_s=3.0)

    def stop_all(self) -> None:
        stop_together(list(self.servers.values()), grace_s=3.0)


def set_link_rate(link: Link, rate: str) -> None:
    """Both ends of the veth pair. At rate ~0 the bucket (123 B) is smaller than any data packet, so the
    link carries nothing: the kernel has no netem here, and this keeps the link up (no route changes)."""
    burst = BURST if rate != ZERO_RATE else "2kb"
    tbf = ["root", "tbf", "rate", rate, "burst", burst, "latency", "50ms"]
    subprocess.run(["tc", "qdisc", "change", "dev", link.local_dev, *tbf], check=True, capture_output=True)
    subprocess.run([*link.exec_prefix, "tc", "qdisc", "change", "dev", link.remote_dev, *tbf], check=True,
                   capture_output=True)

