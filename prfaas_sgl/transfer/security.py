"""CurveZMQ encryption + authentication for the data plane, and the shared secret of the control plane.

Keys directory (`TransferConfig.keys_dir`), in zmq.auth certificate format:

    KEYS_DIR/server.key, server.key_secret   receiver (decode) key pair
    KEYS_DIR/client.key, client.key_secret   sender (prefill) key pair
    KEYS_DIR/authorized_clients/*.key        public keys a receiver accepts
    KEYS_DIR/authorized_servers/*.key        public keys a sender sends to, besides server.key
    KEYS_DIR/register.secret                 shared secret: HMAC-SHA256 key of decode → prefill Register

A receiver only completes the CURVE handshake with clients whose public key is in authorized_clients,
so a peer without an authorized key can neither connect nor inject bytes. A sender only connects to a
server key it trusts (server.key or authorized_servers), whatever key a peer announces: a forged
announcement cannot make it encrypt KV for an attacker. Create a directory with `prfaas keys KEYS_DIR`;
copy the client pair to prefill hosts, the server pair to decode hosts, the public halves and
register.secret everywhere, keeping the modes it sets (directories 0700, secret files 0600): a server
refuses a secret file other users can read, as ssh does.
"""

from __future__ import annotations

import argparse
import functools
import glob
import hashlib
import hmac
import logging
import os
import secrets
import shutil
import stat

import zmq
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator

AUTHORIZED = "authorized_clients"
AUTHORIZED_SERVERS = "authorized_servers"
SECRET = "register.secret"
log = logging.getLogger(__name__)


def generate_keys(keys_dir: str, client_name: str = "client") -> None:
    """Create server and client key pairs, authorize the client, trust the server, and write a fresh
    Register secret. Existing files are replaced. The directory and its subdirectories end 0700 and every
    secret file 0600, whatever the umask and whatever mode an earlier run or a copy left behind."""
    old = os.umask(0o077)  # pyzmq writes certificates with open('w'): 0644 under the usual umask 022
    try:
        for d in (keys_dir, os.path.join(keys_dir, AUTHORIZED), os.path.join(keys_dir, AUTHORIZED_SERVERS)):
            os.makedirs(d, mode=0o700, exist_ok=True)
            os.chmod(d, 0o700)  # makedirs leaves an existing directory's mode alone
        _restrict_secrets(keys_dir)  # before the rewrite: open('w') keeps an existing file's mode
        server, _ = zmq.auth.create_certificates(keys_dir, "server")
        public, _ = zmq.auth.create_certificates(keys_dir, client_name)
        shutil.copy(public, os.path.join(keys_dir, AUTHORIZED, f"{client_name}.key"))
        shutil.copy(server, os.path.join(keys_dir, AUTHORIZED_SERVERS, "server.key"))
        _write_private(os.path.join(keys_dir, SECRET), secrets.token_hex(32) + "\n")
        _restrict_secrets(keys_dir)
    finally:
        os.umask(old)


def _secret_files(keys_dir: str) -> list[str]:
    return sorted(glob.glob(os.path.join(keys_dir, "*.key_secret")) + glob.glob(os.path.join(keys_dir, SECRET)))


def _restrict_secrets(keys_dir: str) -> None:
    for path in _secret_files(keys_dir):
        os.chmod(path, 0o600)


def _write_private(path: str, text: str) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        os.fchmod(fd, 0o600)  # O_CREAT's mode applies to a new file only; the old one may be 0644
        f.write(text)


def secret_file_problem(path: str) -> str | None:
    """Why the secret file at `path` must not be used, or None. ssh's rule: a file this user owns must not
    be open to group or others; a file owned by someone else (a Kubernetes Secret volume: root-owned, 0440,
    group = the pod's fsGroup) must not be open to others."""
    st = os.stat(path)
    loose = st.st_mode & (0o077 if st.st_uid == os.getuid() else 0o007)
    if not loose:
        return None
    who = "other users" if loose & 0o007 else "its group"
    return (f"{path} holds a secret key but has mode {stat.S_IMODE(st.st_mode):04o}: {who} can read or change "
            f"it; run `chmod 600 {path}` (and `chmod 700` its directory), the modes `prfaas keys` leaves")


def check_private(paths: list[str]) -> None:
    """Raises ValueError naming the first secret file other users can read (`secret_file_problem`)."""
    for path in paths:
        problem = secret_file_problem(path)
        if problem:
            raise ValueError(problem)


def server_public_key(keys_dir: str) -> str:
    public, _ = zmq.auth.load_certificate(os.path.join(keys_dir, "server.key"))
    return public.decode()


def trusted_server_keys(keys_dir: str) -> frozenset[str]:
    """z85 public keys a sender may connect to: server.key and authorized_servers/*.key. Called on every
    Register and new link: a file is parsed once per modification time, and a bad one is skipped."""
    paths = [os.path.join(keys_dir, "server.key")] + glob.glob(os.path.join(keys_dir, AUTHORIZED_SERVERS, "*.key"))
    keys = set()
    for path in paths:
        try:
            mtime = os.stat(path).st_mtime_ns
        except OSError:
            continue
        key = _public_key(path, mtime)
        if key is not None:
            keys.add(key)
    return frozenset(keys)


@functools.lru_cache(maxsize=1024)
def _public_key(path: str, mtime_ns: int) -> str | None:
    """The z85 public key in `path` as of `mtime_ns`, None (logged once) when it does not parse."""
    try:
        return zmq.auth.load_certificate(path)[0].decode()
    except Exception as e:  # one bad file must not refuse every peer
        log.error("prfaas_zmq: ignoring trusted key file %s: %s", path, e)
        return None


def server_key_problem(keys_dir: str, server_key: str | None) -> str | None:
    """Why a sender must not connect to `server_key` (None = keys_dir's own server.key), or None."""
    if server_key is None or server_key in trusted_server_keys(keys_dir):
        return None
    return (f"untrusted CURVE server key {server_key[:8]}...: not server.key nor in "
            f"{os.path.join(keys_dir, AUTHORIZED_SERVERS)}")


def register_secret(keys_dir: str) -> bytes:
    """The shared HMAC key of Register messages. Raises ValueError naming the fix when it is missing, or
    when any secret file of `keys_dir` is readable by other users: this is the servers' first read of the
    directory at start-up (the config check, then the backend manager), so a loose mode fails start-up
    rather than the first transfer."""
    path = os.path.join(keys_dir, SECRET)
    try:
        with open(path, "rb") as f:
            secret = f.read().strip()
    except FileNotFoundError:
        secret = b""
    if len(secret) < 32:
        raise ValueError(f"{path} is missing or shorter than 32 bytes: create the keys directory with "
                         "`prfaas keys DIR` and copy register.secret to every prefill and decode host")
    check_private(_secret_files(keys_dir))
    return secret


def mac(secret: bytes, payload: bytes) -> bytes:
    return hmac.new(secret, payload, hashlib.sha256).digest()


def mac_ok(secret: bytes, payload: bytes, tag: bytes) -> bool:
    return hmac.compare_digest(mac(secret, payload), tag)


def secure_server(ctx: zmq.Context, sock: zmq.Socket, keys_dir: str) -> ThreadAuthenticator:
    """Make `sock` a CURVE server that admits only authorized client keys. Call before bind()."""
    path = os.path.join(keys_dir, "server.key_secret")
    check_private([path])  # before the authenticator's thread starts: a refusal leaves nothing behind
    public, secret = zmq.auth.load_certificate(path)
    auth = ThreadAuthenticator(ctx)
    auth.start()
    auth.configure_curve(domain="*", location=os.path.join(keys_dir, AUTHORIZED))
    sock.curve_publickey = public
    sock.curve_secretkey = secret
    sock.curve_server = True
    return auth


def secure_client(sock: zmq.Socket, keys_dir: str, server_key: str | None,
                  client_name: str = "client") -> None:
    """Make `sock` a CURVE client of a server with public key `server_key` (z85; default: keys_dir's).
    Raises ValueError when `server_key` is not a trusted key (`server_key_problem`)."""
    problem = server_key_problem(keys_dir, server_key)
    if problem:
        raise ValueError(problem)
    path = os.path.join(keys_dir, f"{client_name}.key_secret")
    check_private([path])
    public, secret = zmq.auth.load_certificate(path)
    sock.curve_publickey = public
    sock.curve_secretkey = secret
    sock.curve_serverkey = (server_key or server_public_key(keys_dir)).encode()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("keys_dir")
    generate_keys(parser.parse_args().keys_dir)


if __name__ == "__main__":
    main()
