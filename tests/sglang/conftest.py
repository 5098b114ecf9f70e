"""Real SGLang servers on CPU, shared by the whole sglang tier.

Servers start ~40-80 s each on 2 cores, so every server the tier needs is started at once, the first time
any test asks for one (`farm`), and stopped at session end. Names are the keys of `SERVERS`.
"""
from __future__ import annotations

import pytest

from prfaas_sgl.launch import SGLangServer, ServerSpec, free_port
from prfaas_sgl.models.tiny import ensure

HYBRID = "tiny-qwen35-hybrid"
LLAMA = "tiny-llama"
CHUNK = 512  # chunked prefill smaller than the long prompts, so PD sends several chunks


def _specs(tmp) -> dict[str, ServerSpec]:
    hybrid, llama = str(ensure(HYBRID)), str(ensure(LLAMA))
    boot = free_port()

    def spec(name, model, **kw):
        return ServerSpec(model_path=model, port=free_port(), log_path=str(tmp / f"{name}.log"), **kw)

    return {
        "llama": spec("llama", llama),
        "hybrid": spec("hybrid", hybrid),
        "hybrid_mc_prefill": spec("hybrid_mc_prefill", hybrid, mode="prefill", transfer_backend="mooncake",
                                  bootstrap_port=boot, chunked_prefill_size=CHUNK),
        "hybrid_mc_decode": spec("hybrid_mc_decode", hybrid, mode="decode", transfer_backend="mooncake"),
    }


class Farm:
    def __init__(self, specs: dict[str, ServerSpec]):
        self.specs = specs
        self.servers = {name: SGLangServer(s) for name, s in specs.items()}

    def start(self):
        for srv in self.servers.values():
            srv.start()
        for srv in self.servers.values():
            srv.wait_healthy(timeout_s=600)
        return self

    def __getitem__(self, name: str) -> SGLangServer:
        return self.servers[name]

    def stop(self):
        for srv in self.servers.values():
            srv.stop()


@pytest.fixture(scope="session")
def farm(tmp_path_factory):
    f = Farm(_specs(tmp_path_factory.mktemp("sglang-logs")))
    try:
        yield f.start()
    finally:
        f.stop()


@pytest.fixture(scope="session")
def model_paths():
    return {"llama": str(ensure(LLAMA)), "hybrid": str(ensure(HYBRID))}
