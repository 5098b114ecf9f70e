"""Deployment file: per-machine shares, router server lists derived from the same file, clear errors."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from prfaas_sgl.tools.deploy import config
from prfaas_sgl.tools.deploy.up import server_spec
from prfaas_sgl.tools.launch import server_args
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
    assert args[args.index("--disaggregation-transfer-backend") + 1] == "prfaas_zmq"  # its staged path moves GPU KV
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
    # a backend × device SGLang refuses at start-up is refused when the file is read
    # (prfaas_zmq itself runs on cuda too)
    (lambda r: r["deployment"].update(transfer_backend="nixl", device="cpu"), "'nixl' runs on device 'cuda'"),
    (lambda r: r["deployment"].update(transfer_backend="tcp"), "deployment.transfer_backend must be one of"),
    # a routable prfaas_zmq server without keys or an explicit --prfaas-zmq-insecure
    (lambda r: r["deployment"].update(server_args=["--page-size", "64"]), r"servers\[prfaas-0\].*keys"),
])
def test_bad_files_name_the_field(mutate, message):
    import tomllib

    raw = tomllib.loads(EXAMPLE.read_text())
    mutate(raw)
    if "\\" not in message:
        message = message.replace("[", r"\[").replace("]", r"\]")
    with pytest.raises(ValueError, match=message):
        config.parse(raw)


def test_example_parses_and_defaults_match_the_device():
    """The documented file must pass the checks its servers run at start-up."""
    dep = config.load(EXAMPLE)
    assert (dep.device, dep.transfer_backend) == ("cuda", "prfaas_zmq")
    assert config.parse({"deployment": {"model": "m", "device": "cpu"}, "servers": [
        {"name": "p", "machine": "a", "pool": "prfaas", "host": "127.0.0.1", "port": 1, "bootstrap_port": 2},
        {"name": "d", "machine": "a", "pool": "decode", "host": "127.0.0.1", "port": 3},
    ]}).transfer_backend == "prfaas_zmq"


@pytest.mark.parametrize("name, env", [("admin_token", "PRFAAS_ROUTER_ADMIN_TOKEN"),
                                       ("supervisor_token", "PRFAAS_SUPERVISOR_TOKEN")])
def test_tokens_in_the_deployment_file_are_refused(name, env):
    """The file travels to every machine and [router] is written to router.json: a token in it would be on
    every disk, in clear, readable by any local user."""
    import tomllib

    assert name in config.SECRET_ROUTER_FIELDS  # derived from RouterConfig's secret fields
    raw = tomllib.loads(EXAMPLE.read_text())
    raw["router"][name] = "t" * 40
    with pytest.raises(ValueError, match=rf"\[router\] {name}: tokens do not belong .* set {env} in the environment"):
        config.parse(raw)


def test_router_json_never_holds_a_secret_field(tmp_path):
    dep = config.load(EXAMPLE)
    dep.router.update(admin_token="a" * 40, supervisor_token="s" * 40)  # a section changed after it was read
    fields = dep.router_fields(tokenizer_path=str(tmp_path))
    assert not config.SECRET_ROUTER_FIELDS & set(fields) and fields["threshold"] == 8192


@pytest.mark.parametrize("extra, ok", [((), False), (("--prfaas-zmq-insecure",), True),
                                       (("--prfaas-zmq-curve-keys", "/k"), True)])
def test_routable_prfaas_zmq_needs_keys_or_insecure(extra, ok):
    servers = (config.ServerEntry("p", "a", "prfaas", "10.0.0.1", 1, 2),
               config.ServerEntry("d", "a", "decode", "127.0.0.1", 3, args=extra))
    make = lambda: config.Deployment("m", servers, device="cpu", server_args=extra)  # noqa: E731
    if ok:
        make()
    else:
        with pytest.raises(ValueError, match=r"servers\[p\]: host 10.0.0.1 is routable"):
            make()


# ---------------------------------------------------------------- [supervisor]: the controller acts on `prfaas up`


def _with_supervisor(tmp_path, **router):
    import tomllib

    raw = tomllib.loads(EXAMPLE.read_text())
    raw["supervisor"] = {"port": 8101}
    raw["router"].update(router)
    return raw


def test_supervisor_urls_name_each_local_server_on_its_machine(tmp_path):
    from prfaas_sgl.router.config import RouterConfig, parse_supervisor_urls
    from tests.support.router_standin import build_tiny_tokenizer

    scenario = next((Path(__file__).resolve().parents[2] / "scenarios").glob("*.toml"))
    dep = config.parse(_with_supervisor(tmp_path, controller="planner", controller_scenario=str(scenario),
                                        actuator="supervisor"))
    fields = dep.router_fields(tokenizer_path=build_tiny_tokenizer(str(tmp_path / "tok")))
    assert parse_supervisor_urls(fields["supervisor_urls"]) == {  # local servers only, not the PrfaaS prefills
        "local-prefill-0": "http://10.10.0.11:8101", "decode-0": "http://10.10.0.12:8101",
        "decode-1": "http://10.10.0.13:8101"}
    cfg = RouterConfig.from_flags(**fields)  # what launch_router builds from router.json
    assert cfg.actuator == "supervisor" and cfg.switch_params.dwell_s == 600.0


@pytest.mark.parametrize("mutate, message", [
    (lambda raw: raw.pop("supervisor"), "needs a \\[supervisor\\] section"),
    (lambda raw: raw["supervisor"].update(port=0), "port"),
    (lambda raw: raw["supervisor"].update(host="x"), "one key"),
    (lambda raw: raw["servers"][3].update(host="10.10.0.99", machine="local-c"), "hosts"),
])
def test_bad_supervisor_sections_name_the_field(tmp_path, mutate, message):
    raw = _with_supervisor(tmp_path, actuator="supervisor")
    mutate(raw)
    with pytest.raises(ValueError, match=message):
        config.parse(raw)


def test_up_keeps_a_supervisor_of_this_machines_local_servers_secure_by_default(tmp_path):
    from prfaas_sgl.tools.deploy.up import Stack

    dep = config.parse(_with_supervisor(tmp_path))
    assert Stack(dep, "remote-a", tmp_path).supervisor("") is None  # a PrfaaS prefill never switches
    with pytest.raises(ValueError, match="PRFAAS_SUPERVISOR_TOKEN"):
        Stack(dep, "local-b", tmp_path).supervisor("")  # 10.10.0.12 is routable: a token or nothing
    with pytest.raises(ValueError, match="at least 32"):
        Stack(dep, "local-b", tmp_path).supervisor("tok")
    sup = Stack(dep, "local-b", tmp_path).supervisor("t" * 32)
    assert sup.names == ["decode-0"] and sup.host == "10.10.0.12"
    assert Stack(config.parse(_without(tmp_path)), "local-b", tmp_path).supervisor("t" * 32) is None


@pytest.mark.parametrize("token, message", [
    ("", "without a token"),
    ("short", "at least 32"),
    (f"http://10.10.0.13:8101={'t' * 32}", "no token for \\['http://10.10.0.12:8101'\\]"),  # another machine's
])
def test_up_refuses_a_missing_short_or_other_machines_token_before_starting_anything(tmp_path, monkeypatch, capsys,
                                                                                      token, message):
    import re

    from prfaas_sgl.tools.deploy import up

    monkeypatch.setenv("PRFAAS_SUPERVISOR_TOKEN", token)
    started = []
    launcher = up.Launcher(server=lambda spec: started.append(spec), model=lambda m: m)
    assert up.run(config.parse(_with_supervisor(tmp_path)), "local-b", tmp_path, launcher) == 2
    assert started == [] and re.search(message, capsys.readouterr().out)


def test_up_refuses_a_router_without_a_token_for_every_supervisor(tmp_path, monkeypatch, capsys):
    """The router's machine checks the router's tokens too: it would otherwise fail at its first switch."""
    from prfaas_sgl.tools.deploy import up

    scenario = next((Path(__file__).resolve().parents[2] / "scenarios").glob("*.toml"))
    dep = config.parse(_with_supervisor(tmp_path, controller="planner", controller_scenario=str(scenario),
                                        actuator="supervisor"))
    mine = "t" * 32  # local-a's own supervisor's token, but none for local-b's and local-c's
    monkeypatch.setenv("PRFAAS_SUPERVISOR_TOKEN", f"http://10.10.0.11:8101={mine}")
    started = []
    launcher = up.Launcher(server=lambda spec: started.append(spec), model=lambda m: m)
    assert up.run(dep, "local-a", tmp_path, launcher) == 2
    assert started == [] and "no token for ['http://10.10.0.12:8101', 'http://10.10.0.13:8101']" in capsys.readouterr().out


def _without(tmp_path):
    raw = _with_supervisor(tmp_path)
    raw.pop("supervisor")
    return raw


def test_the_examples_documented_supervisor_block_is_accepted(tmp_path):
    """The example file documents [supervisor] commented out (a routable deployment needs a token): uncommented
    as its comment says, it must parse and give the router a supervisor actuator."""
    import tomllib

    from prfaas_sgl.router.actuators.decide import DecideConfig
    from prfaas_sgl.router.config import RouterConfig, parse_supervisor_urls
    from tests.support.router_standin import build_tiny_tokenizer

    text = EXAMPLE.read_text()
    block = [line.removeprefix("#").strip() for line in text[text.index("# [supervisor]"):].splitlines()]
    doc = tomllib.loads("\n".join("[router]" if line.startswith("[router]") else line for line in block))
    raw = tomllib.loads(text)
    raw["supervisor"] = doc["supervisor"]
    raw["router"].update(doc["router"], controller_scenario=str(next(
        (Path(__file__).resolve().parents[2] / "scenarios").glob("*.toml"))))  # the documented path is the target's
    dep = config.parse(raw)
    fields = dep.router_fields(tokenizer_path=build_tiny_tokenizer(str(tmp_path / "tok")))
    assert set(parse_supervisor_urls(fields["supervisor_urls"])) == {"local-prefill-0", "decode-0", "decode-1"}
    cfg = RouterConfig.from_flags(**fields)
    assert (cfg.controller, cfg.actuator, cfg.switch_params) == ("planner", "supervisor", DecideConfig(2, 600.0))
