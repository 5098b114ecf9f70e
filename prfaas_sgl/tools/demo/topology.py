"""The demo's deployment: a "remote" PrfaaS prefill server behind an emulated inter-DC link, two local
prefill servers, a local decode server and the router — one generated `Deployment` whose servers `prfaas up`'s
Stack starts (the router runs in the demo's process: its processes actuator restarts servers the demo owns).

Each phase serves from a subset (``PHASES``); the others are drained. PrfaaS and homogeneous PD get the same
number of servers (homogeneous: all three local), so the comparison is not won by extra hardware.

Range of the link: `tc tbf` on a veth pair into a network namespace (needs root). Without root every
server binds 127.0.0.1 and the link is not emulated (the demo says so).
"""
from __future__ import annotations

from dataclasses import dataclass, replace

from prfaas_sgl.tools.demo.hardware import pool_share
from prfaas_sgl.tools.deploy.config import Deployment, ServerEntry
from prfaas_sgl.tools.launch import free_port

# Tiny hybrid model (tiny-qwen35-hybrid): 2 full-attention layers x (K, V) x 2 KV heads x 16 dims x fp32,
# plus per request 6 GDN layers of recurrent state (4 heads x 16 x 16 fp32) and conv state.
KV_BYTES_PER_TOKEN = 2 * 2 * 2 * 16 * 4
STATE_BYTES = 6 * (4 * 16 * 16 * 4 + 128 * 3 * 4)


CONTROLLER_S = 5.0  # the shift phase lasts ~2 min: the controller looks every 5 s


@dataclass(frozen=True)
class Phase:
    label: str
    policy: str
    servers: tuple[str, ...]  # the others are drained for this phase
    shift: bool = False  # the workload shifts mid-phase and the controller may move a local server
    merged: tuple[str, ...] = ()  # servers whose CPU share doubles for this phase: two of their kind in one

    @property
    def key(self) -> str:
        """Names the phase's measurements and prediction (the policy, unless two phases share it)."""
        return self.policy + ("_equal_cost" if self.merged else "")


PHASES = (
    Phase("PrfaaS (threshold + bandwidth-aware)", "bandwidth_aware", ("prfaas-0", "local-prefill-0", "decode-0")),
    Phase("homogeneous PD (3 servers, all local)", "local_only", ("local-prefill-0", "local-prefill-1", "decode-0")),
    Phase("naive (all prefill remote)", "all_remote", ("prfaas-0", "local-prefill-0", "decode-0")),
    Phase("workload shift + controller", "bandwidth_aware",
          ("prfaas-0", "local-prefill-0", "local-prefill-1", "decode-0"), shift=True),
)

# The paper's equal-cost comparison, where an H200 costs about 2 H20s (docs/simulation.md): PrfaaS's 1 H200-like
# + 2 H20-like servers buy 4 H20-like ones, 3 prefill + 1 decode. The third prefill server is local-prefill-1's
# share doubled for the phase (two H20-like prefill servers in one process).
EQUAL_COST = Phase("homogeneous PD at equal cost (4 H20-like)", "local_only",
                   ("local-prefill-0", "local-prefill-1", "decode-0"), merged=("local-prefill-1",))


@dataclass(frozen=True)
class DemoLink:
    remote_ip: str
    local_ip: str
    netns: str | None
    rate: str | None


def with_shares(server: ServerEntry) -> ServerEntry:
    """`server` with its pool's emulated hardware (hardware.py)."""
    sh = pool_share(server.pool)
    return replace(server, cpu_cores=sh.cores, cpus=sh.cpus)


def deployment(link: DemoLink, model: str, backend: str, threshold: int, link_mbit: float,
               keys_dir: str | None = None, shares: bool = False, cost: dict | None = None) -> Deployment:
    """`keys_dir` (made by `prfaas keys`): CURVE and an authenticated Register on the data plane, which
    prfaas_zmq requires once the link's routable addresses are used. `shares`: each server gets its pool's
    CPU share (hardware.py). `cost`: router keys of its prefill-time model (plan.router_cost)."""
    boot_remote, boot_local = free_port(), free_port()
    # The remote prefill's transport serves its link counters (bound to its side of the link, so the router
    # and Prometheus in the local namespace reach it): the router's link telemetry and the dashboard's
    # prfaas_transfer_* panels then read the bytes that really crossed the link.
    stats = (("--prfaas-zmq-stats-port", str(free_port()), "--prfaas-zmq-stats-host", link.remote_ip)
             if backend == "prfaas_zmq" else ())
    servers = (
        ServerEntry("prfaas-0", "demo", "prfaas", link.remote_ip, free_port(), boot_remote, link.netns,
                    ("--prfaas-role", "remote", *stats)),
        ServerEntry("local-prefill-0", "demo", "local_prefill", "127.0.0.1", free_port(), boot_local, None,
                    ("--prfaas-role", "local")),
        ServerEntry("local-prefill-1", "demo", "local_prefill", "127.0.0.1", free_port(), free_port(), None,
                    ("--prfaas-role", "local")),
        # Decode binds the link's local address: the remote prefill must reach it across the link.
        ServerEntry("decode-0", "demo", "decode", link.local_ip, free_port(), None, None,
                    ("--prfaas-role", "local")),
    )
    router = {  # on its own "machine": Stack starts the servers, the demo runs the router in-process
        "machine": "demo-router", "host": "127.0.0.1", "port": free_port(), "policy": "bandwidth_aware",
        "threshold": threshold, "block_size": 1, "kv_bytes_per_token": float(KV_BYTES_PER_TOKEN),
        "state_bytes": float(STATE_BYTES), "link_gbps": link_mbit / 1000.0, "context_length": 8192,
        "loads_interval_s": 0.5, "health_interval_s": 2.0, "controller_interval_s": CONTROLLER_S,
        # Cache affinity yields to load past this many queued tokens: the router's 32768 scaled by the demo's
        # 1/64 like every length. Unscaled, a one-token hit (block_size 1) kept every request on the first
        # local prefill server while the second idled (homogeneous PD measured half its predicted throughput).
        "overload_tokens": 512,
    }
    if shares:
        servers = tuple(map(with_shares, servers))
    router.update(cost or {})
    if stats:
        router["transport_stats_url"] = f"http://{link.remote_ip}:{stats[1]}/stats"
    keys = ("--prfaas-zmq-curve-keys", keys_dir) if keys_dir and backend == "prfaas_zmq" else ()
    return Deployment(model=model, servers=servers, router=router, transfer_backend=backend, device="cpu",
                      server_args=keys)
