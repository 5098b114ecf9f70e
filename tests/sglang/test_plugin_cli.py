"""The plugin inside SGLang's real CLI: flags listed in --help, bad values rejected the argparse way.

Each case is a `python -m sglang.launch_server` process (~30 s of CPU importing SGLang before argparse runs);
the three run at once in one module fixture, so the module costs one such start on 2 cores, not three."""
from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor

import pytest

pytestmark = pytest.mark.sglang
EMPTY_DIR = tempfile.mkdtemp(prefix="prfaas-cli-")
CASES = {
    "help": ("--help",),
    "bad_choice": ("--model-path", "x", "--prfaas-role", "moon"),
    "inconsistent": ("--model-path", EMPTY_DIR, "--prfaas-zmq-chunk-bytes", "1048576",
                     "--prfaas-zmq-window-bytes", "4096"),
}


def launch(*args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, SGLANG_USE_CPU_ENGINE="1")
    return subprocess.run([sys.executable, "-m", "sglang.launch_server", *args], capture_output=True,
                          text=True, timeout=300, env=env)


@pytest.fixture(scope="module")
def outs() -> dict[str, subprocess.CompletedProcess]:
    with ThreadPoolExecutor(len(CASES)) as pool:
        return dict(zip(CASES, pool.map(lambda args: launch(*args), CASES.values())))


def test_help_lists_prfaas_flags(outs):
    out = outs["help"]
    assert out.returncode == 0, out.stderr[-2000:]
    for flag in ("--prfaas-role", "--prfaas-zmq-connections", "--prfaas-zmq-chunk-bytes",
                 "--prfaas-zmq-curve-keys", "--prfaas-zmq-timeout-s"):
        assert flag in out.stdout


def test_bad_choice_is_an_argparse_error(outs):
    out = outs["bad_choice"]
    assert out.returncode == 2
    assert "--prfaas-role" in out.stderr and "invalid choice" in out.stderr


def test_inconsistent_values_name_the_flag(outs):
    out = outs["inconsistent"]
    assert out.returncode == 2
    assert "--prfaas-zmq-window-bytes" in out.stderr
