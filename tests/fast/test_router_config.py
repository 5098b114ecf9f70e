"""Router config (flags, TOML file, validation) and the process entry point."""

from __future__ import annotations

import asyncio
import json
import re
import signal
import subprocess
import sys

import aiohttp
import pytest

from prfaas_sgl.router.config import InstanceSpec, RouterConfig, parse_config
from tests.support.router_standin import RoomBoard, Standin, build_tiny_tokenizer

pytestmark = pytest.mark.timeout(60)


def test_flags_override_file_and_specs_parse(tmp_path):
    tok = build_tiny_tokenizer(str(tmp_path / "tok"))
    (tmp_path / "r.toml").write_text(f"""
tokenizer_path = "{tok}"
threshold = 4096
policy = "threshold"
[[prfaas]]
url = "http://10.0.0.1:30000"
bootstrap_port = 8998
kv_events = "tcp://10.0.0.1:5557"
[[decode]]
url = "http://127.0.0.1:30002"
""")
    cfg = parse_config(["--config", str(tmp_path / "r.toml"), "--threshold", "100",
                        "--local-prefill", "http://127.0.0.1:30001;bootstrap=9000;name=lp"])
    assert cfg.policy_params.threshold == 100 and cfg.policy == "threshold"
    assert cfg.prfaas == (InstanceSpec("http://10.0.0.1:30000", 8998, "tcp://10.0.0.1:5557", "prfaas0"),)
    assert cfg.local_prefill == (InstanceSpec("http://127.0.0.1:30001", 9000, None, "lp"),)
    assert cfg.model_name == "tok"


@pytest.mark.parametrize("kw, flag", [
    ({"decode": ()}, "--decode"),
    ({"local_prefill": ("http://h:1",)}, "bootstrap="),
    ({"threshold": -1}, "--threshold"),
    ({"policy": "fastest"}, "--policy"),
    ({"low_watermark": 0.95}, "--low-watermark"),
    ({"tokenizer_path": "/nonexistent"}, "--tokenizer-path"),
    ({"decode_affinity_slack": -2}, "--decode-affinity-slack"),
    ({"max_body_bytes": -1}, "--max-body-bytes"),
    ({"max_chars_per_token": 0}, "--max-chars-per-token"),
    # knobs of nested sub-configs: the sub-config refuses, the message names the router's flag
    ({"link_budget_s": 0}, "--link-budget-s"),
    ({"kv_bytes_per_token": 0}, "--kv-bytes-per-token"),
    ({"state_bytes": -1}, "--state-bytes"),  # accepted by the flag, refused later by the cost model, before
    ({"local_prefill_coef": (1.0, 2.0)}, "--local-prefill-coef"),
    ({"controller_interval_s": 0}, "--controller-interval-s"),
    ({"switch_dwell_s": -1}, "--switch-dwell-s"),
])
def test_validation_names_the_flag(tmp_path, kw, flag):
    base = dict(local_prefill=("http://h:1;bootstrap=8998",), decode=("http://h:2",),
                tokenizer_path=build_tiny_tokenizer(str(tmp_path / "tok")))
    with pytest.raises(ValueError, match=re.escape(flag)):
        RouterConfig.from_flags(**{**base, **kw})


def _minimal(tmp_path, **kw) -> RouterConfig:
    return RouterConfig(local_prefill=("http://h:1;bootstrap=8998",), decode=("http://h:2",),
                        tokenizer_path=build_tiny_tokenizer(str(tmp_path / "tok")), **kw)


@pytest.mark.parametrize("host,token,open_", [
    ("127.0.0.1", "", True), ("::1", "", True), ("localhost", "", True),
    ("0.0.0.0", "", False), ("10.0.0.5", "", False), ("router.example", "", False), ("127.0.0.1", "t", False),
])
def test_admin_open_only_on_loopback_without_token(tmp_path, host, token, open_):
    """The admin endpoints: with no token, /admin/* answers only when nothing but this host can reach the listener."""
    assert _minimal(tmp_path, host=host, admin_token=token).admin_open is open_


def test_admin_token_from_env_flag_wins_and_stays_out_of_repr(tmp_path, monkeypatch):
    tok = build_tiny_tokenizer(str(tmp_path / "tok"))
    argv = ["--local-prefill", "http://h:1;bootstrap=8998", "--decode", "http://h:2", "--tokenizer-path", tok]
    monkeypatch.setenv("PRFAAS_ROUTER_ADMIN_TOKEN", "from-env")
    assert parse_config(argv).admin_token == "from-env"
    cfg = parse_config(argv + ["--admin-token", "from-flag"])
    assert cfg.admin_token == "from-flag" and "from-flag" not in repr(cfg)


def test_body_limit_derives_from_context_length(tmp_path):
    assert _minimal(tmp_path, context_length=4096).body_limit == 4096 * 16 + (1 << 20)
    assert _minimal(tmp_path, max_body_bytes=12345).body_limit == 12345


def test_router_imports_no_torch_or_sglang():
    code = ("import sys, prfaas_sgl.launch_router, prfaas_sgl.router.app; "
            "bad = [m for m in sys.modules if m.split('.')[0] in ('torch', 'sglang', 'transformers')]; "
            "assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_launch_router_process_serves_and_stops(tmp_path):
    async def body():
        board = RoomBoard()
        pre, dec = Standin("prefill", board), Standin("decode", board)
        await pre.start()
        await dec.start()
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "prfaas_sgl.launch_router", "--port", "0", "--local-prefill",
            f"{pre.url};bootstrap=8998", "--decode", dec.url, "--served-model-name", "tiny",
            "--tokenizer-path", build_tiny_tokenizer(str(tmp_path / "tok")), stderr=asyncio.subprocess.PIPE)
        try:
            url = None
            while url is None:
                line = (await asyncio.wait_for(proc.stderr.readline(), 30)).decode()
                assert line, "router exited before listening"
                m = re.search(r"listening on (http://\S+)", line)
                url = m and m.group(1)
            async with aiohttp.ClientSession() as s:
                body = {"model": "tiny", "prompt": "hello world", "max_tokens": 2}
                async with s.post(url + "/v1/completions", data=json.dumps(body)) as r:
                    assert r.status == 200 and (await r.json())["choices"][0]["text"] == "t0 t1 t2 t3 "
            proc.send_signal(signal.SIGTERM)
            assert await asyncio.wait_for(proc.wait(), 30) == 0
        finally:
            if proc.returncode is None:
                proc.kill()
                await proc.wait()
            await pre.close()
            await dec.close()
    asyncio.run(body())


def test_chat_template_read_from_chat_template_jinja(tmp_path):
    # Regression: transformers >= 4.43 saves the template as chat_template.jinja, not in tokenizer_config.json
    # (the tiny models of prfaas_sgl.tools.models.tiny do); the router answered chat requests with "no chat_template".
    from tests.support.router_standin import TINY_TEMPLATE
    from prfaas_sgl.router.tokenize import PromptTokenizer

    root = tmp_path / "tok"
    build_tiny_tokenizer(str(root))
    cfg_path = root / "tokenizer_config.json"
    msgs = [{"role": "user", "content": "hello"}]
    inline = PromptTokenizer(str(root)).render_chat(msgs)
    cfg = json.loads(cfg_path.read_text())
    del cfg["chat_template"]
    cfg_path.write_text(json.dumps(cfg))
    (root / "chat_template.jinja").write_text(TINY_TEMPLATE)
    assert PromptTokenizer(str(root)).render_chat(msgs) == inline
