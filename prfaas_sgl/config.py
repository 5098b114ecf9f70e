"""The plugin's one frozen config per SGLang process, and the `--prfaas-*` flags generated from it.

No sglang import here: the flags are added to SGLang's parser by `prfaas_sgl.srt.flags`, and the parsed values travel
into SGLang's subprocesses as one `PrfaasConfig` stored on the (pickled) server-args record.
"""
from __future__ import annotations

import argparse
import ipaddress
import os
from dataclasses import dataclass

from prfaas_sgl.cliargs import add_fields, build, knob, nested
from prfaas_sgl.transfer.config import LayerwiseConfig, OptimisticConfig, TransferConfig

ROLES = ("none", "remote", "local")


@dataclass(frozen=True)
class PrfaasConfig:
    """Per-server prfaas settings. Units in names: bytes, seconds."""

    role: str = knob("none", "Which datacenter this server belongs to: 'remote' (PrfaaS prefill cluster), 'local' "
                     "(PD cluster), or 'none'. Labels telemetry; the router decides routing.", choices=ROLES)
    # The data plane's knobs, declared (with their defaults and checks) in TransferConfig.
    transfer: TransferConfig = nested(TransferConfig(), {
        "connections": "zmq_connections", "chunk_bytes": "zmq_chunk_bytes", "window_bytes": "zmq_window_bytes",
        "timeout_s": "zmq_timeout_s"})
    layerwise: LayerwiseConfig = nested(LayerwiseConfig(), {
        "layers_per_group": "layerwise_layers_per_group", "min_tokens": "layerwise_min_tokens"})
    optimistic: OptimisticConfig = nested(OptimisticConfig(), {"max_held_tokens": "optimistic_max_held_tokens"})
    # Not TransferConfig.keys_dir: the directory also holds register.secret, and "" (no keys) is checked
    # against --prfaas-zmq-insecure and the listen address (srt/backend/settings.py sets keys_dir from it).
    zmq_curve_keys: str = knob(
        "", "Directory made by `prfaas keys DIR` (CURVE key pairs, authorized keys, register.secret): encrypts "
        "and authenticates the KV data plane and authenticates decode registrations. Required when the "
        "server's address is not loopback, unless --prfaas-zmq-insecure.")
    zmq_insecure: bool = knob(
        False, "Run prfaas_zmq without keys on a routable address: plaintext KV, unauthenticated registrations "
        "(any host that reaches the prefill can redirect KV). Only for trusted, isolated networks.")
    zmq_data_port: int = knob(0, "First TCP port of the decode-side data-plane listener (0 = pick free ports).")
    zmq_stats_port: int = knob(0, "Port of the transport's JSON stats endpoint (0 = off).")
    zmq_stats_host: str = knob(
        "127.0.0.1", "Address the stats endpoint binds. The router in the other datacenter reads link goodput "
        "from it, so a remote prefill sets its routable address; the endpoint is read-only telemetry "
        "(GET /stats, /metrics).")
    unified_pool: bool = knob(
        False, "One memory pool for full-attention KV and linear-attention states: SGLang's KV and "
        "Mamba pools become one slab of aligned blocks with one free list, so memory flows to whichever "
        "the load needs. Colocated hybrid models with --radix-cache-backend prfaas_hybrid, --page-size 1.")
    cpu_query_only_attention: bool = knob(
        False, "CPU servers (torch_native): an extend after a cached prefix or an earlier chunk attends with its "
        "new queries only, as GPU attention backends do, instead of padding them to the whole context; a "
        "prefix hit then saves attention work too. Requests with no prefix compute exactly as stock.")
    tier_host_bytes: int = knob(
        0, "Host-memory tier below the prfaas_hybrid device pool, in bytes (0 = off): evicted KV blocks and "
        "linear-attention state checkpoints (sliding-window models: window pages) are kept here (LRU) and "
        "loaded back on a later prefix hit. Colocated and PD prefill servers of hybrid models, not PD decode.")
    tier_storage: str = knob(
        "none", "Storage tier below the host tier (or below the device pool without one): 'file' (SGLang's "
        "HiCache file backend, in --prfaas-tier-storage-path) or 'mooncake' (Mooncake Store over TCP).",
        choices=("none", "file", "mooncake"))
    tier_storage_path: str = knob("/tmp/prfaas-tiers", "Directory of the 'file' storage tier.")
    tier_storage_bytes: int = knob(0, "Bound of the 'file' storage tier in bytes, LRU beyond it (0 = no bound).")
    tier_mooncake_master: str = knob("127.0.0.1:50051", "host:port of the mooncake_master the 'mooncake' tier uses.")
    tier_mooncake_metadata: str = knob(
        "P2PHANDSHAKE", "Mooncake metadata server ('P2PHANDSHAKE': none, peers exchange it directly; or the "
        "http://host:port/metadata of mooncake_master --enable_http_metadata_server).")
    tier_publish: bool = knob(
        False, "Write-through to the storage tier: every KV block and state checkpoint the prfaas_hybrid pool "
        "indexes is also put in the store when computed (not only when evicted), so servers elsewhere that "
        "share the store (same model, same --prfaas-tier-key) can load the prefix. Asynchronous, bounded "
        "queue; what does not fit is dropped and counted.")
    tier_key: str = knob(
        "", "File holding the tier key (>= 32 bytes, mode 0600; `prfaas keys DIR` writes DIR/tier.secret; copy it "
        "to every server that shares the store): every tier entry is signed with HMAC-SHA256 under it, and an "
        "entry that does not verify is refused and never loaded. Without it a storage tier others can write "
        "(a 'mooncake' master off loopback, a 'file' directory other users can write) is left out.")

    def __post_init__(self):
        if self.role not in ROLES:
            raise ValueError(f"--prfaas-role must be one of {ROLES}, got {self.role!r}")
        self._check_keys()
        try:
            ipaddress.ip_address(self.zmq_stats_host)
        except ValueError:
            raise ValueError(f"--prfaas-zmq-stats-host must be an IP address, got {self.zmq_stats_host!r}") from None
        if self.tier_host_bytes < 0 or self.tier_storage_bytes < 0:
            raise ValueError("--prfaas-tier-host-bytes and --prfaas-tier-storage-bytes must be >= 0")
        if self.tier_key:
            from prfaas_sgl.cachepool.tiers.auth import load_key

            try:
                load_key(self.tier_key)
            except ValueError as e:
                raise ValueError(f"--prfaas-tier-key: {e}") from None
        for name in ("zmq_data_port", "zmq_stats_port"):
            port = getattr(self, name)
            if not 0 <= port <= 65535:
                raise ValueError(f"--prfaas-{name.replace('_', '-')} must be in 0..65535, got {port}")

    def _check_keys(self) -> None:
        if not self.zmq_curve_keys:
            return
        if self.zmq_insecure:
            raise ValueError("--prfaas-zmq-insecure and --prfaas-zmq-curve-keys contradict each other: give one")
        if not os.path.isdir(self.zmq_curve_keys):
            raise ValueError(f"--prfaas-zmq-curve-keys: {self.zmq_curve_keys!r} is not a directory")
        from prfaas_sgl.transfer.security import register_secret

        try:
            register_secret(self.zmq_curve_keys)
        except ValueError as e:
            raise ValueError(f"--prfaas-zmq-curve-keys: {e}") from None


def is_loopback(host: str) -> bool:
    """True for addresses no other machine can reach (127.0.0.0/8, ::1, localhost)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name: it may resolve to anything
        return False


def flag(name: str) -> str:
    return "--prfaas-" + name.replace("_", "-")


def add_flags(parser: argparse.ArgumentParser) -> None:
    """Adds one `--prfaas-*` option per `PrfaasConfig` field (dest `prfaas_<field>`); a bool is a switch
    (argparse's type=bool would read "False" as True)."""
    group = parser.add_argument_group("prfaas", "Prefill-as-a-Service (prfaas_sgl plugin)")
    add_fields(group, PrfaasConfig, prefix="prfaas-", dest_prefix="prfaas_", switch="store_true")


def from_namespace(ns: argparse.Namespace) -> PrfaasConfig:
    """Raises ValueError naming the flag when a value or combination is invalid."""
    return build(PrfaasConfig, ns, dest_prefix="prfaas_", prefix="prfaas-")
