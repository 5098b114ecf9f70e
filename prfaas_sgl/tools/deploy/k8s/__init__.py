"""`prfaas render k8s`: the Kubernetes manifests of a deployment file, one directory per datacenter.

    OUT/keys/                CURVE keys (`prfaas keys` layout) and the router admin token, made once, 0600
    OUT/<dc>/00-namespace.yaml   labelled for Pod Security 'restricted' (unless the model is a hostPath)
    OUT/<dc>/10-secrets.yaml   CURVE keys per role, admin token (0600: it holds key material)
    OUT/<dc>/20-servers.yaml   a StatefulSet + headless Service per role
    OUT/<dc>/25-tier-store.yaml  mooncake_master Deployment + Service, when a pool's storage tier is
                               mooncake (tiers.py: tier flags, the tier key Secret, their policies)
    OUT/<dc>/30-router.yaml    router ConfigMap, Deployment, Service, RBAC (local datacenter)
    OUT/<dc>/40-networkpolicy.yaml   default deny, ingress and egress, then each flow the pods use

10-secrets.yaml is key material in base64, which is not encryption: never commit it. With GitOps, keep the
keys in a sealed or external secret store (Sealed Secrets, External Secrets Operator, a CSI secret store) and
set `[k8s] render_secrets = false`: the file is then left out, and the store must provide Secrets of the
same names and keys (`keys.SECRET_NAME`, `keys.FILES` with `/` as `.`, `keys.ADMIN_SECRET`/`token`).
Every pod runs non-root on a read-only root filesystem with requests and limits (pods.py).

Apply with `kubectl apply -f OUT/<dc>/` in each datacenter's context (or both into one stretched cluster).
The networking assumption, SGLang's: a PD peer is told the pod's IP and connects to it on fixed ports (HTTP,
bootstrap, KV data) and on random ZMQ control ports, so pod IPs must be routable between the datacenters
(one cluster spanning both, or clusters with routed pod networks); Services only name pods.
"""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import yaml

from prfaas_sgl.tools.deploy.config import Deployment
from prfaas_sgl.tools.deploy.k8s import keys, netpol, router, servers, tiers
from prfaas_sgl.tools.deploy.k8s.topology import LOCAL, Model, Topology, host_path_model, model_source, topology

HEADER = "# rendered by `prfaas render k8s`; edit the deployment file and render again\n"
SECRETS_HEADER = ("# KEY MATERIAL (base64 is not encryption): do not commit this file. Keep these Secrets in a sealed or\n"
                  "# external secret store and set [k8s] render_secrets = false to stop rendering it.\n")


def render(dep: Deployment, out: Path) -> list[Path]:
    """Write the manifests of `dep` under `out`; returns the files written (keys excluded)."""
    topo = topology(dep)
    model = model_source(dep)
    try:
        written = []
        for dc in topo.datacenters:
            files = manifests(topo, model, dc, out)
            for name, docs in files.items():
                written.append(_write(out / dc / name, docs, secret=name.startswith("10-")))
            if "10-secrets.yaml" not in files:  # an earlier render's keys must not be applied with the rest
                (out / dc / "10-secrets.yaml").unlink(missing_ok=True)
        return written
    finally:
        if model.tiny:
            shutil.rmtree(model.probe_dir, ignore_errors=True)


def manifests(topo: Topology, model: Model, dc: str, out: Path) -> dict[str, list[dict]]:
    """File name -> documents for datacenter `dc`."""
    roles = topo.dc_roles(dc)
    secrets, names = _secrets(topo, dc, out)
    files = {
        "00-namespace.yaml": [namespace(topo, dc)],
        "10-secrets.yaml": secrets,
        "20-servers.yaml": [doc for r in roles for doc in (servers.headless_service(topo, r),
                                                            servers.statefulset(topo, r, model, names.get(r.mode)))],
        "25-tier-store.yaml": tiers.master_docs(topo, dc),
    }
    if dc == LOCAL:
        cfg = json.dumps(router.router_fields(topo, model), indent=2)
        files["30-router.yaml"] = [router.configmap(topo, cfg), *router.rbac(topo), router.deployment(topo, model),
                                   router.service(topo)]
    files["40-networkpolicy.yaml"] = netpol.policies(topo, dc) + tiers.policies(topo, dc)
    return {k: v for k, v in files.items() if v}


def namespace(topo: Topology, dc: str) -> dict:
    labels = {"app.kubernetes.io/name": "prfaas", "prfaas.io/datacenter": dc}
    if not host_path_model(topo.dep):  # every pod passes 'restricted': let the API server hold them to it
        labels["pod-security.kubernetes.io/enforce"] = "restricted"
    return {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": topo.namespaces[dc], "labels": labels}}


def _secrets(topo: Topology, dc: str, out: Path) -> tuple[list[dict], dict[str, str]]:
    """The datacenter's Secrets (none with render_secrets = false), and the CURVE Secret name per role that
    mounts one."""
    rendered = topo.dep.k8s.get("render_secrets", True)
    docs, names = [], {}
    for role in topo.dc_roles(dc):
        if servers.keys_mount(topo, role) and role.mode not in names:
            if rendered:
                docs.append(keys.curve_secret(keys.curve_dir(out), role.mode, role.namespace))
            names[role.mode] = keys.SECRET_NAME[role.mode]
    if dc == LOCAL and rendered:
        docs.append(keys.admin_secret(keys.admin_token(out), topo.namespaces[LOCAL]))
    if rendered and any(tiers.needs_key(r) for r in topo.dc_roles(dc)):
        docs.append(tiers.key_secret(out, topo.namespaces[dc]))
    return docs, names


class _Dumper(yaml.SafeDumper):
    def ignore_aliases(self, data) -> bool:  # shared label dicts print in full, not as &id001 anchors
        return True


def _str(dumper: yaml.SafeDumper, data: str) -> yaml.Node:
    style = "|" if "\n" in data else None  # router.json reads as JSON, not as an escaped one-line string
    return dumper.represent_scalar("tag:yaml.org,2002:str", data, style=style)


_Dumper.add_representer(str, _str)


def _write(path: Path, docs: list[dict], secret: bool) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    text = HEADER + (SECRETS_HEADER if secret else "")
    text += yaml.dump_all(docs, Dumper=_Dumper, sort_keys=False, default_flow_style=False)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600 if secret else 0o644)
    with os.fdopen(fd, "w") as f:
        f.write(text)
    path.chmod(0o600 if secret else 0o644)  # O_CREAT's mode only applies to a new file
    return path
