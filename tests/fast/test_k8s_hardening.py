"""`prfaas render k8s` hardening: every pod passes Pod Security 'restricted' (non-root, read-only root with
emptyDirs where it writes, no escalation, no capabilities, RuntimeDefault seccomp, no hostPath) and has CPU
and memory requests and limits; egress is denied except DNS, the flows the pods use (the mirror of the
ingress rules) and the router's Kubernetes API; the key Secret stays out of the render on request, and
says what it holds when rendered. The manifests themselves validate in test_k8s_render.py."""
from __future__ import annotations

import tomllib
from pathlib import Path

import pytest
import yaml

from prfaas_sgl.tools.deploy import config
from prfaas_sgl.tools.deploy.k8s import render
from prfaas_sgl.tools.deploy.k8s.pods import HOME

from .test_k8s_render import CPU_FILE, GPU_FILE, find

QUANTITY = {"m": 1e-3, "Ki": 2 ** 10, "Mi": 2 ** 20, "Gi": 2 ** 30}


def rendered(raw: dict, out: Path) -> dict[str, list[dict]]:
    render(config.parse(raw), out)
    return {str(p.relative_to(out)): list(yaml.safe_load_all(p.read_text())) for p in sorted(out.glob("*/*.yaml"))}


def load(path: Path) -> dict:
    return tomllib.loads(path.read_text())


@pytest.fixture(scope="module", params=["gpu", "cpu"])
def files(request, tmp_path_factory):
    return rendered(load(GPU_FILE if request.param == "gpu" else CPU_FILE), tmp_path_factory.mktemp(request.param))


def pod_specs(files: dict) -> list[dict]:
    specs = [d["spec"]["template"]["spec"] for ds in files.values() for d in ds
             if d["kind"] in ("StatefulSet", "Deployment")]
    assert len(specs) >= 3
    return specs


def amount(q: str) -> float:
    for suffix, scale in QUANTITY.items():
        if q.endswith(suffix):
            return float(q.removesuffix(suffix)) * scale
    return float(q)


def test_every_pod_runs_non_root_with_restricted_security(files):
    for spec in pod_specs(files):
        pod = spec["securityContext"]
        assert pod["runAsNonRoot"] is True and pod["runAsUser"] > 0
        assert pod["runAsGroup"] == pod["fsGroup"] == pod["runAsUser"]  # the key Secret is read through fsGroup
        assert pod["seccompProfile"] == {"type": "RuntimeDefault"}
        for c in spec["containers"]:
            sc = c["securityContext"]
            assert sc["allowPrivilegeEscalation"] is False and sc["readOnlyRootFilesystem"] is True
            assert sc["capabilities"] == {"drop": ["ALL"]}
            assert sc.get("privileged") is not True and "runAsUser" not in sc  # nothing overrides the pod's
        allowed = {"emptyDir", "persistentVolumeClaim", "secret", "configMap"}  # of 'restricted''s list
        assert all(set(v) - {"name"} <= allowed for v in spec["volumes"]), spec["volumes"]


def test_a_read_only_pod_can_write_its_caches(files):
    for spec in pod_specs(files):
        empty = {v["name"] for v in spec["volumes"] if "emptyDir" in v}
        c = spec["containers"][0]
        mounts = {m["mountPath"]: m["name"] for m in c["volumeMounts"]}
        assert mounts["/tmp"] in empty and mounts[HOME] in empty
        env = {e["name"]: e.get("value") for e in c["env"]}
        assert env["HOME"] == HOME and env["USER"]  # getpass.getuser() needs USER for a UID without passwd entry


def test_every_container_has_cpu_and_memory_requests_and_limits(files):
    for spec in pod_specs(files):
        res = spec["containers"][0]["resources"]
        for name in ("cpu", "memory"):
            assert 0 < amount(res["requests"][name]) <= amount(res["limits"][name])


def test_key_secret_mount_is_0440_for_the_pods_group(files):
    specs = [s for s in pod_specs(files) if any(v["name"] == "curve-keys" for v in s["volumes"])]
    assert specs
    for spec in specs:
        vol = next(v for v in spec["volumes"] if v["name"] == "curve-keys")
        assert vol["secret"]["defaultMode"] == 0o440 and spec["securityContext"]["fsGroup"] > 0


def test_namespaces_enforce_pod_security_restricted(files):
    namespaces = [d for ds in files.values() for d in ds if d["kind"] == "Namespace"]
    assert len(namespaces) == 2
    for ns in namespaces:
        assert ns["metadata"]["labels"]["pod-security.kubernetes.io/enforce"] == "restricted"


def _egress(files: dict, dc: str, component: str) -> list[dict]:
    return find(files, "NetworkPolicy", f"{component}-egress", dc)["spec"]["egress"]


def test_egress_is_denied_but_for_dns_the_peers_and_the_api(files):
    for dc in ("remote", "local"):
        assert find(files, "NetworkPolicy", "default-deny-egress", dc)["spec"] == {
            "podSelector": {}, "policyTypes": ["Egress"]}
    components = {"remote": ["prefill"], "local": ["prefill", "decode", "router"]}
    for dc, names in components.items():
        for component in names:
            rules = _egress(files, dc, component)
            assert rules[0] == {"ports": [{"protocol": "UDP", "port": 53}, {"protocol": "TCP", "port": 53}]}
            anywhere = [r for r in rules if "to" not in r]
            api = [{"ports": [{"protocol": "TCP", "port": 443}, {"protocol": "TCP", "port": 6443}]}]
            assert anywhere == rules[:1] + (api if component == "router" else [])


def _ingress_flows(files: dict) -> set:
    """(source namespace, source component, target namespace, target instance, ports) of every ingress rule
    that names its source."""
    out = set()
    for d in (d for ds in files.values() for d in ds):
        if d["kind"] != "NetworkPolicy" or "ingress" not in d["spec"]:
            continue
        target = (d["metadata"]["namespace"], d["spec"]["podSelector"]["matchLabels"]["app.kubernetes.io/instance"])
        for rule in d["spec"]["ingress"]:
            for peer in rule.get("from", []):
                src = (peer["namespaceSelector"]["matchLabels"]["kubernetes.io/metadata.name"],
                       peer["podSelector"]["matchLabels"]["app.kubernetes.io/component"])
                out.add((*src, *target, yaml.safe_dump(rule.get("ports"))))
    return out


def _egress_flows(files: dict) -> set:
    out = set()
    for d in (d for ds in files.values() for d in ds):
        if d["kind"] != "NetworkPolicy" or "egress" not in d["spec"] or not d["spec"]["podSelector"]:
            continue
        src = (d["metadata"]["namespace"], d["spec"]["podSelector"]["matchLabels"]["app.kubernetes.io/component"])
        for rule in d["spec"]["egress"]:
            for peer in rule.get("to", []):
                target = (peer["namespaceSelector"]["matchLabels"]["kubernetes.io/metadata.name"],
                          peer["podSelector"]["matchLabels"]["app.kubernetes.io/instance"])
                out.add((*src, *target, yaml.safe_dump(rule.get("ports"))))
    return out


def test_egress_mirrors_ingress(files):
    """Every connection a pod may receive, its peer may make, on the same ports, and nothing else."""
    ingress = _ingress_flows(files)
    assert ("prfaas-remote", "prefill", "prfaas-local", "decode") in {f[:4] for f in ingress}  # KV across the link
    assert _egress_flows(files) == ingress


def test_resources_come_from_the_file(tmp_path):
    raw = load(CPU_FILE)
    raw["k8s"]["resources"] = {"decode": {"requests": {"cpu": "6", "memory": "20Gi"}, "limits": {"memory": "24Gi"}},
                               "router": {"limits": {"cpu": 2}}}
    files = rendered(raw, tmp_path)
    decode = find(files, "StatefulSet", "decode", "local")["spec"]["template"]["spec"]["containers"][0]
    assert decode["resources"] == {"requests": {"cpu": "6", "memory": "20Gi"}, "limits": {"cpu": "16", "memory": "24Gi"}}
    router = find(files, "Deployment", "prfaas-router", "local")["spec"]["template"]["spec"]["containers"][0]
    assert router["resources"]["limits"]["cpu"] == "2"


@pytest.mark.parametrize("k8s, message", [
    ({"resources": {"decode": {"requests": {"cpu": "lots"}}}}, r"requests.cpu = 'lots': expected .* quantity"),
    ({"resources": {"decode": {"requests": {"memory": "100Gi"}}}}, r"requests.memory 100Gi is above limits.memory"),
    ({"resources": {"gpu-nodes": {}}}, r"unknown sections \['gpu-nodes'\]"),
    ({"resources": {"router": {"request": {}}}}, r"\[k8s.resources.router\] takes requests and limits"),
    ({"run_as_user": 0}, "non-root UID"),
    ({"render_secrets": "no"}, "render_secrets must be true or false"),
])
def test_bad_hardening_settings_name_the_field(tmp_path, k8s, message):
    raw = load(CPU_FILE)
    raw["k8s"].update(k8s)
    with pytest.raises(ValueError, match=message):
        render(config.parse(raw), tmp_path)


def test_a_node_directory_model_needs_an_explicit_host_path(tmp_path):
    raw = load(GPU_FILE)
    raw.pop("k8s")
    with pytest.raises(ValueError, match=r"set \[k8s\] model_pvc = CLAIM .* or model_host_path = true"):
        render(config.parse(raw), tmp_path)
    raw["k8s"] = {"model_host_path": True}
    files = rendered(raw, tmp_path)
    spec = find(files, "StatefulSet", "decode", "local")["spec"]["template"]["spec"]
    assert {"name": "model", "hostPath": {"path": "/models/Qwen3.5-35B-A3B", "type": "Directory"}} in spec["volumes"]
    ns = find(files, "Namespace", "prfaas-local")
    assert "pod-security.kubernetes.io/enforce" not in ns["metadata"]["labels"]  # 'restricted' would refuse it


def test_secrets_say_what_they_hold_and_can_stay_out(tmp_path):
    raw = load(CPU_FILE)
    rendered(raw, tmp_path)
    text = (tmp_path / "local" / "10-secrets.yaml").read_text()
    assert "KEY MATERIAL" in text.splitlines()[1] and "render_secrets = false" in text
    raw["k8s"]["render_secrets"] = False
    fresh = tmp_path / "fresh"
    files = rendered(raw, fresh)
    assert not list(fresh.glob("*/10-secrets.yaml")) and not (fresh / "keys").exists()
    vol = next(v for v in find(files, "StatefulSet", "decode", "local")["spec"]["template"]["spec"]["volumes"]
               if v["name"] == "curve-keys")
    assert vol["secret"]["secretName"] == "prfaas-curve-decode"  # the store provides it under this name
    rendered(raw, tmp_path)  # over the earlier render: its Secrets file must not be applied with the rest
    assert not list(tmp_path.glob("*/10-secrets.yaml"))
