"""The demo's router, in the demo's process on its own event-loop thread: the processes actuator it runs for
the shift phase restarts SGLang servers, which only the process that started them can do."""
from __future__ import annotations

import asyncio
import threading
from typing import Any, Callable

from prfaas_sgl.router.app import RouterHandle, start_router
from prfaas_sgl.router.cluster import Cluster
from prfaas_sgl.router.config import RouterConfig
from prfaas_sgl.router.controller_api import Controller
from prfaas_sgl.router.prefix_index import ApproxIndex, ExactIndex


def use_servers(cluster: Cluster, names: tuple[str, ...]) -> None:
    """Serve from ``names`` only: drain every other instance, put drained ones among ``names`` back."""
    unknown = set(names) - set(cluster.instances)
    if unknown:
        raise ValueError(f"no such servers {sorted(unknown)}; the router has {sorted(cluster.instances)}")
    for name, inst in cluster.instances.items():
        if name in names:
            cluster.undrain(name)
        elif not inst.draining:
            cluster.drain(name)


def forget_caches(cluster: Cluster) -> None:
    """The servers' prefix caches were flushed: empty the router's index of each, as SGLang emptied the cache.

    Without KV events the router's index holds what it routed to a server, and a flush does not reach it. The
    demo's repetitions reuse their prompts, so after one homogeneous run the index held every prompt on the local
    prefill servers: the next PrfaaS run judged long prompts "cached" there, routed them local as short, and the
    0.105-core server recomputed them whole (offload 70% -> 52% -> 44% over three repetitions, throughput
    4.15 -> 1.73 -> 1.41 req/s)."""
    for inst in cluster.instances.values():
        if isinstance(inst.index, ExactIndex):
            inst.index.cleared()
        else:
            inst.index = ApproxIndex(inst.index.capacity)


class LiveRouter:
    """``start()`` a router from ``cfg`` with ``controller``; ``call(fn)`` runs ``fn(router)`` on its loop."""

    def __init__(self, cfg: RouterConfig, controller: Controller | None = None) -> None:
        self.cfg, self.controller = cfg, controller
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="demo-router", daemon=True)
        self.handle: RouterHandle | None = None

    def start(self) -> "LiveRouter":
        self.thread.start()
        self.handle = self._run(start_router(self.cfg, self.controller, seed=0))
        return self

    @property
    def url(self) -> str:
        return self.handle.url

    def _run(self, coro, timeout_s: float = 60.0):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout_s)

    def call(self, fn: Callable[[Any], Any]) -> Any:
        """``fn(router)`` on the router's loop (its state is touched from that loop only)."""
        async def run():
            return fn(self.handle.router)
        return self._run(run())

    def close(self) -> None:
        if self.handle is not None:
            self._run(self.handle.close())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
