"""Key files are private: `prfaas keys` leaves its directories 0700 and every secret file 0600 under any
umask (pyzmq alone wrote them 0644 under umask 022, readable by every local user), re-running fixes the
modes an earlier run or a careless copy left, and a server refuses a secret file other users can read,
naming the chmod that fixes it (ssh's rule)."""
from __future__ import annotations

import os
import stat
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import zmq

from prfaas_sgl.config import PrfaasConfig
from prfaas_sgl.transfer import security

SECRETS = ("server.key_secret", "client.key_secret", "register.secret")
DIRS = (".", "authorized_clients", "authorized_servers")


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def assert_private(keys: Path) -> None:
    assert {d: mode(keys / d) for d in DIRS} == dict.fromkeys(DIRS, 0o700)
    assert {f: mode(keys / f) for f in SECRETS} == dict.fromkeys(SECRETS, 0o600)


def test_prfaas_keys_under_umask_022_writes_private_files(tmp_path):
    """The command line, in its own process, with the usual umask."""
    keys = tmp_path / "keys"
    code = "import os, sys; os.umask(0o022); from prfaas_sgl.cli import main; sys.exit(main())"
    proc = subprocess.run([sys.executable, "-c", code, "keys", str(keys)], capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert_private(keys)


def test_rerun_fixes_modes_an_earlier_run_left(tmp_path):
    keys = tmp_path / "keys"
    security.generate_keys(str(keys))
    for d in DIRS:
        (keys / d).chmod(0o755)
    for f in SECRETS:
        (keys / f).chmod(0o644)
    old = os.umask(0o022)
    try:
        security.generate_keys(str(keys))
    finally:
        os.umask(old)
    assert_private(keys)
    assert security.register_secret(str(keys))  # and the fresh directory loads


@pytest.mark.parametrize("name", SECRETS)
def test_a_secret_file_others_can_read_is_refused_at_start(tmp_path, name):
    keys = tmp_path / "keys"
    security.generate_keys(str(keys))
    (keys / name).chmod(0o644)
    with pytest.raises(ValueError, match=rf"{name} holds a secret key but has mode 0644: other users .*"
                                         rf"`chmod 600 .*{name}`"):
        security.register_secret(str(keys))
    with pytest.raises(ValueError, match=r"--prfaas-zmq-curve-keys: .*chmod 600"):  # the server's start-up check
        PrfaasConfig(zmq_curve_keys=str(keys))


def test_group_readable_secret_of_this_user_is_refused(tmp_path):
    keys = tmp_path / "keys"
    security.generate_keys(str(keys))
    (keys / "client.key_secret").chmod(0o640)
    with pytest.raises(ValueError, match="mode 0640: its group can read"):
        security.secure_client(zmq.Context.instance().socket(zmq.DEALER), str(keys), None)


def test_secure_server_refuses_before_starting_its_authenticator(tmp_path):
    keys = tmp_path / "keys"
    security.generate_keys(str(keys))
    (keys / "server.key_secret").chmod(0o604)
    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    before = threading.active_count()
    auth = None
    try:
        with pytest.raises(ValueError, match="mode 0604: other users"):
            auth = security.secure_server(ctx, sock, str(keys))
        assert threading.active_count() == before  # no authenticator thread left running
    finally:
        if auth is not None:
            auth.stop()
        sock.close(0)
        ctx.term()


def test_a_kubernetes_secret_volume_is_accepted(tmp_path, monkeypatch):
    """A Secret mounted with fsGroup: root-owned, 0440, group = the pod's. Not this user's file, and closed
    to others, so it loads; the same file open to others does not."""
    keys = tmp_path / "keys"
    security.generate_keys(str(keys))
    for f in SECRETS:
        (keys / f).chmod(0o440)
    owner = (keys / "register.secret").stat().st_uid
    monkeypatch.setattr(security.os, "getuid", lambda: owner + 1000)  # the pod's non-root user
    assert len(security.register_secret(str(keys))) == 64
    (keys / "register.secret").chmod(0o444)
    assert "other users" in security.secret_file_problem(str(keys / "register.secret"))
