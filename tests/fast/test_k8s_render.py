"""`prfaas render k8s`: manifests that validate against the Kubernetes API schemas (offline, bundled by
kubernetes-validate), keys only in Secrets and split by role, a KV data port open to prefill servers only,
and server flags identical to those `prfaas up` gives the same server."""
from __future__ import annotations

import argparse
import base64
import json
import os
import stat
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from prfaas_sgl.tools.commands import render as render_cmd
from prfaas_sgl.tools.deploy import config
from prfaas_sgl.tools.deploy.k8s import render
from prfaas_sgl.tools.deploy.k8s.topology import DEFAULT_DATA_PORT, ZMQ_CONTROL_PORTS
from prfaas_sgl.tools.launch import ServerSpec, server_args, server_env
from prfaas_sgl.router.config import load_file
from prfaas_sgl.transfer import security

ROOT = Path(__file__).resolve().parents[2]
GPU_FILE = ROOT / "docs" / "deploy-two-datacenters.toml"  # cuda, prfaas_zmq with CURVE keys, tp 8
CPU_FILE = Path(__file__).parent / "data" / "k8s" / "deploy-cpu-zmq.toml"  # cpu, prfaas_zmq, CURVE keys
KUBE_VERSIONS = ("1.30.0", kubernetes_validate.latest_version())  # oldest we claim, newest bundled


def rendered(path: Path, out: Path) -> dict[str, list[dict]]:
    """'<dc>/<file>' -> documents, through the command line entry point."""
    args = argparse.Namespace(target="k8s", config=str(path), out=str(out))
    assert render_cmd.run(args) == 0
    return {str(p.relative_to(out)): list(yaml.safe_load_all(p.read_text()))
            for p in sorted(out.glob("*/*.yaml"))}


def find(files: dict, kind: str, name: str, dc: str | None = None) -> dict:
    docs = [d for f, ds in files.items() for d in ds if (dc is None or f.startswith(dc + "/"))
            and d["kind"] == kind and d["metadata"]["name"] == name]
    assert len(docs) == 1, (kind, name, dc, len(docs))
    return docs[0]


@pytest.fixture(scope="module")
def gpu(tmp_path_factory):
    return rendered(GPU_FILE, tmp_path_factory.mktemp("gpu"))


@pytest.fixture(scope="module")
def cpu_out(tmp_path_factory):
    out = tmp_path_factory.mktemp("cpu")
    return out, rendered(CPU_FILE, out)


@pytest.mark.parametrize("which,version", list(zip(["gpu", "cpu"], KUBE_VERSIONS)))  # both kinds of file, both ends
def test_every_manifest_validates_against_the_api_schemas(which, version, gpu, cpu_out):
    files = gpu if which == "gpu" else cpu_out[1]
    kinds = set()
    for name, docs in files.items():
        for doc in docs:
            kubernetes_validate.validate(doc, version, strict=True)  # raises on any schema error, unknown fields too
            kinds.add(doc["kind"])
    assert {"Namespace", "StatefulSet", "Service", "Deployment", "ConfigMap", "NetworkPolicy", "Secret",
            "ServiceAccount", "Role", "RoleBinding"} <= kinds


def test_layout_per_datacenter_and_gpus(gpu):
    assert set(gpu) == {"remote/00-namespace.yaml", "remote/10-secrets.yaml", "remote/20-servers.yaml",
                        "remote/40-networkpolicy.yaml", "local/00-namespace.yaml", "local/10-secrets.yaml",
                        "local/20-servers.yaml", "local/30-router.yaml",
                        "local/40-networkpolicy.yaml"}  # prfaas_zmq on GPUs: CURVE keys on both sides
    remote = find(gpu, "StatefulSet", "prfaas-prefill", "remote")
    assert remote["spec"]["replicas"] == 2 and remote["metadata"]["namespace"] == "prfaas-remote"
    assert remote["spec"]["template"]["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == 8
    nodes = remote["spec"]["template"]["spec"]["affinity"]["nodeAffinity"][
        "requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"][0]["matchExpressions"][0]["values"]
    assert nodes == ["remote-a", "remote-b"]
    assert find(gpu, "StatefulSet", "prefill", "local")["spec"]["replicas"] == 1
    assert find(gpu, "StatefulSet", "decode", "local")["spec"]["replicas"] == 2


def test_server_flags_are_those_of_prfaas_up(cpu_out, tmp_path):
    """Same flags and CPU environment as `prfaas_sgl.tools.launch` gives the server, bound to the pod's IP."""
    files = cpu_out[1]
    pod = find(files, "StatefulSet", "decode", "local")["spec"]["template"]["spec"]["containers"][0]
    dep = config.load(CPU_FILE)
    (tmp_path / "config.json").write_text(json.dumps({"layer_types": ["linear_attention", "full_attention"]}))
    spec = ServerSpec(model_path=str(tmp_path), port=30000, host="$(POD_IP)", mode="decode",
                      transfer_backend="prfaas_zmq", extra_args=dep.server_args + dep.servers[3].args
                      + ("--prfaas-zmq-data-port", str(DEFAULT_DATA_PORT)), device="cpu")
    want = server_args(spec)
    i = want.index("--model-path")
    del want[i:i + 2]  # the tiny model's path is printed by the image's own builder at start
    assert "--mamba-radix-cache-strategy" in want  # tiny-qwen35-hybrid is hybrid: its CPU flags are there
    assert pod["args"] == want
    assert 'sglang.launch_server --model-path "$$(python -m prfaas_sgl.tools.models.tiny tiny-qwen35-hybrid' in pod[
        "command"][2]
    env = {e["name"]: e.get("value") for e in pod["env"]}
    cpu_env = {k: v for k, v in server_env(spec).items() if k not in os.environ or os.environ[k] != v}
    assert {k: v for k, v in cpu_env.items() if k != "SGLANG_HOST_IP"}.items() <= env.items()
    assert env["SGLANG_HOST_IP"] == "$(POD_IP)"


def _mount(files: dict, sts: str, dc: str, tmp: Path) -> Path:
    """Materialize the Secret volume of `sts` the way the kubelet would (items -> paths, defaultMode)."""
    pod = find(files, "StatefulSet", sts, dc)["spec"]["template"]["spec"]
    vol = next(v for v in pod["volumes"] if v["name"] == "curve-keys")
    mount = next(m for m in pod["containers"][0]["volumeMounts"] if m["name"] == "curve-keys")
    args = pod["containers"][0]["args"]
    assert mount["mountPath"] == args[args.index("--prfaas-zmq-curve-keys") + 1]
    secret = find(files, "Secret", vol["secret"]["secretName"], dc)
    root = tmp / sts
    for item in vol["secret"]["items"]:
        (root / item["path"]).parent.mkdir(parents=True, exist_ok=True)
        (root / item["path"]).write_bytes(base64.b64decode(secret["data"][item["key"]]))
        (root / item["path"]).chmod(vol["secret"]["defaultMode"])
    return root


def test_curve_keys_are_role_split_secrets_the_transport_accepts(cpu_out, tmp_path, monkeypatch):
    out, files = cpu_out
    sender, receiver = _mount(files, "prfaas-prefill", "remote", tmp_path), _mount(files, "decode", "local", tmp_path)
    owner = (sender / "register.secret").stat().st_uid
    monkeypatch.setattr(security.os, "getuid", lambda: owner + 1000)  # the kubelet's files, a non-root pod user
    assert security.register_secret(str(sender)) == security.register_secret(str(receiver))
    # the prefill trusts the decode's server key; the decode authorizes the prefill's client key
    assert security.server_key_problem(str(sender), security.server_public_key(str(receiver))) is None
    client_pub = (sender / "client.key").read_text()
    assert (receiver / "authorized_clients" / "client.key").read_text() == client_pub
    assert not (sender / "server.key_secret").exists() and not (receiver / "client.key_secret").exists()
    for path in out.glob("*/10-secrets.yaml"):
        assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert stat.S_IMODE((out / "keys").stat().st_mode) == 0o700
    configmaps = [d for ds in files.values() for d in ds if d["kind"] == "ConfigMap"]
    blob = json.dumps(configmaps)
    assert "key_secret" not in blob and "register" not in blob


def test_no_token_reaches_a_configmap(tmp_path):
    """A [router] section changed after the file was read still renders no token (the file refuses them)."""
    dep = config.load(CPU_FILE)
    dep.router.update(admin_token="admin-" + "a" * 40, supervisor_token="supervisor-" + "s" * 40)
    render(dep, tmp_path)
    blob = "".join(p.read_text() for p in tmp_path.glob("*/*.yaml") if not p.name.startswith("10-"))
    assert "admin-aaaa" not in blob and "supervisor-ssss" not in blob


def test_rerender_keeps_the_keys(cpu_out, tmp_path):
    out, files = cpu_out
    again = rendered(CPU_FILE, out)
    assert again["local/10-secrets.yaml"] == files["local/10-secrets.yaml"]


def test_router_lists_every_ordinal_and_takes_the_token_from_a_secret(cpu_out, tmp_path):
    files = cpu_out[1]
    cm = find(files, "ConfigMap", "prfaas-router", "local")
    path = tmp_path / "router.json"
    path.write_text(cm["data"]["router.json"])
    fields = load_file(str(path))  # what launch_router reads
    assert [s["name"] for s in fields["prfaas"]] == ["prfaas-prefill-0", "prfaas-prefill-1"]
    # 2 local servers: either role may grow to 1 (the other keeps >= 1)
    assert [s["url"] for s in fields["decode"]] == ["http://decode-0.decode.prfaas-local.svc.cluster.local:30000"]
    assert fields["local_prefill"][0]["bootstrap_port"] == 8998 and "admin_token" not in fields
    assert fields["transport_stats_url"].split(",")[1] == (
        "http://prfaas-prefill-1.prfaas-prefill.prfaas-remote.svc.cluster.local:9100/stats")
    router = find(files, "Deployment", "prfaas-router", "local")["spec"]["template"]["spec"]
    env = {e["name"]: e for e in router["containers"][0]["env"]}
    assert env["PRFAAS_ROUTER_ADMIN_TOKEN"]["valueFrom"]["secretKeyRef"]["name"] == "prfaas-router-admin"
    secret = find(files, "Secret", "prfaas-router-admin", "local")
    assert base64.b64decode(secret["data"]["token"]).decode() == (cpu_out[0] / "keys" / "admin.token").read_text().strip()
    role = find(files, "Role", "prfaas-router", "local")
    assert role["rules"] == [{"apiGroups": ["apps"], "resources": ["statefulsets/scale"],
                              "resourceNames": ["prefill", "decode"], "verbs": ["get", "patch"]}]


def _ports(rule: dict) -> set[int]:
    return {p["port"] for p in rule.get("ports", [])}


def test_kv_data_port_is_open_to_prefill_servers_only(cpu_out):
    files = cpu_out[1]
    deny = find(files, "NetworkPolicy", "default-deny-ingress", "local")
    assert deny["spec"] == {"podSelector": {}, "policyTypes": ["Ingress"]}
    policy = find(files, "NetworkPolicy", "decode-ingress", "local")
    rules = [r for r in policy["spec"]["ingress"] if DEFAULT_DATA_PORT in _ports(r)]
    assert len(rules) == 1
    peers = {(p["namespaceSelector"]["matchLabels"]["kubernetes.io/metadata.name"],
              p["podSelector"]["matchLabels"]["app.kubernetes.io/component"]) for p in rules[0]["from"]}
    assert peers == {("prfaas-remote", "prefill"), ("prfaas-local", "prefill")}
    assert {"protocol": "TCP", "port": ZMQ_CONTROL_PORTS[0], "endPort": ZMQ_CONTROL_PORTS[1]} in rules[0]["ports"]
    for rule in policy["spec"]["ingress"]:  # nothing else reaches the decode but the router's HTTP
        assert "from" in rule and (rule in rules or _ports(rule) == {30000})
    pod = find(files, "StatefulSet", "decode", "local")["spec"]["template"]["spec"]["containers"][0]
    assert {"name": "kv-data", "containerPort": DEFAULT_DATA_PORT} in pod["ports"]


def test_files_kubernetes_cannot_run_are_refused(tmp_path):
    raw = config.tomllib.loads(CPU_FILE.read_text())
    raw["servers"][1]["port"] = 30001
    with pytest.raises(ValueError, match=r"servers\[prfaas-1\].port differs"):
        render(config.parse(raw), tmp_path)
    raw = config.tomllib.loads(CPU_FILE.read_text())
    raw["deployment"]["server_args"] = ["--chunked-prefill-size", "64"]
    for s in raw["servers"]:
        s["host"] = "127.0.0.1"  # fine for `prfaas up` on one machine; a pod's address is never loopback
    with pytest.raises(ValueError, match="prfaas_zmq needs '--prfaas-zmq-curve-keys'"):
        render(config.parse(raw), tmp_path)
    raw = config.tomllib.loads(CPU_FILE.read_text())
    raw["k8s"]["replicas"] = 3
    with pytest.raises(ValueError, match=r"\[k8s\]: unknown keys \['replicas'\]"):
        render(config.parse(raw), tmp_path)


def test_selectors_match_their_pods(gpu):
    """What the API server checks beyond the schema: a workload's selector matches its template, every
    Service and NetworkPolicy selects some pod, port names are IANA_SVC_NAMEs (<= 15 characters)."""
    docs = [d for ds in gpu.values() for d in ds]
    pods = [d["spec"]["template"]["metadata"]["labels"] for d in docs if d["kind"] in ("StatefulSet", "Deployment")]
    for d in docs:
        if d["kind"] in ("StatefulSet", "Deployment"):
            assert d["spec"]["selector"]["matchLabels"].items() <= d["spec"]["template"]["metadata"]["labels"].items()
            for port in d["spec"]["template"]["spec"]["containers"][0]["ports"]:
                assert len(port["name"]) <= 15
        sel = (d["spec"].get("selector") if d["kind"] == "Service" else
               d["spec"]["podSelector"].get("matchLabels") if d["kind"] == "NetworkPolicy" else None)
        if sel:
            assert any(sel.items() <= p.items() for p in pods), d["metadata"]["name"]
