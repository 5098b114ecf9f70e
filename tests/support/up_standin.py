"""`prfaas up` (prfaas_sgl/tools/deploy/up.py) whose servers and router are stand-in processes
(tests/support/standin_process.py): its signals, restarts and supervisor on real processes, no SGLang.

    python -m tests.support.up_standin DEPLOY.json LOG_DIR   # DEPLOY.json: a deployment file as JSON, plus
                                                             # optional "machine", "policy", "grace_s" keys
A server whose args hold "never-healthy" runs but never answers /health (a server still loading).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from prfaas_sgl.tools.deploy import config, up
from prfaas_sgl.tools.deploy.keeper import RestartPolicy
from prfaas_sgl.tools.launch import ManagedProcess, ServerSpec


class StandinServer(ManagedProcess):
    """A stand-in with an ``SGLangServer``'s shape (``.spec``), so a role switch can restart it."""

    def __init__(self, spec: ServerSpec) -> None:
        self.spec = spec
        role = "decode" if spec.mode == "decode" else "prefill"
        cmd = [sys.executable, "-m", "tests.support.standin_process", role, str(spec.port)]
        if "never-healthy" in spec.extra_args:
            cmd = [sys.executable, "-c", "import time; time.sleep(600)"]
        super().__init__(cmd, dict(os.environ), spec.log_path or f"/tmp/standin-{spec.port}.log", spec.url,
                         spec.netns)


def standin_router(dep: config.Deployment, model: str, log_dir: Path) -> ManagedProcess:
    port = dep.router["port"]
    cmd = [sys.executable, "-m", "tests.support.standin_process", "decode", str(port)]
    return ManagedProcess(cmd, dict(os.environ), str(log_dir / "router.log"), f"http://127.0.0.1:{port}")


LAUNCHER = up.Launcher(server=StandinServer, router=standin_router, model=lambda m: m)


def main(argv: list[str]) -> int:
    raw = json.loads(Path(argv[0]).read_text())
    policy = RestartPolicy(**raw.pop("policy", {}))
    machine, grace_s = raw.pop("machine", None), raw.pop("grace_s", 5.0)
    return up.run(config.parse(raw), machine, Path(argv[1]), LAUNCHER, policy, grace_s)


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
