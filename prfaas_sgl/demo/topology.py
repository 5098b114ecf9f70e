"""The demo's deployment: a "remote" PrfaaS prefill server behind an emulated inter-DC link, a local
prefill server, a local decode server and the router — one generated `Deployment` run by `prfaas up`'s Stack.

Range of the link: `tc tbf` on a veth pair into a network namespace (needs root). Without root every
server binds 127.0.0.1 and the link is not emulated (the demo says so).
"""
from __future__ import annotations

from dataclasses import dataclass

from prfaas_sgl.deploy.config import Deployment, ServerEntry
from prfaas_sgl.launch import free_port

# Tiny hybrid model (tiny-qwen35-hybrid): 2 full-attention layers x (K, V) x 2 KV heads x 16 dims x fp32,
# plus per request 6 GDN layers of recurrent state (4 heads x 16 x 16 fp32) and conv state.
KV_BYTES_PER_TOKEN = 2 * 2 * 2 * 16 * 4
STATE_BYTES = 6 * (4 * 16 * 16 * 4 + 128 * 3 * 4)


@dataclass(frozen=True)
class DemoLink:
    remote_ip: str
    local_ip: str
    netns: str | None
    rate: str | None


def deployment(link: DemoLink, model: str, backend: str, threshold: int, link_mbit: float,
               keys_dir: str | None = None) -> Deployment:
    """`keys_dir` (made by `prfaas keys`): CURVE and an authenticated Register on the data plane, which
    prfaas_zmq requires once the link's routable addresses are used."""
    boot_remote, boot_local = free_port(), free_port()
    servers = (
        ServerEntry("prfaas-0", "demo", "prfaas", link.remote_ip, free_port(), boot_remote, link.netns,
                    ("--prfaas-role", "remote")),
        ServerEntry("local-prefill-0", "demo", "local_prefill", "127.0.0.1", free_port(), boot_local, None,
                    ("--prfaas-role", "local")),
        # Decode binds the link's local address: the remote prefill must reach it across the link.
        ServerEntry("decode-0", "demo", "decode", link.local_ip, free_port(), None, None,
                    ("--prfaas-role", "local")),
    )
    router = {
        "machine": "demo", "host": "127.0.0.1", "port": free_port(), "policy": "bandwidth_aware",
        "threshold": threshold, "block_size": 1, "kv_bytes_per_token": float(KV_BYTES_PER_TOKEN),
        "state_bytes": float(STATE_BYTES), "link_gbps": link_mbit / 1000.0, "context_length": 8192,
        "loads_interval_s": 0.5, "health_interval_s": 2.0,
    }
    keys = ("--prfaas-zmq-curve-keys", keys_dir) if keys_dir and backend == "prfaas_zmq" else ()
    return Deployment(model=model, servers=servers, router=router, transfer_backend=backend, device="cpu",
                      server_args=keys)
