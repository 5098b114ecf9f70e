"""Start this machine's share of a deployment (servers, router), wait for health, keep it running until
stopped.

While it holds, a server or the router that dies is restarted (prfaas_sgl/tools/deploy/keeper.py). SIGTERM,
SIGINT and SIGHUP stop every process it started (SIGTERM to each process group, SIGKILL after a grace
period) and it exits 0; a crash of its own stops them too, and a SIGKILL of it reaches them through the
parent-death signal (prfaas_sgl/tools/launch.py). With a [supervisor] section it also keeps a supervisor
(prfaas_sgl/tools/deploy/supervisor.py) that owns this machine's local servers, so the router's controller
can switch their roles (router/actuators/supervisor.py).
"""
from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from prfaas_sgl.tools import cpu_share
from prfaas_sgl.tools.deploy.config import Deployment, ServerEntry
from prfaas_sgl.tools.deploy.keeper import Keeper, RestartPolicy
from prfaas_sgl.tools.launch import ManagedProcess, SGLangServer, ServerSpec, server_env, stop_all, stop_together

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)


def resolve_model(model: str) -> str:
    if model.startswith("tiny:"):
        from prfaas_sgl.tools.models.tiny import ensure

        return str(ensure(model.removeprefix("tiny:")))
    return model


def server_spec(dep: Deployment, s: ServerEntry, model_path: str, log_dir: Path) -> ServerSpec:
    return ServerSpec(
        model_path=model_path, port=s.port, host=s.host, mode=s.mode, transfer_backend=dep.transfer_backend,
        bootstrap_port=s.bootstrap_port, extra_args=dep.server_args + s.args, netns=s.netns,
        log_path=str(log_dir / f"{s.name}.log"), device=dep.device, cpu=s.cpu_share,
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


@dataclass(frozen=True)
class Launcher:
    """How a Stack makes its processes: SGLang servers and the router here; tests swap in stand-ins."""

    server: Callable[[ServerSpec], ManagedProcess] = SGLangServer
    router: Callable[[Deployment, str, Path], ManagedProcess] = router_process
    model: Callable[[str], str] = resolve_model


class Stack:
    """The processes of one machine; start() brings them up in order (servers, then router)."""

    def __init__(self, dep: Deployment, machine: str | None, log_dir: Path, say=print,
                 launcher: Launcher = Launcher(), policy: RestartPolicy = RestartPolicy(), grace_s: float = 15.0):
        self.dep, self.machine, self.log_dir, self.say = dep, machine, log_dir, say
        self.launcher, self.grace_s = launcher, grace_s
        self.servers: dict[str, ManagedProcess] = {}
        self.router: ManagedProcess | None = None
        self.keeper = Keeper(policy, say, grace_s)

    def start(self, timeout_s: float = 600.0) -> "Stack":
        self.spawn_servers()
        self.wait_servers(timeout_s)
        if self.spawn_router():
            self.wait_router()
        return self

    def spawn_servers(self) -> None:
        """Starts this machine's servers without waiting (call it on the main thread: launch._die_with_parent)."""
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.check_cpu_shares()
        model = self.launcher.model(self.dep.model)
        for s in self.dep.on(self.machine):
            srv = self.servers[s.name] = self.launcher.server(server_spec(self.dep, s, model, self.log_dir))
            srv.start()
            self.say(f"[up] started {s.name} ({s.pool}) at {s.url}, pid {srv.pid}")

    def check_cpu_shares(self) -> None:
        """ValueError naming every server of this machine whose CPU share cannot be applied here: refused
        before any server starts, since a half-emulated cluster would measure the wrong thing."""
        refused = [f"servers[{s.name}]: {why}" for s in self.dep.on(self.machine)
                   if s.cpu_share is not None and (why := cpu_share.problem(s.cpu_share))]
        if refused:
            raise ValueError("; ".join(refused))

    def wait_servers(self, timeout_s: float = 600.0) -> None:
        """Waits until every server answers /health (raises if one exits first), then keeps them running."""
        t0 = time.monotonic()
        for name, srv in self.servers.items():
            srv.wait_healthy(timeout_s)
            self.say(f"[up] {name} healthy ({time.monotonic() - t0:.0f}s)")
        for name, srv in self.servers.items():
            self.keeper.keep(name, srv)

    def spawn_router(self) -> bool:
        if not self.dep.router_on(self.machine):
            return False
        self.router = self.launcher.router(self.dep, self.launcher.model(self.dep.model), self.log_dir).start()
        self.say(f"[up] started the router, pid {self.router.pid}")
        return True

    def wait_router(self, timeout_s: float = 120.0) -> None:
        self.router.wait_healthy(timeout_s)
        self.keeper.keep("router", self.router)
        self.say(f"[up] router healthy at {self.router.url}")

    def stop(self) -> None:
        """Stops every process (SIGTERM to each group, SIGKILL after ``grace_s``, one grace period for all)."""
        stop_together([p for p in [self.router, *self.servers.values()] if p is not None], self.grace_s)

    def pids(self) -> list[int]:
        return [p.pid for p in [self.router, *self.servers.values()] if p is not None and p.pid]

    def supervisor(self, token: str, timeout_s: float = 600.0):
        """The supervisor of this machine's local servers, or None (no [supervisor] section, or none here).

        It restarts a server through the same objects ``stop`` stops (``self.servers``), and releases it from
        the keeper while it is stopped on purpose."""
        from prfaas_sgl.tools.deploy.supervisor import Supervisor
        from prfaas_sgl.tools.server_control import LaunchedServers

        names = [s.name for s in self.dep.switchable(self.machine)]
        if not self.dep.supervisor or not names:
            return None
        control = LaunchedServers(self.servers, health_timeout_s=timeout_s, make=self.launcher.server,
                                  keeper=self.keeper)
        return Supervisor(control, names, self.dep.supervisor_host(self.machine), token, self.keeper.report)

    def supervisor_url(self) -> str:
        host = self.dep.supervisor_host(self.machine)
        return f"http://{f'[{host}]' if ':' in host else host}:{self.dep.supervisor['port']}"


async def serve(stack: Stack, sup, timeout_s: float = 600.0) -> None:
    """Servers, then this machine's supervisor (before the router: its controller may call it), then the router;
    then keep them running. Every fork happens on this (the main) thread; only the waits run in threads."""
    stack.spawn_servers()
    await asyncio.to_thread(stack.wait_servers, timeout_s)
    if sup is not None:
        url = await sup.serve(stack.dep.supervisor["port"])
        stack.say(f"[up] supervisor of {', '.join(sup.names)} at {url}")
    if stack.spawn_router():
        await asyncio.to_thread(stack.wait_router)
    stack.say(f"[up] all up (pids {' '.join(map(str, stack.pids()))}); SIGTERM, SIGINT or SIGHUP stops everything")
    await stack.keeper.run()


async def hold(stack: Stack, sup) -> int:
    """Runs ``serve`` until a stop signal (exit 0) or a failure of its own (exit 1); stops everything either way."""
    loop = asyncio.get_running_loop()
    got: asyncio.Future[int] = loop.create_future()
    for sig in STOP_SIGNALS:
        # A signal ignored when we started (nohup, a background job of a shell) stays ignored.
        if signal.getsignal(sig) is not signal.SIG_IGN:
            loop.add_signal_handler(sig, lambda s=sig: got.done() or got.set_result(s))
    work = asyncio.create_task(serve(stack, sup))
    status = 0
    try:
        await asyncio.wait({work, got}, return_when=asyncio.FIRST_COMPLETED)
        if got.done():
            stack.say(f"[up] {signal.Signals(got.result()).name}: stopping every server and the router")
        else:
            stack.say(f"[up] failed: {type(work.exception()).__name__}: {work.exception()}")
            status = 1
    finally:
        work.cancel()  # first: the keeper must not restart what is being stopped
        await asyncio.gather(work, return_exceptions=True)
        if sup is not None:
            await sup.close()
        t0 = time.monotonic()
        await asyncio.to_thread(stack.stop)
        stack.say(f"[up] stopped ({time.monotonic() - t0:.1f} s)")
    return status


def run(dep: Deployment, machine: str | None, log_dir: Path, launcher: Launcher = Launcher(),
        policy: RestartPolicy = RestartPolicy(), grace_s: float = 15.0) -> int:
    """``prfaas up``: 0 after a stop signal, 1 when a process failed to come up, 2 when refused before any start."""
    stack = Stack(dep, machine, log_dir, _say, launcher, policy, grace_s)
    try:  # refused before any server starts: an open admin endpoint on a routable address, a short token,
        stack.check_cpu_shares()  # a CPU share this machine cannot apply
        sup = stack.supervisor(_supervisor_token(stack))
    except ValueError as e:
        print(f"prfaas up: {e}", flush=True)
        return 2
    try:
        return asyncio.run(hold(stack, sup))
    finally:
        stack.stop()  # nothing left after hold(); this catches an error in hold itself
        stop_all()


def _supervisor_token(stack: Stack) -> str:
    """This machine's supervisor token (from one value or ``URL=TOKEN`` pairs); raises ValueError when it, or
    the router's token for any supervisor when the router runs here, is missing or short: the router would
    otherwise fail only at its first switch."""
    from prfaas_sgl.router.actuators.supervisor import supervisor_tokens
    from prfaas_sgl.router.config import SUPERVISOR_TOKEN_ENV, parse_supervisor_urls

    dep, value = stack.dep, os.environ.get(SUPERVISOR_TOKEN_ENV, "")
    if dep.router_on(stack.machine) and dep.router.get("actuator") == "supervisor":
        urls = parse_supervisor_urls(dep.router_fields(tokenizer_path="")["supervisor_urls"]).values()
        supervisor_tokens(dep.router.get("supervisor_token") or value, urls)
    if not dep.supervisor or not dep.switchable(stack.machine):
        return ""
    url = stack.supervisor_url()
    return supervisor_tokens(value, [url])[url]


def _say(line: str) -> None:
    print(line, flush=True)
