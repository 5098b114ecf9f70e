"""prfaas_hybrid's lower tiers on Kubernetes: what the `--prfaas-tier-*` flags in a pool's args need.

    --prfaas-tier-host-bytes N        the pod's memory request and limit grow by N (the host tier is
                                      process memory: a limit below it is an OOM kill)
    --prfaas-tier-storage file        an emptyDir at --prfaas-tier-storage-path (sizeLimit: the tier's bound),
                                      unless that path is already a writable emptyDir (/tmp, $HOME)
    --prfaas-tier-storage mooncake    a `mooncake-master` Deployment + Service (the Mooncake wheel in the image
                                      ships `mooncake_master`) in the local datacenter, or the remote one if only
                                      it uses the tier; the servers are pointed at its Service unless the file
                                      names a master (--prfaas-tier-mooncake-master: an external one, not rendered)
    the tier key                      a master off loopback needs one (else the server leaves the store out), so
                                      --prfaas-tier-key is added when the file gives none; the key is made once
                                      under OUT/keys/tier.secret and mounted from the `prfaas-tier-key` Secret
                                      like the CURVE keys (root-owned 0440, read through fsGroup)

Network: the store's clients (prefill pods with the tier) reach the master's RPC port, and read entries from
each other's Mooncake segments on ports Mooncake picks itself, so between those pods the policy is by label,
not by port (as with the Mooncake PD transfer backend).
"""
from __future__ import annotations

import base64
import os
from pathlib import Path

from prfaas_sgl.tools.deploy.k8s import pods
from prfaas_sgl.tools.deploy.k8s.topology import LOCAL, REMOTE, Role, Topology

MASTER = "mooncake-master"
MASTER_RPC_PORT = 50051
MASTER_METRICS_PORT = 9003
KEY_SECRET = "prfaas-tier-key"
KEY_DIR = "/etc/prfaas-tier"  # where the key is mounted when the file names no --prfaas-tier-key
EMPTYDIR_PATHS = ("/tmp", pods.HOME)  # already writable emptyDirs (pods.writable_volumes)


def storage(role: Role) -> str:
    return role.flag("--prfaas-tier-storage", "none")


def mooncake_roles(topo: Topology) -> list[Role]:
    return [r for r in topo.roles if storage(r) == "mooncake"]


def master_dc(topo: Topology) -> str | None:
    """Where the rendered master runs: None if no pool uses a Mooncake tier or every one names its own."""
    dcs = {r.dc for r in mooncake_roles(topo) if not r.flag("--prfaas-tier-mooncake-master")}
    return (LOCAL if LOCAL in dcs else REMOTE) if dcs else None


def master_addr(topo: Topology) -> str:
    return f"{MASTER}.{topo.namespaces[master_dc(topo)]}.svc.cluster.local:{MASTER_RPC_PORT}"


def needs_key(role: Role) -> bool:
    return storage(role) == "mooncake" or bool(role.flag("--prfaas-tier-key"))


def key_path(role: Role) -> str:
    return role.flag("--prfaas-tier-key") or f"{KEY_DIR}/tier.secret"


def pod_args(topo: Topology, role: Role, args: tuple[str, ...]) -> tuple[str, ...]:
    """The server's args plus what the tiers need on Kubernetes: the rendered master, the key's path."""
    out = list(args)
    if storage(role) == "mooncake" and not role.flag("--prfaas-tier-mooncake-master"):
        out += ["--prfaas-tier-mooncake-master", master_addr(topo)]
    if needs_key(role) and not role.flag("--prfaas-tier-key"):
        out += ["--prfaas-tier-key", key_path(role)]
    return tuple(out)


def volumes(role: Role) -> tuple[list[dict], list[dict]]:
    """(volumes, mounts): the tier key, and the file tier's directory if it is not writable already."""
    vols, mounts = [], []
    if needs_key(role):
        path = key_path(role)
        vols.append({"name": "tier-key", "secret": {"secretName": KEY_SECRET, "defaultMode": 0o440,
                                                    "items": [{"key": "tier.secret", "path": os.path.basename(path)}]}})
        mounts.append({"name": "tier-key", "mountPath": os.path.dirname(path), "readOnly": True})
    if storage(role) == "file":
        path = role.flag("--prfaas-tier-storage-path", "/tmp/prfaas-tiers")
        if not any(path == p or path.startswith(p + "/") for p in EMPTYDIR_PATHS):
            limit = int(role.flag("--prfaas-tier-storage-bytes", "0"))
            vols.append({"name": "tier-storage", "emptyDir": {"sizeLimit": str(limit)} if limit else {}})
            mounts.append({"name": "tier-storage", "mountPath": path})
    return vols, mounts


def resources(role: Role, res: dict) -> dict:
    """`res` (pods.resources) with the host tier's bytes added to the memory request and limit."""
    extra = int(role.flag("--prfaas-tier-host-bytes", "0"))
    if not extra:
        return res
    return {kind: {**v, "memory": str(int(pods._amount(v["memory"]) + extra))} for kind, v in res.items()}


def key_secret(out: Path, namespace: str) -> dict:
    """The `prfaas-tier-key` Secret; the key is made once under OUT/keys (0600) and re-used by later renders."""
    from prfaas_sgl.cachepool.tiers.auth import KEY_FILE, write_key

    root = out / "keys"
    root.mkdir(parents=True, exist_ok=True)
    root.chmod(0o700)
    path = root / KEY_FILE
    if not path.is_file():
        write_key(str(path))
    return {"apiVersion": "v1", "kind": "Secret", "type": "Opaque",
            "metadata": {"name": KEY_SECRET, "namespace": namespace, "labels": {"app.kubernetes.io/name": "prfaas"}},
            "data": {"tier.secret": base64.b64encode(path.read_bytes()).decode()}}


def master_docs(topo: Topology, dc: str) -> list[dict]:
    """The mooncake_master Deployment and Service, in the datacenter that runs it."""
    if master_dc(topo) != dc:
        return []
    ns, labels = topo.namespaces[dc], _labels(dc)
    container = {
        "name": "mooncake-master", "image": topo.image, "command": ["mooncake_master"],
        "args": [f"--rpc_port={MASTER_RPC_PORT}", "--rpc_address=0.0.0.0", f"--metrics_port={MASTER_METRICS_PORT}"],
        "ports": [{"name": "rpc", "containerPort": MASTER_RPC_PORT},
                  {"name": "metrics", "containerPort": MASTER_METRICS_PORT}],
        "securityContext": pods.CONTAINER_SECURITY,
        "resources": {"requests": {"cpu": "1", "memory": "1Gi"}, "limits": {"cpu": "4", "memory": "4Gi"}},
        "readinessProbe": {"tcpSocket": {"port": "rpc"}, "periodSeconds": 5},
        "livenessProbe": {"tcpSocket": {"port": "rpc"}, "periodSeconds": 20, "failureThreshold": 6},
    }
    deployment = {
        "apiVersion": "apps/v1", "kind": "Deployment",
        "metadata": {"name": MASTER, "namespace": ns, "labels": labels},
        "spec": {"replicas": 1, "selector": {"matchLabels": {"app.kubernetes.io/instance": MASTER}},
                 "strategy": {"type": "Recreate"},  # one master: two would split the store's metadata
                 "template": {"metadata": {"labels": labels}, "spec": {
                     "securityContext": pods.pod_security(topo.dep.k8s), "automountServiceAccountToken": False,
                     "containers": [container]}}},
    }
    service = {"apiVersion": "v1", "kind": "Service", "metadata": {"name": MASTER, "namespace": ns, "labels": labels},
               "spec": {"selector": {"app.kubernetes.io/instance": MASTER},
                        "ports": [{"name": "rpc", "port": MASTER_RPC_PORT, "targetPort": "rpc"},
                                  {"name": "metrics", "port": MASTER_METRICS_PORT, "targetPort": "metrics"}]}}
    return [deployment, service]


def _labels(dc: str) -> dict[str, str]:
    return {"app.kubernetes.io/name": "prfaas", "app.kubernetes.io/instance": MASTER,
            "app.kubernetes.io/component": "tier-store", "prfaas.io/datacenter": dc}


def _peer(topo: Topology, role: Role) -> dict:
    return {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": role.namespace}},
            "podSelector": {"matchLabels": {"app.kubernetes.io/instance": role.name}}}


def policies(topo: Topology, dc: str) -> list[dict]:
    """NetworkPolicies (added to the default deny): clients -> the master's RPC port; clients <-> clients
    on any port (Mooncake segment reads). None without a rendered master."""
    home = master_dc(topo)
    clients = [r for r in mooncake_roles(topo) if not r.flag("--prfaas-tier-mooncake-master")]
    if home is None:
        return []
    ns, peers, rpc = topo.namespaces[dc], [_peer(topo, r) for r in clients], [{"protocol": "TCP", "port": MASTER_RPC_PORT}]
    master = {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": topo.namespaces[home]}},
              "podSelector": {"matchLabels": {"app.kubernetes.io/instance": MASTER}}}
    out = []
    if dc == home:
        out.append(_policy(f"{MASTER}-ingress", ns, {"app.kubernetes.io/instance": MASTER}, "Ingress",
                           [{"from": peers, "ports": rpc}]))
    for r in (r for r in clients if r.dc == dc):
        pod = {"app.kubernetes.io/instance": r.name}
        out.append(_policy(f"{r.name}-tier-egress", ns, pod, "Egress", [{"to": [master], "ports": rpc}, {"to": peers}]))
        out.append(_policy(f"{r.name}-tier-ingress", ns, pod, "Ingress", [{"from": peers}]))
    return out


def _policy(name: str, ns: str, pod: dict, kind: str, rules: list[dict]) -> dict:
    return {"apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy",
            "metadata": {"name": name, "namespace": ns, "labels": {"app.kubernetes.io/name": "prfaas"}},
            "spec": {"podSelector": {"matchLabels": pod}, "policyTypes": [kind], kind.lower(): rules}}
