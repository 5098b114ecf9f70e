"""Under another SGLang version the plugin stays inactive, or stops with a clear error if prfaas is asked for."""
from __future__ import annotations

import subprocess
import sys
import textwrap

PROBE = textwrap.dedent("""
    import importlib.metadata, sys
    importlib.metadata.version = lambda name: "0.5.22"
    sys.argv = {argv!r}
    from prfaas_sgl.srt import compat
    try:
        compat.install()
        print("INSTALLED-QUIETLY")
    except SystemExit as e:
        print("EXIT:", e)
    print("SGLANG-IMPORTED" if "sglang" in sys.modules else "NO-SGLANG")
""")


def probe(argv):
    out = subprocess.run([sys.executable, "-c", PROBE.format(argv=argv)], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr
    return out.stdout.splitlines()


def test_mismatch_with_prfaas_flags_is_a_clear_error():
    lines = probe(["launch_server", "--model-path", "m", "--prfaas-role", "remote"])
    assert lines[0].startswith("EXIT:")
    assert "sglang==0.5.23" in lines[0] and "0.5.22" in lines[0]
    assert lines[1] == "NO-SGLANG"  # stops before touching SGLang internals


def test_mismatch_without_prfaas_stays_inactive():
    assert probe(["launch_server", "--model-path", "m"]) == ["INSTALLED-QUIETLY", "NO-SGLANG"]
