"""Data-plane settings of one SGLang process: `TransferConfig` from the plugin's `PrfaasConfig`, and the
fault-injection environment variable (read here and nowhere else)."""
from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping

from prfaas_sgl.config import PrfaasConfig, flag, is_loopback
from prfaas_sgl.transfer import faults as F
from prfaas_sgl.transfer.config import TransferConfig

# Test hook, read when a server builds its sender (prefill) or receiver (decode): comma-separated
# faults, e.g. "corrupt_chunk=40" (sender) or "slow_receiver=0.01" (receiver).
FAULTS_ENV = "PRFAAS_ZMQ_FAULTS"
_FAULTS = {"corrupt_chunk": (F.CorruptChunk, int), "stamp_version": (F.StampVersion, int),
           "slow_receiver": (F.SlowReceiver, float)}


def transfer_config(cfg: PrfaasConfig) -> TransferConfig:
    return dataclasses.replace(cfg.transfer, keys_dir=cfg.zmq_curve_keys or None)


def insecure_problem(cfg: PrfaasConfig, host: str) -> str | None:
    """Why this server must not start (no keys on a routable `host`), or None. Without keys the data
    listener takes bytes from anyone and the prefill sends KV wherever an unauthenticated Register says."""
    if cfg.zmq_curve_keys or cfg.zmq_insecure or is_loopback(host):
        return None
    return (f"prfaas_zmq on routable address {host} without keys: create them with `prfaas keys DIR` and "
            f"start every server with {flag('zmq_curve_keys')} DIR, or pass {flag('zmq_insecure')} to accept "
            "plaintext, unauthenticated KV transfer on a trusted network")


def faults_from_env(environ: Mapping[str, str] = os.environ) -> tuple[F.Fault, ...]:
    """Parse FAULTS_ENV; raises ValueError naming the bad entry (a typo must not silently test nothing)."""
    out: list[F.Fault] = []
    for item in filter(None, (s.strip() for s in environ.get(FAULTS_ENV, "").split(","))):
        name, _, value = item.partition("=")
        if name not in _FAULTS or not value:
            raise ValueError(f"{FAULTS_ENV}: bad entry {item!r}; use NAME=VALUE with NAME in {sorted(_FAULTS)}")
        cls, typ = _FAULTS[name]
        out.append(cls(typ(value)))
    return tuple(out)


def offset_port(base: int, rank: int) -> int:
    """Port for scheduler rank `rank` when `base` is configured (0 = let the OS pick)."""
    return base + rank if base else 0
