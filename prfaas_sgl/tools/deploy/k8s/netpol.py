"""NetworkPolicies: deny all ingress, then open each port to the peers that use it.

Peers are named by namespace and pod labels, not by the file's host addresses: pod-to-pod traffic keeps the
pod's IP, while a node address (the file's `host`) would also admit anything host-networked on that node.
The decode's KV data port is open only to prefill servers: the other datacenter's PrfaaS prefills and this
datacenter's own (the local PD path also moves KV). SGLang's PD control sockets bind random ports
(ZMQ_CONTROL_PORTS), which are opened to the same PD peers only. Mooncake picks its own ports, so with it the
PD peers are restricted by label, not by port.
"""
from __future__ import annotations

from prfaas_sgl.tools.deploy.k8s.router import NAME as ROUTER, router_port
from prfaas_sgl.tools.deploy.k8s.topology import LOCAL, ZMQ_CONTROL_PORTS, Role, Topology


def _pods(topo: Topology, component: str, dcs: set[str]) -> list[dict]:
    return [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": topo.namespaces[dc]}},
             "podSelector": {"matchLabels": {"app.kubernetes.io/name": "prfaas",
                                             "app.kubernetes.io/component": component}}}
            for dc in sorted(dcs)]


def _tcp(port: int, last: int | None = None) -> dict:
    out = {"protocol": "TCP", "port": port}
    return {**out, "endPort": last} if last and last > port else out


def _policy(topo: Topology, name: str, ns: str, pod: dict, rules: list[dict]) -> dict:
    return {"apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy",
            "metadata": {"name": name, "namespace": ns, "labels": {"app.kubernetes.io/name": "prfaas"}},
            "spec": {"podSelector": {"matchLabels": pod}, "policyTypes": ["Ingress"], "ingress": rules}}


def _pd_rule(topo: Topology, peers: list[dict], ports: list[dict]) -> dict:
    """PD peer traffic: the given ports plus SGLang's control range; any port with Mooncake."""
    if topo.dep.transfer_backend != "prfaas_zmq":
        return {"from": peers}
    return {"from": peers, "ports": ports + [_tcp(*ZMQ_CONTROL_PORTS)]}


def decode_policy(topo: Topology, role: Role) -> dict:
    prefill_dcs = {r.dc for r in topo.roles if r.mode == "prefill"}
    kv = []
    if topo.dep.transfer_backend == "prfaas_zmq":
        first = int(role.flag("--prfaas-zmq-data-port"))
        kv = [_tcp(first, first + role.gpus - 1)]  # one receiver per TP rank (offset_port)
    rules = [{"from": _pods(topo, "router", {LOCAL}), "ports": [_tcp(role.port)]},
             _pd_rule(topo, _pods(topo, "prefill", prefill_dcs), kv)]
    return _policy(topo, f"{role.name}-ingress", role.namespace, {"app.kubernetes.io/instance": role.name}, rules)


def prefill_policy(topo: Topology, role: Role) -> dict:
    router_ports = [_tcp(role.port)]
    stats = int(role.flag("--prfaas-zmq-stats-port") or 0)
    if stats:
        router_ports.append(_tcp(stats))
    decode_dcs = {r.dc for r in topo.roles if r.mode == "decode"}
    rules = [{"from": _pods(topo, "router", {LOCAL}), "ports": router_ports},
             _pd_rule(topo, _pods(topo, "decode", decode_dcs), [_tcp(role.bootstrap_port)])]
    return _policy(topo, f"{role.name}-ingress", role.namespace, {"app.kubernetes.io/instance": role.name}, rules)


def policies(topo: Topology, dc: str) -> list[dict]:
    ns = topo.namespaces[dc]
    out = [{"apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy",
            "metadata": {"name": "default-deny-ingress", "namespace": ns, "labels": {"app.kubernetes.io/name": "prfaas"}},
            "spec": {"podSelector": {}, "policyTypes": ["Ingress"]}}]
    for role in topo.dc_roles(dc):
        out.append(decode_policy(topo, role) if role.mode == "decode" else prefill_policy(topo, role))
    if dc == LOCAL:  # users reach the router from anywhere; its own admin token guards /admin
        out.append(_policy(topo, f"{ROUTER}-ingress", ns, {"app.kubernetes.io/instance": ROUTER},
                           [{"ports": [_tcp(router_port(topo))]}]))
    return out
