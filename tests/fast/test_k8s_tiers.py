"""`prfaas render k8s` with prfaas_hybrid's tier flags: a mooncake_master Deployment + Service the prefill
servers are pointed at, the tier key as a Secret mounted like the CURVE keys, the host tier's bytes in the
pods' memory, the file tier's directory, and network policies for the store; all valid API objects."""
from __future__ import annotations

import base64
import stat
from pathlib import Path

import kubernetes_validate
import pytest

from tests.fast.test_k8s_render import CPU_FILE, find, rendered

TIERS = ["--prfaas-tier-host-bytes", str(1 << 30), "--prfaas-tier-storage", "mooncake", "--prfaas-tier-publish"]
MASTER = "mooncake-master.prfaas-local.svc.cluster.local:50051"


def _with_tier_args(tmp_path: Path, pools: dict[str, list[str]]) -> Path:
    """CPU_FILE with `args` of each named server extended (every server of a pool must agree)."""
    text = CPU_FILE.read_text()
    for name, extra in pools.items():
        head = f'name = "{name}"'
        i = text.index(head)
        j = text.index("args = [", i) + len("args = [")
        text = text[:j] + "".join(f'"{a}", ' for a in extra) + text[j:]
    path = tmp_path / "deploy.toml"
    path.write_text(text)
    return path


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("tiers")
    path = _with_tier_args(tmp, {"prfaas-0": TIERS, "prfaas-1": TIERS, "local-prefill-0": TIERS})
    out = tmp / "out"
    return out, rendered(path, out)


def _container(files, name, dc):
    return find(files, "StatefulSet", name, dc)["spec"]["template"]["spec"]["containers"][0]


def test_every_tier_manifest_validates(store):
    for docs in store[1].values():
        for doc in docs:
            kubernetes_validate.validate(doc, kubernetes_validate.latest_version(), strict=True)


def test_a_mooncake_tier_gets_one_master_in_the_local_datacenter_and_both_clusters_point_at_it(store):
    files = store[1]
    assert "local/25-tier-store.yaml" in files and "remote/25-tier-store.yaml" not in files
    master = find(files, "Deployment", "mooncake-master", "local")
    assert master["spec"]["replicas"] == 1
    assert master["spec"]["template"]["spec"]["containers"][0]["command"] == ["mooncake_master"]
    assert [p["port"] for p in find(files, "Service", "mooncake-master", "local")["spec"]["ports"]] == [50051, 9003]
    for name, dc in (("prfaas-prefill", "remote"), ("prefill", "local")):
        args = _container(files, name, dc)["args"]
        assert args[args.index("--prfaas-tier-mooncake-master") + 1] == MASTER
        assert args[args.index("--prfaas-tier-key") + 1] == "/etc/prfaas-tier/tier.secret"
        assert "--prfaas-tier-publish" in args
    assert not any(a.startswith("--prfaas-tier") for a in _container(files, "decode", "local")["args"])


def test_the_tier_key_is_one_secret_mounted_like_the_curve_keys(store):
    out, files = store
    key = out / "keys" / "tier.secret"
    assert stat.S_IMODE(key.stat().st_mode) == 0o600
    for dc in ("remote", "local"):
        secret = find(files, "Secret", "prfaas-tier-key", dc)
        assert base64.b64decode(secret["data"]["tier.secret"]) == key.read_bytes()
    pod = find(files, "StatefulSet", "prfaas-prefill", "remote")["spec"]["template"]["spec"]
    vol = next(v for v in pod["volumes"] if v["name"] == "tier-key")
    assert vol["secret"] == {"secretName": "prfaas-tier-key", "defaultMode": 0o440,
                             "items": [{"key": "tier.secret", "path": "tier.secret"}]}
    mount = next(m for m in pod["containers"][0]["volumeMounts"] if m["name"] == "tier-key")
    assert mount == {"name": "tier-key", "mountPath": "/etc/prfaas-tier", "readOnly": True}


def test_the_host_tier_is_added_to_the_pods_memory(store):
    res = _container(store[1], "prfaas-prefill", "remote")["resources"]
    assert res["limits"]["memory"] == str(64 * 2 ** 30 + 2 ** 30)  # the CPU default 64Gi + 1 GiB
    assert res["requests"]["memory"] == str(16 * 2 ** 30 + 2 ** 30)
    assert _container(store[1], "decode", "local")["resources"]["limits"]["memory"] == "64Gi"


def test_the_store_is_reachable_only_from_its_clients(store):
    files = store[1]
    ingress = find(files, "NetworkPolicy", "mooncake-master-ingress", "local")["spec"]["ingress"]
    assert ingress[0]["ports"] == [{"protocol": "TCP", "port": 50051}]
    sources = {f["podSelector"]["matchLabels"]["app.kubernetes.io/instance"] for f in ingress[0]["from"]}
    assert sources == {"prfaas-prefill", "prefill"}
    egress = find(files, "NetworkPolicy", "prfaas-prefill-tier-egress", "remote")["spec"]["egress"]
    assert egress[0]["to"][0]["podSelector"]["matchLabels"] == {"app.kubernetes.io/instance": "mooncake-master"}


def test_a_named_master_is_used_as_is_and_none_is_rendered(tmp_path):
    extra = ["--prfaas-tier-storage", "mooncake", "--prfaas-tier-mooncake-master", "store.example:50051",
             "--prfaas-tier-key", "/etc/keys/t.secret"]
    files = rendered(_with_tier_args(tmp_path, {"local-prefill-0": extra}), tmp_path / "out")
    assert not any(name.endswith("25-tier-store.yaml") for name in files)
    args = _container(files, "prefill", "local")["args"]
    assert args.count("--prfaas-tier-mooncake-master") == 1 and "store.example:50051" in args
    mounts = _container(files, "prefill", "local")["volumeMounts"]
    assert {"name": "tier-key", "mountPath": "/etc/keys", "readOnly": True} in mounts


def test_a_file_tier_outside_tmp_gets_a_bounded_empty_dir(tmp_path):
    extra = ["--prfaas-tier-storage", "file", "--prfaas-tier-storage-path", "/var/cache/prfaas-tiers",
             "--prfaas-tier-storage-bytes", str(8 << 30)]
    files = rendered(_with_tier_args(tmp_path, {"local-prefill-0": extra}), tmp_path / "out")
    pod = find(files, "StatefulSet", "prefill", "local")["spec"]["template"]["spec"]
    assert {"name": "tier-storage", "emptyDir": {"sizeLimit": str(8 << 30)}} in pod["volumes"]
    assert {"name": "tier-storage", "mountPath": "/var/cache/prfaas-tiers"} in pod["containers"][0]["volumeMounts"]
    assert not any(v["name"] == "tier-key" for v in pod["volumes"])  # a pod's own directory needs no key
