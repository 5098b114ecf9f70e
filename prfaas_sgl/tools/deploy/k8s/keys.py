"""Secrets: the CURVE keys of `prfaas keys`, split by role, and the router's admin token.

Key material is created once under OUT/keys/ (`prfaas keys` layout, files 0600) and re-used by every later
render, so re-rendering does not rotate keys; delete OUT/keys to rotate. Each role's Secret holds only what
that side reads (prfaas_sgl/transfer/security.py): a prefill never sees the decode's secret key and the
reverse. A Secret is flat, so `authorized_*/NAME` travel as `authorized_*.NAME` and the volume's `items`
put them back in their directories.
"""
from __future__ import annotations

import base64
import os
import secrets
from pathlib import Path

from prfaas_sgl.transfer.security import AUTHORIZED, AUTHORIZED_SERVERS, SECRET, generate_keys

CLIENT = "client"
FILES = {  # role -> files of the keys directory it reads
    "prefill": (f"{CLIENT}.key", f"{CLIENT}.key_secret", "server.key", f"{AUTHORIZED_SERVERS}/server.key", SECRET),
    "decode": ("server.key", "server.key_secret", f"{AUTHORIZED}/{CLIENT}.key", SECRET),
}
SECRET_NAME = {"prefill": "prfaas-curve-prefill", "decode": "prfaas-curve-decode"}
ADMIN_SECRET = "prfaas-router-admin"
ADMIN_KEY = "token"


def secret_items(role: str) -> list[dict]:
    return [{"key": _key(f), "path": f} for f in FILES[role]]


def _key(path: str) -> str:
    return path.replace("/", ".")


def _keys_root(out: Path) -> Path:
    root = out / "keys"
    root.mkdir(parents=True, exist_ok=True)
    root.chmod(0o700)
    return root


def curve_dir(out: Path) -> Path:
    d = _keys_root(out) / "curve"
    if not (d / SECRET).is_file():
        generate_keys(str(d), CLIENT)
    for path in d.rglob("*"):
        if path.is_file():
            path.chmod(0o600)
    return d


def admin_token(out: Path) -> str:
    path = _keys_root(out) / "admin.token"
    if not path.is_file():
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(secrets.token_urlsafe(32) + "\n")
    return path.read_text().strip()


def _secret(name: str, namespace: str, data: dict[str, bytes]) -> dict:
    return {"apiVersion": "v1", "kind": "Secret", "type": "Opaque",
            "metadata": {"name": name, "namespace": namespace, "labels": {"app.kubernetes.io/name": "prfaas"}},
            "data": {k: base64.b64encode(v).decode() for k, v in sorted(data.items())}}


def curve_secret(keys: Path, role: str, namespace: str) -> dict:
    return _secret(SECRET_NAME[role], namespace, {_key(f): (keys / f).read_bytes() for f in FILES[role]})


def admin_secret(token: str, namespace: str) -> dict:
    return _secret(ADMIN_SECRET, namespace, {ADMIN_KEY: token.encode()})
