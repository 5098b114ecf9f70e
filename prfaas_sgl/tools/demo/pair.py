"""The profiling step's PD pair: one prefill and one decode server handing KV over prfaas_zmq with the demo's
CURVE keys, behind an in-process router, so a profiled prefill pays the sending side of the handoff (gather,
serialise, encrypt) and the decode the receiving side (receive, decrypt, land), as the demo's servers do.

Each server's CPU seconds (its process tree, psutil) and the prefill transport's wire bytes (/stats) are read
around a batch: what the handoff costs the decode per request, and what S_kv(l) really crosses a link.
"""
from __future__ import annotations

import contextlib
import json
import urllib.request
from dataclasses import replace

import psutil

from prfaas_sgl.tools.demo import hardware
from prfaas_sgl.tools.demo.topology import DemoLink, deployment
from prfaas_sgl.tools.launch import free_port

LOOPBACK = DemoLink("127.0.0.1", "127.0.0.1", None, None)
PREFILL, DECODE = "local-prefill-0", "decode-0"


def pair_deployment(model: str, keys_dir: str | None, shared: bool):
    """The demo's deployment cut to one prefill + the decode. The prefill runs pinned to the remote core (its
    share is switched per profiled kind), the decode on the local core at its own share; the prefill serves
    its transport counters on a stats port."""
    dep = deployment(LOOPBACK, model, "prfaas_zmq", 300, 20.0, keys_dir, shares=shared)
    stats_port = free_port()
    prefill = next(s for s in dep.servers if s.name == PREFILL)
    prefill = replace(prefill, args=(*prefill.args, "--prfaas-zmq-stats-port", str(stats_port),
                                     "--prfaas-zmq-stats-host", "127.0.0.1"))
    if shared:
        remote = hardware.pool_share("prfaas")
        prefill = replace(prefill, cpu_cores=remote.cores, cpus=remote.cpus)
    decode = next(s for s in dep.servers if s.name == DECODE)
    router = {k: v for k, v in dep.router.items() if k != "transport_stats_url"} | {"policy": "local_only"}
    return replace(dep, servers=(prefill, decode), router=router), f"http://127.0.0.1:{stats_port}/stats"


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of `pid` and every process below it (SGLang's scheduler, detokenizer)."""
    total = 0.0
    with contextlib.suppress(psutil.NoSuchProcess):
        root = psutil.Process(pid)
        for p in [root, *root.children(recursive=True)]:
            with contextlib.suppress(psutil.NoSuchProcess):
                t = p.cpu_times()
                total += t.user + t.system
    return total


def wire_bytes(stats_url: str) -> int:
    """Bytes the prefill's transport has sent, over every destination."""
    with urllib.request.urlopen(stats_url, timeout=10) as r:
        doc = json.loads(r.read())
    return sum(link["bytes_total"] for link in doc["links"].values())


class Pair:
    """The started pair: ``stack`` (its servers), ``router`` (a LiveRouter), the stats url."""

    def __init__(self, model_ref: str, model_path: str, keys_dir: str | None, shared: bool, log_dir, say):
        from prfaas_sgl.tools.deploy.up import Stack

        self.dep, self.stats_url = pair_deployment(model_ref, keys_dir, shared)
        self.model_path, self.router = model_path, None
        self.stack = Stack(self.dep, "demo", log_dir, say=say)

    def __enter__(self) -> "Pair":
        from prfaas_sgl.router.config import RouterConfig
        from prfaas_sgl.tools.demo.live import LiveRouter

        try:
            self.stack.start()
            cfg = RouterConfig.from_flags(**self.dep.router_fields(tokenizer_path=self.model_path))
            self.router = LiveRouter(cfg).start()
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc) -> None:
        if self.router is not None:
            self.router.close()
        self.stack.stop()

    @property
    def url(self) -> str:
        return self.router.url

    def server(self, name: str):
        return self.stack.servers[name]

    def counters(self) -> tuple[float, float, int]:
        """(prefill CPU s, decode CPU s, wire bytes) so far."""
        return (cpu_seconds(self.server(PREFILL).pid), cpu_seconds(self.server(DECODE).pid),
                wire_bytes(self.stats_url))
