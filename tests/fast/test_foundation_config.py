"""`--prfaas-*` flags: generated from PrfaasConfig; bad values are argparse errors naming the flag."""
from __future__ import annotations

import argparse
import pickle

import pytest

from prfaas_sgl import config


def parse(argv):
    p = argparse.ArgumentParser(prog="t")
    config.add_flags(p)
    return config.from_namespace(p.parse_args(argv))


def test_defaults_and_round_trip():
    cfg = parse([])
    assert cfg == config.PrfaasConfig()
    assert pickle.loads(pickle.dumps(cfg)) == cfg  # travels into SGLang's scheduler subprocesses
    cfg = parse(["--prfaas-zmq-connections", "8", "--prfaas-role", "remote"])
    assert (cfg.transfer.connections, cfg.role) == (8, "remote")


def test_frozen():
    with pytest.raises(Exception):
        config.PrfaasConfig().transfer.connections = 3


@pytest.mark.parametrize("argv, flag", [
    (["--prfaas-zmq-connections", "0"], "--prfaas-zmq-connections"),
    (["--prfaas-zmq-chunk-bytes", "10"], "--prfaas-zmq-chunk-bytes"),
    (["--prfaas-zmq-chunk-bytes", "1048576", "--prfaas-zmq-window-bytes", "4096"], "--prfaas-zmq-window-bytes"),
    (["--prfaas-zmq-timeout-s", "-1"], "--prfaas-zmq-timeout-s"),
    (["--prfaas-zmq-curve-keys", "/nonexistent/dir"], "--prfaas-zmq-curve-keys"),
    (["--prfaas-zmq-stats-port", "70000"], "--prfaas-zmq-stats-port"),
    (["--prfaas-zmq-stats-host", "prefill.example"], "--prfaas-zmq-stats-host"),
    (["--prfaas-zmq-curve-keys", "KEYS", "--prfaas-zmq-insecure"], "--prfaas-zmq-insecure"),
    (["--prfaas-zmq-curve-keys", "NO_SECRET"], "register.secret"),
])
def test_invalid_values_name_the_flag(argv, flag, tmp_path):
    from prfaas_sgl.transfer.security import generate_keys

    generate_keys(str(tmp_path / "keys"))
    (tmp_path / "no-secret").mkdir()
    argv = [{"KEYS": str(tmp_path / "keys"), "NO_SECRET": str(tmp_path / "no-secret")}.get(a, a) for a in argv]
    with pytest.raises(ValueError, match=flag):
        parse(argv)


def test_sender_stats_endpoint_binds_the_configured_host():
    """The stats endpoint was loopback-only, out of reach of a router in the other datacenter."""
    from prfaas_sgl.transfer.config import TransferConfig
    from prfaas_sgl.transfer.layout import BufferSpec, MemoryLayout
    from prfaas_sgl.transfer.sender import ZmqSender

    assert parse([]).zmq_stats_host == "127.0.0.1"
    host = parse(["--prfaas-zmq-stats-host", "0.0.0.0"]).zmq_stats_host
    layout = MemoryLayout((BufferSpec("kv", 4096, 16),))
    tx = ZmqSender(layout, [bytearray(4096 * 16)], TransferConfig(), stats_port=0, stats_host=host)
    try:
        assert tx.stats_server.url.startswith("http://0.0.0.0:")
    finally:
        tx.close()


def test_insecure_is_a_switch(tmp_path):
    """Keys are the default on routable addresses; plaintext must be asked for by name."""
    assert parse([]).zmq_insecure is False
    assert parse(["--prfaas-zmq-insecure"]).zmq_insecure is True


def test_unknown_choice_is_argparse_error(capsys):
    with pytest.raises(SystemExit) as e:
        parse(["--prfaas-role", "moon"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "--prfaas-role" in err and "remote" in err
