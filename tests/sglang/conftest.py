"""Real SGLang servers on CPU for the sglang tier.

A server takes ~40-80 s to start on 2 cores and ~2.5 GB of RAM (HTTP, scheduler and detokenizer
processes), so each test module declares the group of servers it needs (`farm_for`) and the group starts
concurrently, serves the whole module, and stops before the next module's group starts. A stateless
reference server (colocated, radix cache off) that several modules declare with the same flags is named in
`shared`: it starts once per session (`SharedServers`) and stops at the session's end.
"""
from __future__ import annotations

import dataclasses
import os
import time
from pathlib import Path

import pytest

from prfaas_sgl.tools.launch import SGLangServer, ServerSpec, free_port, stop_together
from prfaas_sgl.tools.models.tiny import ensure

HYBRID = "tiny-qwen35-hybrid"
LLAMA = "tiny-llama"
# A stopped farm's SIGTERM reaches every process of a server's group: the scheduler exits at once, and SGLang's
# HTTP process, seeing it die, sleeps 5 s "before crash diagnostics" (tokenizer_manager.py) before it exits:
# 5-6 s per module with the default 10-s grace. A test server has nothing to flush (logs are unbuffered), so
# the group is SIGKILLed after this grace instead.
STOP_GRACE_S = 1.0
# The servers of these modules fork SGLang's scheduler and detokenizer instead of spawning them
# (prfaas_sgl/tools/sglang_forked.py): each spawned child imports SGLang and torch again, and a 5-server farm
# of test_families was healthy after 54 s forked against 149 s spawned (CI at 794f858). Every module started
# through a farm forks; SGLang's own spawn path stays covered by test_chaos (its servers are started the way
# `prfaas up` starts them: ServerSpec without fork_children) and test_plugin_cli.
FORKED = frozenset({
    "test_cachepool_pd", "test_cachepool_sglang", "test_cachepool_tiers", "test_cachepool_tiers_shared",
    "test_cachepool_tiers_pd_decode", "test_cachepool_tiers_pd_decode_swa", "test_cachepool_tiers_swa",
    "test_cross_cluster", "test_families", "test_layerwise",
    "test_prfaas_zmq", "test_prfaas_zmq_dense", "test_prfaas_zmq_faults", "test_prfaas_zmq_optimistic",
    "test_router_decode_cache", "test_router_e2e", "test_serving_cpu", "test_unified_pool",
})


class SharedServers:
    """Session-wide servers, one per distinct spec (ports and log path aside)."""

    def __init__(self):
        self._by_key: dict[str, SGLangServer] = {}

    def get(self, spec_: ServerSpec) -> SGLangServer:
        """The running server for `spec_`'s flags, started (not waited for) on first use."""
        key = repr(dataclasses.replace(spec_, port=0, log_path=None, fork_children=False))
        if key not in self._by_key:
            self._by_key[key] = SGLangServer(spec_).start()
        return self._by_key[key]

    def stop(self) -> None:
        stop_together(list(self._by_key.values()), STOP_GRACE_S)


class Farm:
    def __init__(self, specs: dict[str, ServerSpec], shared: tuple[str, ...] = (), pool: SharedServers | None = None,
                 fork: bool = False):
        specs = {name: dataclasses.replace(s, fork_children=fork) for name, s in specs.items()}
        self.specs = specs
        self.servers = {name: pool.get(s) if name in shared else SGLangServer(s) for name, s in specs.items()}
        self.shared = shared
        self.own = [srv for name, srv in self.servers.items() if name not in shared]

    def start(self) -> "Farm":
        for srv in self.own:
            srv.start()
        try:
            for srv in self.servers.values():
                srv.wait_healthy(timeout_s=600)
        except BaseException:
            self.stop()
            raise
        return self

    def __getitem__(self, name: str) -> SGLangServer:
        return self.servers[name]

    def stop(self) -> None:
        # a role switch (LaunchedServers) replaces a server object in `servers`: stop the new ones too
        current = [srv for name, srv in self.servers.items() if name not in self.shared]
        stop_together(list({id(srv): srv for srv in self.own + current}.values()), STOP_GRACE_S)


def forked(request) -> bool:
    """Whether the requesting test module's servers fork SGLang's children (see FORKED)."""
    return request.module.__name__.rsplit(".", 1)[-1] in FORKED


def spec(log_dir: Path, name: str, model: str, **kw) -> ServerSpec:
    return ServerSpec(model_path=str(ensure(model)), port=free_port(), log_path=str(log_dir / f"{name}.log"), **kw)


# The session's colocated reference per model (batch 1, chunk 64, prefix caching off): the same flags in every
# module that names it in `shared` make one server start for all of them (test_cachepool_pd.py,
# test_router_decode_cache.py and test_unified_pool.py spell the hybrid one out; test_layerwise.py uses this).
# Greedy tokens of the tiny float32 models do not depend on the chunk grid (test_families.py compares chunk 64
# with 512 exactly), but chunk 64 is slow for long GDN prompts: test_chaos.py's 54 references (up to 1,600
# tokens) took 192 s on it against ~20 s at chunk 512, so a module sending dozens of long prompts keeps its own.
REFERENCE = dict(chunked_prefill_size=64, max_running_requests=1, extra_args=("--disable-radix-cache",))


def reference_spec(log_dir: Path, model: str) -> ServerSpec:
    return spec(log_dir, "pool_pd_colocated" if model == HYBRID else f"{model}_reference", model, **REFERENCE)


@pytest.fixture(scope="session")
def log_dir() -> Path:
    # Not under pytest's tmp dirs: concurrent pytest runs prune those while servers still write logs.
    d = Path(os.environ.get("PRFAAS_TEST_LOG_DIR", "out/test-logs")) / time.strftime("%Y%m%d-%H%M%S")
    d.mkdir(parents=True, exist_ok=True)
    return d


@pytest.fixture(scope="session")
def shared_servers():
    pool = SharedServers()
    try:
        yield pool
    finally:
        pool.stop()


@pytest.fixture(scope="session")
def model_paths():
    return {"llama": str(ensure(LLAMA)), "hybrid": str(ensure(HYBRID))}


def farm_for(build_specs, shared: tuple[str, ...] = ()):
    """Module-scoped fixture factory: `farm = farm_for(lambda log_dir: {name: spec, ...})`; the servers named
    in `shared` must be stateless between requests (they outlive the module, see SharedServers)."""

    @pytest.fixture(scope="module")
    def _farm(request, log_dir, shared_servers):
        f = Farm(build_specs(log_dir), shared, shared_servers, forked(request)).start()
        try:
            yield f
        finally:
            f.stop()

    return _farm
