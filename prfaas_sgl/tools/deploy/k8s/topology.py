"""What a deployment file means on Kubernetes: datacenters, one StatefulSet per (datacenter, role), model source.

The datacenter of a server is its pool: `prfaas` servers are the remote PrfaaS prefill cluster, `local_prefill`
and `decode` servers are the local PD cluster, and the router sits with the local cluster (it answers users
and sends them their decode stream). No file field is needed for it. The optional `[k8s]` section:

    [k8s]
    image = "registry.example/prfaas-sgl:0.1.0"   # an image with prfaas-sgl[sglang] installed
    model_pvc = "models"        # mount this PVC, read-only, at the model path (a model directory needs it)
    model_host_path = false     # true: mount the node's directory instead (hostPath; Pod Security
                                # 'baseline' and 'restricted' refuse it, so the namespaces get no
                                # 'restricted' label)
    namespaces = { remote = "prfaas-remote", local = "prfaas-local" }
    render_secrets = true       # false: no 10-secrets.yaml; create its Secrets from a sealed or external store
    run_as_user = 1000, [k8s.resources.POOL]: see pods.py
"""
from __future__ import annotations

import json
import tempfile
from dataclasses import dataclass
from pathlib import Path

from prfaas_sgl.tools.deploy.config import Deployment, ServerEntry

REMOTE, LOCAL = "remote", "local"
DC_OF_POOL = {"prfaas": REMOTE, "local_prefill": LOCAL, "decode": LOCAL}
STS_OF_POOL = {"prfaas": "prfaas-prefill", "local_prefill": "prefill", "decode": "decode"}
DEFAULT_IMAGE = "prfaas-sgl:0.1.0"
DEFAULT_DATA_PORT = 17000  # decode's prfaas_zmq data port when the file leaves it to the OS (0): a
#                            NetworkPolicy can only open a port it knows
ZMQ_CONTROL_PORTS = (49152, 65535)  # SGLang binds its PD control sockets with zmq's bind_to_random_port
K8S_KEYS = {"image", "model_pvc", "model_host_path", "namespaces", "render_secrets", "run_as_user", "resources"}


@dataclass(frozen=True)
class Role:
    """One StatefulSet: the servers of one pool in one datacenter."""

    name: str  # StatefulSet, headless Service and pod-name prefix
    pool: str
    dc: str
    namespace: str
    replicas: int  # servers the file lists
    max_replicas: int  # ordinals the router lists: what a role switch can grow the pool to
    port: int
    bootstrap_port: int | None
    args: tuple[str, ...]  # deployment server_args + the pool's server args
    machines: tuple[str, ...]  # nodes the pods may run on

    @property
    def mode(self) -> str:
        return "decode" if self.pool == "decode" else "prefill"

    def host(self, ordinal: int) -> str:
        """Stable DNS name of pod `ordinal` (StatefulSet pod behind its headless Service)."""
        return f"{self.name}-{ordinal}.{self.name}.{self.namespace}.svc.cluster.local"

    def flag(self, name: str, default: str | None = None) -> str | None:
        args = list(self.args)
        return args[args.index(name) + 1] if name in args[:-1] else default

    @property
    def gpus(self) -> int:
        return int(self.flag("--tp-size") or self.flag("--tp") or 1)


@dataclass(frozen=True)
class Topology:
    dep: Deployment
    roles: tuple[Role, ...]
    namespaces: dict[str, str]
    image: str

    def dc_roles(self, dc: str) -> tuple[Role, ...]:
        return tuple(r for r in self.roles if r.dc == dc)

    def role(self, pool: str) -> Role | None:
        return next((r for r in self.roles if r.pool == pool), None)

    @property
    def datacenters(self) -> tuple[str, ...]:
        return tuple(dc for dc in (REMOTE, LOCAL) if self.dc_roles(dc))


def topology(dep: Deployment) -> Topology:
    unknown = set(dep.k8s) - K8S_KEYS
    if unknown:
        raise ValueError(f"[k8s]: unknown keys {sorted(unknown)}; known: {sorted(K8S_KEYS)}")
    for key in ("model_host_path", "render_secrets"):
        if not isinstance(dep.k8s.get(key, False), bool):
            raise ValueError(f"[k8s] {key} must be true or false, got {dep.k8s[key]!r}")
    _check_model_volume(dep)
    namespaces = {REMOTE: "prfaas-remote", LOCAL: "prfaas-local", **dep.k8s.get("namespaces", {})}
    local = [s for s in dep.servers if DC_OF_POOL[s.pool] == LOCAL]
    roles = []
    for pool in ("prfaas", "local_prefill", "decode"):
        servers = [s for s in dep.servers if s.pool == pool]
        if servers:
            dc = DC_OF_POOL[pool]
            peers = local if dc == LOCAL else servers  # local servers may take either local role
            roles.append(_role(dep, pool, servers, namespaces[dc], peers))
    return Topology(dep, tuple(roles), namespaces, dep.k8s.get("image", DEFAULT_IMAGE))


def _check_model_volume(dep: Deployment) -> None:
    """A model directory comes from a PVC; a node's directory (hostPath) only when the file says so."""
    pvc, host = dep.k8s.get("model_pvc"), dep.k8s.get("model_host_path", False)
    if dep.model.startswith("tiny:") or bool(pvc) != host:
        return
    if pvc:
        raise ValueError("[k8s]: model_pvc and model_host_path = true contradict each other: give one")
    raise ValueError(f"deployment.model {dep.model!r} is a directory: on Kubernetes set [k8s] model_pvc = CLAIM (a "
                     "PersistentVolumeClaim holding it, mounted read-only), or model_host_path = true to mount the "
                     "node's directory (hostPath, refused by Pod Security 'baseline' and 'restricted')")


def host_path_model(dep: Deployment) -> bool:
    return not dep.model.startswith("tiny:") and dep.k8s.get("model_host_path", False)


def _role(dep: Deployment, pool: str, servers: list[ServerEntry], namespace: str, peers: list[ServerEntry]) -> Role:
    first = servers[0]
    for s in servers[1:]:  # one pod template per pool
        for attr in ("port", "bootstrap_port", "args"):
            if _same(getattr(s, attr)) != _same(getattr(first, attr)):
                raise ValueError(f"servers[{s.name}].{attr} differs from servers[{first.name}]: Kubernetes runs "
                                 f"pool {pool!r} as one StatefulSet, so its servers must share it")
    dc = DC_OF_POOL[pool]
    other_role = 1 if dc == LOCAL and {p.pool for p in peers} == {"local_prefill", "decode"} else 0
    args = dep.server_args + first.args
    if dep.transfer_backend == "prfaas_zmq" and not {"--prfaas-zmq-curve-keys", "--prfaas-zmq-insecure"} & set(args):
        raise ValueError(f"servers[{first.name}]: on Kubernetes a server binds its pod IP, never loopback, so "
                         "prfaas_zmq needs '--prfaas-zmq-curve-keys', DIR (the Secret is mounted there)")
    if pool == "decode" and dep.transfer_backend == "prfaas_zmq" and "--prfaas-zmq-data-port" not in args:
        args += ("--prfaas-zmq-data-port", str(DEFAULT_DATA_PORT))
    machines = tuple(dict.fromkeys(p.machine for p in peers))
    return Role(STS_OF_POOL[pool], pool, dc, namespace, len(servers), len(peers) - other_role, first.port,
                first.bootstrap_port, args, machines)


def _same(value):
    """Values that must agree across a pool; a server's own stats address is replaced by its pod IP anyway."""
    if isinstance(value, tuple) and "--prfaas-zmq-stats-host" in value[:-1]:
        i = value.index("--prfaas-zmq-stats-host") + 1
        return value[:i] + ("POD_IP",) + value[i + 1:]
    return value


@dataclass(frozen=True)
class Model:
    """Where the model is in a pod, and a local directory whose config.json says whether it is hybrid."""

    name: str  # "tiny:<name>" or a path
    probe_dir: str

    @property
    def tiny(self) -> str | None:
        return self.name.removeprefix("tiny:") if self.name.startswith("tiny:") else None


def model_source(dep: Deployment) -> Model:
    """Tiny models are built in the pod at start (seconds, seeded), so only their spec is read here: the
    CPU flags depend on whether the model is hybrid (`prfaas_sgl.tools.launch.is_hybrid` reads config.json)."""
    if not dep.model.startswith("tiny:"):
        if dep.device == "cpu" and not (Path(dep.model) / "config.json").is_file():
            raise ValueError(f"deployment.model {dep.model!r}: a CPU deployment's flags depend on the model's "
                             "config.json; render on a machine that has the model directory")
        return Model(dep.model, dep.model)
    from prfaas_sgl.tools.models.tiny import SPECS

    name = dep.model.removeprefix("tiny:")
    if name not in SPECS:
        raise ValueError(f"deployment.model {dep.model!r}: unknown tiny model; known: {sorted(SPECS)}")
    probe = Path(tempfile.mkdtemp(prefix="prfaas-k8s-"))
    (probe / "config.json").write_text(json.dumps(SPECS[name].config))
    return Model(dep.model, str(probe))
