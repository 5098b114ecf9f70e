"""The plugin inside SGLang's real CLI: flags listed in --help, bad values rejected the argparse way."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.sglang


def launch(*args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, SGLANG_USE_CPU_ENGINE="1")
    return subprocess.run([sys.executable, "-m", "sglang.launch_server", *args], capture_output=True,
                          text=True, timeout=300, env=env)


def test_help_lists_prfaas_flags():
    out = launch("--help")
    assert out.returncode == 0, out.stderr[-2000:]
    for flag in ("--prfaas-role", "--prfaas-zmq-connections", "--prfaas-zmq-chunk-bytes",
                 "--prfaas-zmq-curve-keys", "--prfaas-zmq-timeout-s"):
        assert flag in out.stdout


def test_bad_choice_is_an_argparse_error():
    out = launch("--model-path", "x", "--prfaas-role", "moon")
    assert out.returncode == 2
    assert "--prfaas-role" in out.stderr and "invalid choice" in out.stderr


def test_inconsistent_values_name_the_flag(tmp_path):
    out = launch("--model-path", str(tmp_path), "--prfaas-zmq-chunk-bytes", "1048576",
                 "--prfaas-zmq-window-bytes", "4096")
    assert out.returncode == 2
    assert "--prfaas-zmq-window-bytes" in out.stderr
