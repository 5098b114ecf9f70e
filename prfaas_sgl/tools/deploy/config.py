"""One deployment file for a whole PrfaaS topology: which servers, on which machine, with which flags.

Every machine runs `prfaas up --config FILE --machine NAME` and starts only its own share (servers whose
`machine` is NAME, and the router if it is placed there). The router's server lists are derived from the
same file, so nothing is kept in sync by hand. Example: docs/deploy-two-datacenters.toml.

    [deployment]
    model = "/models/Qwen3.5-35B"      # or "tiny:tiny-qwen35-hybrid" (built offline)
    device = "cuda"                     # "cpu" adds the CPU serving flags (prfaas_sgl.tools.launch)
    transfer_backend = "prfaas_zmq"     # the default on cpu and cuda; see BACKEND_DEVICES
    server_args = ["--page-size", "64"] # for every server

    [[servers]]
    name = "prfaas-0"; machine = "remote-a"; pool = "prfaas"; host = "10.1.0.5"; port = 30000
    bootstrap_port = 8998               # prefill pools only

    [router]
    machine = "local-a"; host = "0.0.0.0"; port = 8000; threshold = 8192   # any RouterConfig field

    [supervisor]                        # optional: the controller may switch local servers' roles
    port = 8101                         # each machine's `prfaas up` serves it on its servers' host
    # and in [router]: controller = "planner", controller_scenario = "...", actuator = "supervisor"
    # off loopback, every machine needs the same PRFAAS_SUPERVISOR_TOKEN in its environment

Tokens never go in this file (it is copied to every machine and often committed, and `prfaas up` writes
[router] to router.json): the router reads them from its environment, which `prfaas up` passes on.
"""
from __future__ import annotations

import dataclasses
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

from prfaas_sgl.config import is_loopback
from prfaas_sgl.router.config import ADMIN_TOKEN_ENV, SUPERVISOR_TOKEN_ENV, RouterConfig
from prfaas_sgl.tools.cpu_share import CpuShare

POOLS = ("prfaas", "local_prefill", "decode")
DEVICES = ("cpu", "cuda")
DEFAULT_BACKEND = {"cpu": "prfaas_zmq", "cuda": "prfaas_zmq"}
# Which --disaggregation-transfer-backend runs on which --device (checked when the file is read, so a
# combination SGLang or our backend refuses at start-up fails on every machine before anything starts).
# prfaas_zmq: host memory or CUDA pools through its staged path; mooncake: CUDA, or CPU with
# mooncake-transfer-engine-non-cuda; nixl and mori: GPUs only.
BACKEND_DEVICES = {"prfaas_zmq": ("cpu", "cuda"), "mooncake": ("cpu", "cuda"), "nixl": ("cuda",),
                   "mori": ("cuda",), "fake": ("cpu", "cuda")}
# RouterConfig's secret fields (kept out of its repr) and where the router reads each instead of a file
SECRET_ROUTER_FIELDS = frozenset(f.name for f in dataclasses.fields(RouterConfig) if not f.repr)
SECRET_ENV = {"admin_token": ADMIN_TOKEN_ENV, "supervisor_token": SUPERVISOR_TOKEN_ENV}


def public_router_fields(router: dict, dropped: frozenset[str] = frozenset()) -> dict:
    """`router` without its secret fields nor `dropped`: what may be written to router.json or a ConfigMap.
    The file's secrets are refused when it is read; this also covers a section changed after that."""
    return {k: v for k, v in router.items() if k not in SECRET_ROUTER_FIELDS | dropped}


@dataclass(frozen=True)
class ServerEntry:
    name: str
    machine: str
    pool: str
    host: str
    port: int
    bootstrap_port: int | None = None
    netns: str | None = None
    args: tuple[str, ...] = ()
    cpu_cores: float | None = None  # emulated compute: CPU time per second, in cores (cgroup v1 quota)
    cpus: tuple[int, ...] = ()  # the cores it runs on (taskset)

    def __post_init__(self):
        try:
            self.cpu_share  # noqa: B018 (validates the two fields)
        except ValueError as e:
            raise ValueError(f"servers[{self.name}]: {e}") from None
        if self.pool not in POOLS:
            raise ValueError(f"servers[{self.name}].pool must be one of {POOLS}, got {self.pool!r}")
        if self.pool != "decode" and self.bootstrap_port is None:
            raise ValueError(f"servers[{self.name}].bootstrap_port is required for a prefill server")
        if not 0 < self.port < 65536:
            raise ValueError(f"servers[{self.name}].port must be in 1..65535, got {self.port}")

    @property
    def mode(self) -> str:
        return "decode" if self.pool == "decode" else "prefill"

    @property
    def cpu_share(self) -> CpuShare | None:
        if self.cpu_cores is None and not self.cpus:
            return None
        return CpuShare(self.cpu_cores, tuple(self.cpus))

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"


@dataclass(frozen=True)
class Deployment:
    model: str
    servers: tuple[ServerEntry, ...]
    router: dict = field(default_factory=dict)
    transfer_backend: str = "prfaas_zmq"
    device: str = "cpu"
    server_args: tuple[str, ...] = ()
    k8s: dict = field(default_factory=dict)  # optional [k8s] section, read by `prfaas render k8s` only
    supervisor: dict = field(default_factory=dict)  # optional [supervisor] section: {"port": int}

    def __post_init__(self):
        if self.device not in DEVICES:
            raise ValueError(f"deployment.device must be one of {DEVICES}, got {self.device!r}")
        self._check_backend_device()
        if self.transfer_backend == "prfaas_zmq":
            self._check_prfaas_zmq()
        names = [s.name for s in self.servers]
        if len(set(names)) != len(names):
            raise ValueError(f"servers: duplicate names in {names}")
        for pool in ("decode",):
            if not any(s.pool == pool for s in self.servers):
                raise ValueError(f"servers: at least one server with pool = {pool!r} is required")
        if not any(s.pool != "decode" for s in self.servers):
            raise ValueError("servers: at least one prefill server (pool prfaas or local_prefill) is required")
        self._check_router_secrets()
        self._check_supervisor()

    def _check_router_secrets(self) -> None:
        found = sorted(SECRET_ROUTER_FIELDS & set(self.router))
        if found:
            where = ", ".join(SECRET_ENV.get(name, f"the router's --{name.replace('_', '-')}") for name in found)
            raise ValueError(f"[router] {', '.join(found)}: tokens do not belong in the deployment file (it is copied "
                             "to every machine and `prfaas up` writes [router] to router.json); set "
                             f"{where} in the environment of `prfaas up` on the router's machine (e.g. from a 0600 "
                             "systemd EnvironmentFile): the router inherits it")

    def _check_supervisor(self) -> None:
        if self.router.get("actuator") == "supervisor" and not self.supervisor:
            raise ValueError("router.actuator = 'supervisor' needs a [supervisor] section with its port")
        if not self.supervisor:
            return
        port = self.supervisor.get("port")
        if set(self.supervisor) != {"port"} or not isinstance(port, int) or not 0 < port < 65536:
            raise ValueError(f"[supervisor] takes one key, port (1..65535), got {self.supervisor}")
        for machine in {s.machine for s in self.switchable(None)}:
            self.supervisor_host(machine)

    def _check_backend_device(self) -> None:
        devices = BACKEND_DEVICES.get(self.transfer_backend)
        if devices is None:
            raise ValueError(f"deployment.transfer_backend must be one of {sorted(BACKEND_DEVICES)}, "
                             f"got {self.transfer_backend!r}")
        if self.device not in devices:
            raise ValueError(f"deployment.transfer_backend = {self.transfer_backend!r} runs on device "
                             f"{' or '.join(map(repr, devices))}, not {self.device!r}: use 'prfaas_zmq'")

    def _check_prfaas_zmq(self) -> None:
        """What `PrfaasKVManager` would refuse at start-up, refused here when the file is read."""
        for s in self.servers:
            args = self.server_args + s.args
            if not is_loopback(s.host) and not {"--prfaas-zmq-curve-keys", "--prfaas-zmq-insecure"} & set(args):
                raise ValueError(f"servers[{s.name}]: host {s.host} is routable, so prfaas_zmq needs keys: add "
                                 "'--prfaas-zmq-curve-keys', DIR (made by `prfaas keys DIR`) to server_args, or "
                                 "'--prfaas-zmq-insecure' on a trusted network")

    def on(self, machine: str | None) -> tuple[ServerEntry, ...]:
        return tuple(s for s in self.servers if machine is None or s.machine == machine)

    def switchable(self, machine: str | None) -> tuple[ServerEntry, ...]:
        """Servers a supervisor may restart in the other role: the local ones (a PrfaaS prefill stays one)."""
        return tuple(s for s in self.on(machine) if s.pool in ("local_prefill", "decode"))

    def supervisor_host(self, machine: str | None) -> str:
        """Where ``machine``'s supervisor listens: the one host its local servers use."""
        hosts = {s.host for s in self.switchable(machine)}
        if len(hosts) != 1:
            raise ValueError(f"[supervisor]: the local servers of machine {machine!r} use hosts {sorted(hosts)}; "
                             "a machine's supervisor listens on its servers' one host")
        return hosts.pop()

    def router_on(self, machine: str | None) -> bool:
        return bool(self.router) and (machine is None or self.router.get("machine") == machine)

    def router_fields(self, tokenizer_path: str) -> dict:
        """RouterConfig fields: the router section plus the server lists derived from `servers`."""
        out = public_router_fields(self.router, frozenset({"machine"}))
        for pool in POOLS:
            out[pool] = [
                {"url": s.url, "name": s.name, **({"bootstrap_port": s.bootstrap_port} if s.bootstrap_port else {})}
                for s in self.servers if s.pool == pool
            ]
        if self.supervisor:
            port = self.supervisor["port"]
            out.setdefault("supervisor_urls", ",".join(
                f"{s.name}=http://{_url_host(self.supervisor_host(s.machine))}:{port}" for s in self.switchable(None)))
        out.setdefault("tokenizer_path", tokenizer_path)
        return out


def _url_host(host: str) -> str:
    return f"[{host}]" if ":" in host else host


def load(path: str | Path) -> Deployment:
    raw = tomllib.loads(Path(path).read_text())
    return parse(raw)


def parse(raw: dict) -> Deployment:
    dep = dict(raw.get("deployment", {}))
    if "model" not in dep:
        raise ValueError("deployment.model is required (a model directory or 'tiny:<name>')")
    servers = tuple(
        ServerEntry(**{**s, "args": tuple(s.get("args", ())), "cpus": tuple(s.get("cpus", ()))})
        for s in raw.get("servers", [])
    )
    device = dep.get("device", "cuda")
    return Deployment(
        model=dep["model"], servers=servers, router=dict(raw.get("router", {})),
        transfer_backend=dep.get("transfer_backend", DEFAULT_BACKEND.get(device, "prfaas_zmq")), device=device,
        server_args=tuple(dep.get("server_args", ())), k8s=dict(raw.get("k8s", {})),
        supervisor=dict(raw.get("supervisor", {})),
    )
