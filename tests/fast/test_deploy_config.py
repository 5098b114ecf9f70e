"""Deployment file: per-machine shares, router server lists derived from the same file, clear errors."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from prfaas_sgl.deploy import config
from prfaas_sgl.deploy.up import server_spec
from prfaas_sgl.launch import server_args
from prfaas_sgl.router.config import load_file

EXAMPLE = Path(__file__).resolve().parents[2] / "docs" / "deploy-two-datacenters.toml"


def test_example_splits_by_machine():
    dep = config.load(EXAMPLE)
    assert [s.name for s in dep.on("remote-a")] == ["prfaas-0"]
    assert [s.name for s in dep.on("local-b")] == ["decode-0"]
    assert len(dep.on(None)) == 5
    assert dep.router_on("local-a") and not dep.router_on("remote-a")


def test_router_lists_come_from_servers(tmp_path):
    dep = config.load(EXAMPLE)
    fields = dep.router_fields(tokenizer_path=str(tmp_path))
    assert [s["url"] for s in fields["prfaas"]] == ["http://10.20.0.11:30000", "http://10.20.0.12:30000"]
    assert fields["local_prefill"][0]["bootstrap_port"] == 8998
    assert [s["name"] for s in fields["decode"]] == ["decode-0", "decode-1"]
    assert "machine" not in fields
    path = tmp_path / "router.json"
    path.write_text(json.dumps(fields))
    loaded = load_file(str(path))  # the file `prfaas up` hands to launch_router
    assert loaded["threshold"] == 8192 and len(loaded["decode"]) == 2


def test_gpu_server_gets_no_cpu_flags():
    dep = config.load(EXAMPLE)
    spec = server_spec(dep, dep.on("remote-a")[0], "/models/m", Path("/tmp"))
    args = server_args(spec)
    assert "--device" not in args and "torch_native" not in args
    assert args[args.index("--disaggregation-mode") + 1] == "prefill"
    assert args[args.index("--disaggregation-transfer-backend") + 1] == "prfaas_zmq"
    assert args[args.index("--disaggregation-bootstrap-port") + 1] == "8998"
    assert "--tp-size" in args and args[-2:] == ["--prfaas-role", "remote"]


@pytest.mark.parametrize("mutate, message", [
    (lambda r: r["servers"][0].update(pool="gpu"), "servers[prfaas-0].pool"),
    (lambda r: r["servers"][0].pop("bootstrap_port"), "servers[prfaas-0].bootstrap_port"),
    (lambda r: r["servers"][0].update(port=70000), "servers[prfaas-0].port"),
    (lambda r: r["deployment"].pop("model"), "deployment.model"),
    (lambda r: r["deployment"].update(device="tpu"), "deployment.device"),
    (lambda r: r.update(servers=[s for s in r["servers"] if s["pool"] != "decode"]), "pool = 'decode'"),
    (lambda r: r["servers"][1].update(name="prfaas-0"), "duplicate names"),
])
def test_bad_files_name_the_field(mutate, message):
    import tomllib

    raw = tomllib.loads(EXAMPLE.read_text())
    mutate(raw)
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
        config.parse(raw)
