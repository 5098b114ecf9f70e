"""The router: ConfigMap (router.json), Deployment, Service, and the RBAC its Kubernetes actuator needs.

The router lists every ordinal a role switch can bring up (`Role.max_replicas`), by stable pod DNS name: a
pod that does not exist yet fails its health probes and stays out of rotation until the actuator scales its
StatefulSet up, so the router needs no new configuration when the split changes. No token is ever in the
ConfigMap (every secret RouterConfig field is dropped): the admin token reaches the router as
PRFAAS_ROUTER_ADMIN_TOKEN from a Secret.
"""
from __future__ import annotations

from prfaas_sgl.tools.deploy.config import public_router_fields
from prfaas_sgl.tools.deploy.k8s.keys import ADMIN_KEY, ADMIN_SECRET
from prfaas_sgl.tools.deploy.k8s import pods
from prfaas_sgl.tools.deploy.k8s.servers import MODEL_CACHE, labels, probes, selector, volumes
from prfaas_sgl.tools.deploy.k8s.topology import LOCAL, Model, Role, Topology
from prfaas_sgl.router.config import ADMIN_TOKEN_ENV

NAME = "prfaas-router"
DROPPED = frozenset({"machine", "host", "port", "prfaas", "local_prefill", "decode"})  # the pods' own values
CONFIG_DIR = "/etc/prfaas/router"


def router_port(topo: Topology) -> int:
    return int(topo.dep.router.get("port", 8000))


def router_fields(topo: Topology, model: Model) -> dict:
    """router.json: the file's [router] section with the server lists of the pods."""
    fields = public_router_fields(topo.dep.router, DROPPED)
    fields.update(host="0.0.0.0", port=router_port(topo))  # a pod's own address; the Service fronts it
    for pool in ("prfaas", "local_prefill", "decode"):
        role = topo.role(pool)
        fields[pool] = [_instance(role, i) for i in range(role.max_replicas)] if role else []
    if not model.tiny:
        fields["tokenizer_path"] = model.name
    stats = topo.role("prfaas") and topo.role("prfaas").flag("--prfaas-zmq-stats-port")
    if stats and "transport_stats_url" not in fields:
        remote = topo.role("prfaas")
        fields["transport_stats_url"] = ",".join(f"http://{remote.host(i)}:{stats}/stats"
                                                 for i in range(remote.max_replicas))
    return fields


def _instance(role: Role, i: int) -> dict:
    out = {"url": f"http://{role.host(i)}:{role.port}", "name": f"{role.name}-{i}"}
    return {**out, "bootstrap_port": role.bootstrap_port} if role.bootstrap_port else out


def configmap(topo: Topology, router_json: str) -> dict:
    return {"apiVersion": "v1", "kind": "ConfigMap",
            "metadata": {"name": NAME, "namespace": topo.namespaces[LOCAL], "labels": labels("router", NAME, LOCAL)},
            "data": {"router.json": router_json}}


def _command(model: Model) -> list[str]:
    base = f"exec python -m prfaas_sgl.launch_router --config {CONFIG_DIR}/router.json"
    if model.tiny:  # `$$`: a literal `$` past the kubelet's $(NAME) expansion
        tiny = f"python -m prfaas_sgl.tools.models.tiny {model.tiny} | cut -f2"
        return ["sh", "-c", f'{base} --tokenizer-path "$$({tiny})"']
    return ["sh", "-c", base]


def deployment(topo: Topology, model: Model) -> dict:
    """One replica: the router runs the controller, and two controllers would scale against each other."""
    ns = topo.namespaces[LOCAL]
    vols, mounts = volumes(topo, None, model, None)
    vols = [v for v in vols if v["name"] != "dshm"] + [{"name": "config", "configMap": {"name": NAME}}]
    mounts = [m for m in mounts if m["name"] != "dshm"] + [{"name": "config", "mountPath": CONFIG_DIR,
                                                            "readOnly": True}]
    env = [{"name": ADMIN_TOKEN_ENV, "valueFrom": {"secretKeyRef": {"name": ADMIN_SECRET, "key": ADMIN_KEY}}},
           {"name": "PRFAAS_K8S_NAMESPACE", "valueFrom": {"fieldRef": {"fieldPath": "metadata.namespace"}}},
           *pods.writable_env()]
    if model.tiny:
        env.append({"name": "PRFAAS_MODEL_CACHE", "value": MODEL_CACHE})
    container = {"name": "router", "image": topo.image, "command": _command(model), "env": env,
                 "ports": [{"name": "http", "containerPort": router_port(topo)}], "volumeMounts": mounts,
                 "securityContext": pods.CONTAINER_SECURITY,
                 "resources": pods.resources(topo.dep.k8s, "router", topo.dep.device), **probes("http", startup_s=300)}
    meta = labels("router", NAME, LOCAL)
    return {"apiVersion": "apps/v1", "kind": "Deployment",
            "metadata": {"name": NAME, "namespace": ns, "labels": meta},
            "spec": {"replicas": 1, "strategy": {"type": "Recreate"}, "selector": {"matchLabels": selector(NAME)},
                     "template": {"metadata": {"labels": meta},
                                  "spec": {"securityContext": pods.pod_security(topo.dep.k8s),
                                           "serviceAccountName": NAME, "containers": [container],
                                           "volumes": vols}}}}


def service(topo: Topology) -> dict:
    return {"apiVersion": "v1", "kind": "Service",
            "metadata": {"name": NAME, "namespace": topo.namespaces[LOCAL], "labels": labels("router", NAME, LOCAL)},
            "spec": {"selector": selector(NAME),
                     "ports": [{"name": "http", "port": router_port(topo), "targetPort": "http"}]}}


def rbac(topo: Topology) -> list[dict]:
    """Least privilege for the Kubernetes actuator: read and patch the scale of the local roles only."""
    ns, meta = topo.namespaces[LOCAL], {"name": NAME, "namespace": topo.namespaces[LOCAL]}
    names = [r.name for r in topo.dc_roles(LOCAL)]
    rule = {"apiGroups": ["apps"], "resources": ["statefulsets/scale"], "resourceNames": names,
            "verbs": ["get", "patch"]}
    return [
        {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": meta},
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "Role", "metadata": meta, "rules": [rule]},
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding", "metadata": meta,
         "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": NAME},
         "subjects": [{"kind": "ServiceAccount", "name": NAME, "namespace": ns}]},
    ]
