"""Real SGLang servers on CPU for the sglang tier.

A server takes ~40-80 s to start on 2 cores and ~2.5 GB of RAM (HTTP, scheduler and detokenizer
processes), so each test module declares the group of servers it needs (`farm_for`) and the group starts
concurrently, serves the whole module, and stops before the next module's group starts.
"""
from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from prfaas_sgl.launch import SGLangServer, ServerSpec, free_port, stop_together
from prfaas_sgl.models.tiny import ensure

HYBRID = "tiny-qwen35-hybrid"
LLAMA = "tiny-llama"


class Farm:
    def __init__(self, specs: dict[str, ServerSpec]):
        self.specs = specs
        self.servers = {name: SGLangServer(s) for name, s in specs.items()}

    def start(self) -> "Farm":
        for srv in self.servers.values():
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
        stop_together(list(self.servers.values()))


def spec(log_dir: Path, name: str, model: str, **kw) -> ServerSpec:
    return ServerSpec(model_path=str(ensure(model)), port=free_port(), log_path=str(log_dir / f"{name}.log"), **kw)


@pytest.fixture(scope="session")
def log_dir() -> Path:
    # Not under pytest's tmp dirs: concurrent pytest runs prune those while servers still write logs.
    d = Path(os.environ.get("PRFAAS_TEST_LOG_DIR", "out/test-logs")) / time.strftime("%Y%m%d-%H%M%S")
    d.mkdir(parents=True, exist_ok=True)
    return d


@pytest.fixture(scope="session")
def model_paths():
    return {"llama": str(ensure(LLAMA)), "hybrid": str(ensure(HYBRID))}


def farm_for(build_specs):
    """Module-scoped fixture factory: `farm = farm_for(lambda log_dir: {name: spec, ...})`."""

    @pytest.fixture(scope="module")
    def _farm(log_dir):
        f = Farm(build_specs(log_dir)).start()
        try:
            yield f
        finally:
            f.stop()

    return _farm
