"""The tier key: the HMAC-SHA256 key every tier entry is signed and verified with (entry.py).

Deployed like prfaas_zmq's register.secret: `prfaas keys DIR` writes DIR/tier.secret (64 hex characters,
0600 in a 0700 directory); copy it, keeping its mode, to every server that shares a storage tier, and
pass --prfaas-tier-key DIR/tier.secret. A server refuses a key file other users can read, as ssh does.

Without a key, entries are checksummed but anyone who can write to the store can inject KV a server
would load; `shared_without_key` says when a storage tier is reachable by others and so needs one.
"""
from __future__ import annotations

import os
import secrets
import stat
from typing import Optional

KEY_FILE = "tier.secret"
MIN_KEY_BYTES = 32


def write_key(path: str) -> None:
    """A fresh random key at `path`, mode 0600 (an existing file is replaced)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        os.fchmod(fd, 0o600)  # O_CREAT's mode applies to a new file only
        f.write(secrets.token_hex(32) + "\n")


def load_key(path: str) -> bytes:
    """The key in `path`; raises ValueError naming the fix when it is missing, short, or readable by
    other users (the same rule as the CURVE secrets: prfaas_sgl.transfer.security.secret_file_problem)."""
    from prfaas_sgl.transfer.security import secret_file_problem

    try:
        with open(path, "rb") as f:
            key = f.read().strip()
    except OSError as e:
        raise ValueError(f"cannot read the tier key {path}: {e.strerror}; create it with `prfaas keys DIR` "
                         f"(DIR/{KEY_FILE})") from None
    if len(key) < MIN_KEY_BYTES:
        raise ValueError(f"{path} holds {len(key)} bytes, fewer than {MIN_KEY_BYTES}: create it with "
                         f"`prfaas keys DIR` (DIR/{KEY_FILE})")
    problem = secret_file_problem(path)
    if problem:
        raise ValueError(problem)
    return key


def host_of(addr: str) -> str:
    """The host of "host:port", "[v6]:port" or "http://host:port/path"."""
    rest = addr.split("://", 1)[-1].split("/", 1)[0]
    if rest.startswith("["):
        return rest[1:rest.index("]")]
    return rest.rsplit(":", 1)[0] if rest.count(":") == 1 else rest


def shared_without_key(kind: str, path: str, master: str, metadata: str) -> Optional[str]:
    """Why a keyless storage tier of this kind could be written by others, or None:
    'mooncake' whose master (or metadata server) is not loopback; 'file' in a directory other users
    can write. (A directory shared between hosts, NFS say, cannot be told apart here: give it a key.)"""
    from prfaas_sgl.config import is_loopback

    if kind == "mooncake":
        ends = [("master", master)] + ([("metadata server", metadata)] if "://" in metadata else [])
        for what, addr in ends:
            if not is_loopback(host_of(addr)):
                return f"its {what} {addr} is not a loopback address"
    if kind == "file" and os.path.isdir(path):
        mode = stat.S_IMODE(os.stat(path).st_mode)
        if mode & 0o022:  # a sticky bit does not help: others can still create a key we have not written
            return f"its directory {path} has mode {mode:04o}: other users can write entries into it"
    return None
