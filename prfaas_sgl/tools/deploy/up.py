"""Start this machine's share of a deployment (servers, router), wait for health, hold until stopped.

With a [supervisor] section the hold is a supervisor (prfaas_sgl/tools/deploy/supervisor.py) that owns this
machine's local servers, so the router's controller can switch their roles (router/actuators/supervisor.py).
"""
from __future__ import annotations

import asyncio
import json
import os
import sys
import time
from pathlib import Path

from prfaas_sgl.tools.deploy.config import Deployment, ServerEntry
from prfaas_sgl.tools.launch import ManagedProcess, SGLangServer, ServerSpec, server_env, stop_all


def resolve_model(model: str) -> str:
    if model.startswith("tiny:"):
        from prfaas_sgl.tools.models.tiny import ensure

        return str(ensure(model.removeprefix("tiny:")))
    return model


def server_spec(dep: Deployment, s: ServerEntry, model_path: str, log_dir: Path) -> ServerSpec:
    return ServerSpec(
        model_path=model_path, port=s.port, host=s.host, mode=s.mode, transfer_backend=dep.transfer_backend,
        bootstrap_port=s.bootstrap_port, extra_args=dep.server_args + s.args, netns=s.netns,
        log_path=str(log_dir / f"{s.name}.log"), device=dep.device,
    )


def router_process(dep: Deployment, model_path: str, log_dir: Path) -> ManagedProcess:
    fields = dep.router_fields(tokenizer_path=model_path)
    cfg_path = log_dir / "router.json"
    cfg_path.write_text(json.dumps(fields, indent=2))
    host = fields.get("host", "127.0.0.1")
    url_host = "127.0.0.1" if host in ("0.0.0.0", "") else host
    cmd = [sys.executable, "-m", "prfaas_sgl.launch_router", "--config", str(cfg_path)]
    env = server_env(ServerSpec(model_path=model_path, port=0, device=dep.device))
    return ManagedProcess(cmd, env, str(log_dir / "router.log"), f"http://{url_host}:{fields.get('port', 8000)}")


class Stack:
    """The processes of one machine; start() brings them up in order (servers, then router)."""

    def __init__(self, dep: Deployment, machine: str | None, log_dir: Path, say=print):
        self.dep, self.machine, self.log_dir, self.say = dep, machine, log_dir, say
        self.servers: dict[str, SGLangServer] = {}
        self.router: ManagedProcess | None = None

    def start(self, timeout_s: float = 600.0) -> "Stack":
        return self.start_servers(timeout_s).start_router()

    def start_servers(self, timeout_s: float = 600.0) -> "Stack":
        self.log_dir.mkdir(parents=True, exist_ok=True)
        model = resolve_model(self.dep.model)
        for s in self.dep.on(self.machine):
            self.servers[s.name] = SGLangServer(server_spec(self.dep, s, model, self.log_dir)).start()
            self.say(f"[up] started {s.name} ({s.pool}) at {s.url}")
        t0 = time.monotonic()
        for name, srv in self.servers.items():
            srv.wait_healthy(timeout_s)
            self.say(f"[up] {name} healthy ({time.monotonic() - t0:.0f}s)")
        return self

    def start_router(self) -> "Stack":
        model = resolve_model(self.dep.model)
        if self.dep.router_on(self.machine):
            self.router = router_process(self.dep, model, self.log_dir).start().wait_healthy(120)
            self.say(f"[up] router healthy at {self.router.url}")
        return self

    def stop(self) -> None:
        for proc in [self.router, *self.servers.values()]:
            if proc is not None:
                proc.stop()

    def supervisor(self, token: str, timeout_s: float = 600.0):
        """The supervisor of this machine's local servers, or None (no [supervisor] section, or none here).

        It restarts a server through the same ``SGLangServer`` objects ``stop`` stops (``self.servers``)."""
        from prfaas_sgl.tools.deploy.supervisor import Supervisor
        from prfaas_sgl.tools.server_control import LaunchedServers

        names = [s.name for s in self.dep.switchable(self.machine)]
        if not self.dep.supervisor or not names:
            return None
        control = LaunchedServers(self.servers, health_timeout_s=timeout_s)
        return Supervisor(control, names, self.dep.supervisor_host(self.machine), token)


async def serve(stack: Stack, sup) -> None:
    """Servers, then this machine's supervisor (before the router: its controller may call it), then the router;
    then hold until cancelled (Ctrl-C)."""
    await asyncio.to_thread(stack.start_servers)
    try:
        if sup is not None:
            url = await sup.serve(stack.dep.supervisor["port"])
            stack.say(f"[up] supervisor of {', '.join(sup.names)} at {url}")
        await asyncio.to_thread(stack.start_router)
        print("[up] all up; Ctrl-C to stop", flush=True)
        await asyncio.Event().wait()
    finally:
        if sup is not None:
            await sup.close()


def run(dep: Deployment, machine: str | None, log_dir: Path) -> int:
    from prfaas_sgl.router.config import SUPERVISOR_TOKEN_ENV

    stack = Stack(dep, machine, log_dir)
    try:  # refused before any server starts: an open admin endpoint on a routable address
        sup = stack.supervisor(os.environ.get(SUPERVISOR_TOKEN_ENV, ""))
    except ValueError as e:
        print(f"prfaas up: {e}", flush=True)
        return 2
    try:
        asyncio.run(serve(stack, sup))
    except KeyboardInterrupt:
        return 0
    finally:
        stack.stop()
        stop_all()
    return 0
