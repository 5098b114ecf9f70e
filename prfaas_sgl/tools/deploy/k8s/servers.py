"""Prefill and decode servers: one StatefulSet and one headless Service per role.

StatefulSets, not Deployments: a pod keeps its name and DNS record (`decode-1.decode.NS.svc...`) across
restarts, so the router's server list is fixed ahead of time (ordinals 0..max_replicas-1) and scaling
adds or removes the highest ordinal, the one the router can tell apart; every pod has its own IP, so each
keeps the file's bootstrap port. `Parallel` pod management lets a role switch start a pod without waiting
for its siblings' ordering.
"""
from __future__ import annotations

from prfaas_sgl.tools.deploy.k8s import pods, tiers
from prfaas_sgl.tools.deploy.k8s.topology import Model, Role, Topology, host_path_model
from prfaas_sgl.tools.launch import ServerSpec, server_args

POD_IP = "$(POD_IP)"  # expanded by the kubelet from the env var of the same name
MODEL_CACHE = "/var/cache/prfaas-models"  # tiny models are built here at pod start


def labels(role: str, name: str, dc: str, pool: str | None = None) -> dict[str, str]:
    out = {"app.kubernetes.io/name": "prfaas", "app.kubernetes.io/instance": name,
           "app.kubernetes.io/component": role, "prfaas.io/datacenter": dc}
    return {**out, "prfaas.io/pool": pool} if pool else out


def selector(name: str) -> dict[str, str]:
    return {"app.kubernetes.io/name": "prfaas", "app.kubernetes.io/instance": name}


def sglang_command(topo: Topology, role: Role, model: Model) -> tuple[list[str], list[str]]:
    """(command, args) of the server container: the flags `prfaas up` gives the same server
    (`prfaas_sgl.tools.launch.server_args`), bound to the pod's IP."""
    dep = topo.dep
    spec = ServerSpec(model_path=model.probe_dir, port=role.port, host=POD_IP, mode=role.mode,
                      transfer_backend=dep.transfer_backend, bootstrap_port=role.bootstrap_port,
                      extra_args=tiers.pod_args(topo, role, _pod_args(role.args)), device=dep.device)
    args = server_args(spec)
    i = args.index("--model-path") + 1
    if model.tiny:  # the path holds the spec's digest: let the image's own code say where it built it
        del args[i - 1:i + 1]
        # `$$` is the kubelet's escape for a literal `$`: it expands `$(NAME)` in command and args
        script = (f'exec python -m sglang.launch_server --model-path "$$(python -m prfaas_sgl.tools.models.tiny '
                  f'{model.tiny} | cut -f2)" "$@"')
        return ["sh", "-c", script, "sglang"], args
    args[i] = model.name
    return ["python", "-m", "sglang.launch_server"], args


def _pod_args(args: tuple[str, ...]) -> tuple[str, ...]:
    """The stats endpoint binds an address of this pod, whatever host the file named."""
    out = list(args)
    if "--prfaas-zmq-stats-host" in out[:-1]:
        out[out.index("--prfaas-zmq-stats-host") + 1] = POD_IP
    return tuple(out)


def server_env(topo: Topology, model: Model) -> list[dict]:
    """`prfaas_sgl.tools.launch.server_env` for a pod: SGLANG_HOST_IP (the address a PD peer is told) is the
    pod IP."""
    env = [{"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
           {"name": "SGLANG_HOST_IP", "value": POD_IP}, {"name": "PYTHONUNBUFFERED", "value": "1"},
           *pods.writable_env()]
    if model.tiny:
        env.append({"name": "PRFAAS_MODEL_CACHE", "value": MODEL_CACHE})
    if topo.dep.device == "cpu":
        env += [{"name": "SGLANG_USE_CPU_ENGINE", "value": "1"}, {"name": "MC_FORCE_TCP", "value": "1"},
                {"name": "SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION", "value": "0"}]
    return env


def container_ports(topo: Topology, role: Role) -> list[dict]:
    ports = [{"name": "http", "containerPort": role.port}]
    if role.bootstrap_port:
        ports.append({"name": "bootstrap", "containerPort": role.bootstrap_port})
    if role.mode == "decode" and topo.dep.transfer_backend == "prfaas_zmq":
        ports.append({"name": "kv-data", "containerPort": int(role.flag("--prfaas-zmq-data-port"))})
    stats = int(role.flag("--prfaas-zmq-stats-port") or 0)
    if stats:
        ports.append({"name": "zmq-stats", "containerPort": stats})
    return ports


def keys_mount(topo: Topology, role: Role) -> str | None:
    """Where the server expects its CURVE keys (`--prfaas-zmq-curve-keys`), None when it uses none."""
    if topo.dep.transfer_backend != "prfaas_zmq":
        return None
    return role.flag("--prfaas-zmq-curve-keys")


def volumes(topo: Topology, role: Role | None, model: Model, keys_secret: str | None) -> tuple[list, list]:
    """(volumes, volumeMounts): shared memory, the writable directories of a read-only root, the model, and
    (servers) the role's key Secret."""
    vols, mounts = pods.writable_volumes()
    vols.insert(0, {"name": "dshm", "emptyDir": {"medium": "Memory"}})
    mounts.insert(0, {"name": "dshm", "mountPath": "/dev/shm"})
    if model.tiny:
        vols.append({"name": "model", "emptyDir": {}})
        mounts.append({"name": "model", "mountPath": MODEL_CACHE})
    else:
        src = ({"hostPath": {"path": model.name, "type": "Directory"}} if host_path_model(topo.dep)
               else {"persistentVolumeClaim": {"claimName": topo.dep.k8s["model_pvc"], "readOnly": True}})
        vols.append({"name": "model", **src})
        mounts.append({"name": "model", "mountPath": model.name, "readOnly": True})
    path = keys_mount(topo, role) if role else None
    if path and keys_secret:
        from prfaas_sgl.tools.deploy.k8s.keys import secret_items

        # 0440: root-owned files the pod's user reads through fsGroup (the kubelet grants the group read anyway)
        vols.append({"name": "curve-keys", "secret": {"secretName": keys_secret, "defaultMode": 0o440,
                                                      "items": secret_items(role.mode)}})
        mounts.append({"name": "curve-keys", "mountPath": path, "readOnly": True})
    if role:
        tier_vols, tier_mounts = tiers.volumes(role)
        vols += tier_vols
        mounts += tier_mounts
    return vols, mounts


def probes(port: str, startup_s: int) -> dict:
    get = {"httpGet": {"path": "/health", "port": port}}
    return {
        "startupProbe": {**get, "periodSeconds": 10, "failureThreshold": max(1, startup_s // 10)},
        "readinessProbe": {**get, "periodSeconds": 5, "timeoutSeconds": 10},
        # lenient: a busy CPU server answers /health in seconds; the router already drops failing servers
        "livenessProbe": {**get, "periodSeconds": 20, "timeoutSeconds": 20, "failureThreshold": 6},
    }


def statefulset(topo: Topology, role: Role, model: Model, keys_secret: str | None) -> dict:
    command, args = sglang_command(topo, role, model)
    vols, mounts = volumes(topo, role, model, keys_secret)
    container = {
        "name": "sglang", "image": topo.image, "command": command, "args": args, "env": server_env(topo, model),
        "ports": container_ports(topo, role), "volumeMounts": mounts, "securityContext": pods.CONTAINER_SECURITY,
        "resources": tiers.resources(role, pods.resources(topo.dep.k8s, role.pool, topo.dep.device)),
        **probes("http", startup_s=1800),  # loading a large model: up to 30 min
    }
    if topo.dep.device == "cuda":
        container["resources"]["limits"]["nvidia.com/gpu"] = role.gpus
    pod = {
        "securityContext": pods.pod_security(topo.dep.k8s),
        "automountServiceAccountToken": False,  # servers never call the Kubernetes API
        "terminationGracePeriodSeconds": 120,  # SIGTERM: SGLang finishes what it can; the router drops it
        "affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
            {"matchExpressions": [{"key": "kubernetes.io/hostname", "operator": "In",
                                   "values": list(role.machines)}]}]}}},
        "containers": [container], "volumes": vols,
    }
    meta_labels = labels(role.mode, role.name, role.dc, role.pool)
    return {
        "apiVersion": "apps/v1", "kind": "StatefulSet",
        "metadata": {"name": role.name, "namespace": role.namespace, "labels": meta_labels},
        "spec": {
            "serviceName": role.name, "replicas": role.replicas, "podManagementPolicy": "Parallel",
            "selector": {"matchLabels": selector(role.name)},
            "template": {"metadata": {"labels": meta_labels}, "spec": pod},
        },
    }


def headless_service(topo: Topology, role: Role) -> dict:
    """Per-pod DNS records for the router and the PD peers (SGLang itself advertises pod IPs)."""
    ports = [{"name": p["name"], "port": p["containerPort"], "targetPort": p["name"]}
             for p in container_ports(topo, role)]
    return {
        "apiVersion": "v1", "kind": "Service",
        "metadata": {"name": role.name, "namespace": role.namespace,
                     "labels": labels(role.mode, role.name, role.dc, role.pool)},
        "spec": {"clusterIP": "None", "selector": selector(role.name), "ports": ports},
    }
