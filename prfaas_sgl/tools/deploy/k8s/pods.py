"""What every pod gets: a non-root, read-only security context that Pod Security 'restricted' admits, the
writable directories such a pod still needs, and CPU/memory requests and limits.

Pod Security 'restricted' (https://kubernetes.io/docs/concepts/security/pod-security-standards/): non-root
user, no privilege escalation, every capability dropped, the runtime's default seccomp profile, and volumes
limited to emptyDir, PVC, Secret, ConfigMap and the like (no hostPath). The root filesystem is read-only; the
image's code never writes, while SGLang, Triton and PyTorch write caches under $HOME and /tmp, which are
emptyDirs. `fsGroup` makes the kubelet give the key Secret's files (root-owned, 0440) to the pod's group:
the transport reads them through it, and refuses any secret file open to others
(prfaas_sgl/transfer/security.py).

    [k8s]
    run_as_user = 1000          # UID and GID of every container (default 1000; never 0)
    [k8s.resources.decode]      # per pool (prfaas, local_prefill, decode) or router; merged over DEFAULTS
    requests = { cpu = "8", memory = "64Gi" }
    limits = { cpu = "32", memory = "256Gi" }
"""
from __future__ import annotations

import re

DEFAULT_UID = 1000
HOME = "/home/prfaas"
COMPONENTS = ("router", "prfaas", "local_prefill", "decode")
# Starting points, not measurements: a server on GPUs holds pinned rings (64 MiB per TP rank each way) and
# reads the model through host memory; a CPU server holds the model and its KV pools in host memory.
DEFAULTS = {
    "router": {"requests": {"cpu": "1", "memory": "2Gi"}, "limits": {"cpu": "4", "memory": "8Gi"}},
    "cpu": {"requests": {"cpu": "4", "memory": "16Gi"}, "limits": {"cpu": "16", "memory": "64Gi"}},
    "cuda": {"requests": {"cpu": "8", "memory": "64Gi"}, "limits": {"cpu": "32", "memory": "256Gi"}},
}
CONTAINER_SECURITY = {"allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True,
                      "capabilities": {"drop": ["ALL"]}, "seccompProfile": {"type": "RuntimeDefault"}}
_QUANTITY = re.compile(r"^([0-9]+(?:\.[0-9]+)?)(m|k|M|G|T|P|E|Ki|Mi|Gi|Ti|Pi|Ei)?$")
_SCALE = {None: 1, "m": 1e-3, "k": 1e3, "M": 1e6, "G": 1e9, "T": 1e12, "P": 1e15, "E": 1e18,
          "Ki": 2 ** 10, "Mi": 2 ** 20, "Gi": 2 ** 30, "Ti": 2 ** 40, "Pi": 2 ** 50, "Ei": 2 ** 60}


def run_as_user(k8s: dict) -> int:
    uid = k8s.get("run_as_user", DEFAULT_UID)
    if not isinstance(uid, int) or isinstance(uid, bool) or not 0 < uid < 2 ** 31:
        raise ValueError(f"[k8s] run_as_user must be a non-root UID (1..2147483647), got {uid!r}")
    return uid


def pod_security(k8s: dict) -> dict:
    """The pod-level securityContext."""
    uid = run_as_user(k8s)
    return {"runAsNonRoot": True, "runAsUser": uid, "runAsGroup": uid, "fsGroup": uid,
            # a model PVC of many GiB is not re-chowned at every mount, only when its root's group differs
            "fsGroupChangePolicy": "OnRootMismatch", "seccompProfile": {"type": "RuntimeDefault"}}


def writable_volumes() -> tuple[list[dict], list[dict]]:
    """(volumes, mounts) of the directories a read-only pod writes: /tmp and $HOME (caches)."""
    return ([{"name": "tmp", "emptyDir": {}}, {"name": "home", "emptyDir": {}}],
            [{"name": "tmp", "mountPath": "/tmp"}, {"name": "home", "mountPath": HOME}])


def writable_env() -> list[dict]:
    # USER: PyTorch and Triton name cache directories after getpass.getuser(), which fails for a UID
    # without a passwd entry unless USER is set
    return [{"name": "HOME", "value": HOME}, {"name": "USER", "value": "prfaas"}]


def resources(k8s: dict, component: str, device: str) -> dict:
    """requests and limits of `component` (a pool or "router"): DEFAULTS, then [k8s.resources.COMPONENT]."""
    table = k8s.get("resources", {})
    unknown = set(table) - set(COMPONENTS)
    if unknown:
        raise ValueError(f"[k8s.resources]: unknown sections {sorted(unknown)}; known: {list(COMPONENTS)}")
    base = DEFAULTS["router" if component == "router" else device]
    mine = table.get(component, {})
    if set(mine) - {"requests", "limits"}:
        raise ValueError(f"[k8s.resources.{component}] takes requests and limits, got {sorted(mine)}")
    out = {kind: {**base[kind], **{k: str(v) for k, v in mine.get(kind, {}).items()}} for kind in base}
    _check(component, out)
    return out


def _check(component: str, res: dict) -> None:
    for kind, values in res.items():
        for name, value in values.items():
            if name not in ("cpu", "memory") or not _QUANTITY.match(value):
                raise ValueError(f"[k8s.resources.{component}].{kind}.{name} = {value!r}: expected cpu or memory "
                                 "as a Kubernetes quantity (\"4\", \"500m\", \"16Gi\")")
    for name in ("cpu", "memory"):
        if _amount(res["requests"][name]) > _amount(res["limits"][name]):
            raise ValueError(f"[k8s.resources.{component}]: requests.{name} {res['requests'][name]} is above "
                             f"limits.{name} {res['limits'][name]}; the API server refuses that")


def _amount(quantity: str) -> float:
    number, suffix = _QUANTITY.match(quantity).groups()
    return float(number) * _SCALE[suffix]
