"""NetworkPolicies: deny all ingress and all egress, then allow each flow the pods use, at both ends.

The flows (`flows`) are listed once; each becomes an ingress rule of the pods it reaches and an egress rule of
the pods it leaves, so the two directions cannot drift apart. Peers are named by namespace and pod labels,
not by the file's host addresses: pod-to-pod traffic keeps the pod's IP, while a node address (the file's
`host`) would also admit anything host-networked on that node. The decode's KV data port is open only to
prefill servers: the other datacenter's PrfaaS prefills and this datacenter's own (the local PD path also
moves KV). SGLang's PD control sockets bind random ports (ZMQ_CONTROL_PORTS), which are opened to the same PD
peers only. Mooncake picks its own ports, so with it the PD peers are restricted by label, not by port.
Beyond the flows, every pod may resolve names (port 53: pod DNS names in the router's server list and in
bootstrap addresses) and the router may reach the Kubernetes API (its actuator scales the StatefulSets).
No pod reaches a model store: models come from a volume or are built in the pod.
"""
from __future__ import annotations

from dataclasses import dataclass

from prfaas_sgl.tools.deploy.k8s.router import NAME as ROUTER, router_port
from prfaas_sgl.tools.deploy.k8s.topology import LOCAL, ZMQ_CONTROL_PORTS, Role, Topology

DNS = [{"protocol": "UDP", "port": 53}, {"protocol": "TCP", "port": 53}]
# The API server's address is the control plane's, outside any pod selector, and on 443 or 6443 by distribution
API_SERVER = [{"protocol": "TCP", "port": 443}, {"protocol": "TCP", "port": 6443}]


@dataclass(frozen=True)
class Flow:
    """Connections from the pods of component `src` in datacenters `src_dcs` to the pods of `dst`, on
    `ports` (None: any port)."""

    src: str
    src_dcs: frozenset[str]
    dst: Role
    ports: tuple[dict, ...] | None


def _pods(topo: Topology, component: str, dcs: set[str]) -> list[dict]:
    return [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": topo.namespaces[dc]}},
             "podSelector": {"matchLabels": {"app.kubernetes.io/name": "prfaas",
                                             "app.kubernetes.io/component": component}}}
            for dc in sorted(dcs)]


def _role_pods(role: Role) -> dict:
    return {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": role.namespace}},
            "podSelector": {"matchLabels": {"app.kubernetes.io/name": "prfaas", "app.kubernetes.io/instance": role.name}}}


def _tcp(port: int, last: int | None = None) -> dict:
    out = {"protocol": "TCP", "port": port}
    return {**out, "endPort": last} if last and last > port else out


def _policy(name: str, ns: str, pod: dict, kind: str, rules: list[dict]) -> dict:
    return {"apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy",
            "metadata": {"name": name, "namespace": ns, "labels": {"app.kubernetes.io/name": "prfaas"}},
            "spec": {"podSelector": {"matchLabels": pod}, "policyTypes": [kind], kind.lower(): rules}}


def _pd_ports(topo: Topology, ports: list[dict]) -> tuple[dict, ...] | None:
    """PD peer traffic: the given ports plus SGLang's control range; any port with Mooncake."""
    if topo.dep.transfer_backend != "prfaas_zmq":
        return None
    return (*ports, _tcp(*ZMQ_CONTROL_PORTS))


def _role_flows(topo: Topology, role: Role) -> list[Flow]:
    router = frozenset({LOCAL})
    if role.mode == "decode":
        kv = []
        if topo.dep.transfer_backend == "prfaas_zmq":
            first = int(role.flag("--prfaas-zmq-data-port"))
            kv = [_tcp(first, first + role.gpus - 1)]  # one receiver per TP rank (offset_port)
        prefill_dcs = frozenset(r.dc for r in topo.roles if r.mode == "prefill")
        return [Flow("router", router, role, (_tcp(role.port),)),
                Flow("prefill", prefill_dcs, role, _pd_ports(topo, kv))]
    router_ports = [_tcp(role.port)]
    stats = int(role.flag("--prfaas-zmq-stats-port") or 0)
    if stats:
        router_ports.append(_tcp(stats))
    decode_dcs = frozenset(r.dc for r in topo.roles if r.mode == "decode")
    return [Flow("router", router, role, tuple(router_ports)),
            Flow("decode", decode_dcs, role, _pd_ports(topo, [_tcp(role.bootstrap_port)]))]


def flows(topo: Topology) -> list[Flow]:
    """Every connection between our pods, in every datacenter."""
    return [f for role in topo.roles for f in _role_flows(topo, role)]


def _ports(flow: Flow) -> dict:
    return {} if flow.ports is None else {"ports": list(flow.ports)}


def ingress_policy(topo: Topology, role: Role) -> dict:
    rules = [{"from": _pods(topo, f.src, set(f.src_dcs)), **_ports(f)} for f in flows(topo) if f.dst == role]
    return _policy(f"{role.name}-ingress", role.namespace, {"app.kubernetes.io/instance": role.name}, "Ingress",
                   rules)


def egress_policy(topo: Topology, dc: str, component: str) -> dict:
    """What the pods of `component` in `dc` may connect to: name resolution, the flows they start, and (the
    router) the Kubernetes API."""
    rules = [{"ports": DNS}]
    rules += [{"to": [_role_pods(f.dst)], **_ports(f)} for f in flows(topo) if f.src == component and dc in f.src_dcs]
    if component == "router":
        rules.append({"ports": API_SERVER})
    return _policy(f"{component}-egress", topo.namespaces[dc], {"app.kubernetes.io/name": "prfaas",
                                                                 "app.kubernetes.io/component": component},
                   "Egress", rules)


def _deny(ns: str, kind: str) -> dict:
    return {"apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy",
            "metadata": {"name": f"default-deny-{kind.lower()}", "namespace": ns,
                         "labels": {"app.kubernetes.io/name": "prfaas"}},
            "spec": {"podSelector": {}, "policyTypes": [kind]}}


def policies(topo: Topology, dc: str) -> list[dict]:
    ns = topo.namespaces[dc]
    out = [_deny(ns, "Ingress"), _deny(ns, "Egress")]
    out += [ingress_policy(topo, role) for role in topo.dc_roles(dc)]
    components = [*dict.fromkeys(r.mode for r in topo.dc_roles(dc))] + (["router"] if dc == LOCAL else [])
    out += [egress_policy(topo, dc, c) for c in components]
    if dc == LOCAL:  # users reach the router from anywhere; its own admin token guards /admin
        out.append(_policy(f"{ROUTER}-ingress", ns, {"app.kubernetes.io/instance": ROUTER}, "Ingress",
                           [{"ports": [_tcp(router_port(topo))]}]))
    return out
