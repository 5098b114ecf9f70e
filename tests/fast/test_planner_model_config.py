"""Planner scenarios whose S_kv(l) comes from a model's config.json (router/planner/model_config.py): the
tiny models' configs and hand-written configs shaped like the released ones, each checked against bytes
worked out by hand here (layers x heads x dims x element size), through `prfaas plan --model-config`."""
from __future__ import annotations

import copy
import json
import tomllib
from pathlib import Path

import pytest

from prfaas_sgl.cli import main
from prfaas_sgl.tools.models import tiny
from prfaas_sgl.router.planner import ProfileError, load_scenario, parse_scenario

ROOT = Path(__file__).resolve().parents[2]
SCENARIO = ROOT / "scenarios" / "kimi_linear_48b.toml"
AUX = 1600  # SGLang's metadata row per request (test_models_accounting pins it)
MIB = 2**20

KIMI_LINEAR_48B = {  # moonshotai/Kimi-Linear-48B-A3B-Instruct (attention part)
    "model_type": "kimi_linear", "dtype": "bfloat16", "num_hidden_layers": 27, "hidden_size": 2304,
    "num_attention_heads": 32, "kv_lora_rank": 512, "qk_rope_head_dim": 64, "v_head_dim": 128,
    "linear_attn_config": {"full_attn_layers": [4, 8, 12, 16, 20, 24, 27], "head_dim": 128, "num_heads": 32,
                           "kda_layers": [i for i in range(1, 27) if i % 4], "short_conv_kernel_size": 4}}
QWEN35_SHAPED = {  # Qwen3.5-style multimodal config: the text model under text_config, GDN : GQA = 3 : 1
    "model_type": "qwen3_5_moe", "text_config": {
        "dtype": "bfloat16", "num_hidden_layers": 60, "num_attention_heads": 32, "num_key_value_heads": 2,
        "head_dim": 256, "linear_num_key_heads": 16, "linear_num_value_heads": 64, "linear_key_head_dim": 128,
        "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4,
        "layer_types": (["linear_attention"] * 3 + ["full_attention"]) * 15}}
MIMO_V2_FLASH = {  # SWA : GQA with full attention at layer 0 and every 6th layer, window 128
    "dtype": "bfloat16", "num_hidden_layers": 48, "num_attention_heads": 64, "num_key_value_heads": 4,
    "head_dim": 192, "v_head_dim": 128, "sliding_window": 128,
    "layer_types": ["full_attention" if i == 0 or (i + 1) % 6 == 0 else "sliding_attention" for i in range(48)]}
RING_SHAPED = {  # SGLang's bailing_hybrid: Lightning : MLA = 7 : 1 (layer_group_size 8), no short conv
    "model_type": "bailing_hybrid", "dtype": "bfloat16", "num_hidden_layers": 80, "hidden_size": 8192,
    "num_attention_heads": 64, "head_dim": 128, "layer_group_size": 8, "kv_lora_rank": 512,
    "qk_rope_head_dim": 64}


def _write(tmp_path: Path, conf: dict) -> Path:
    path = tmp_path / "config.json"
    path.write_text(json.dumps(conf))
    return path


def _tiny(spec: tiny.TinySpec) -> dict:
    # what tiny.build_model writes: transformers' config (dtype float32) plus the spec's keys
    return {"dtype": "float32", **spec.config}


# (config, bytes per token, fixed bytes per request, SWA bytes per token, window): worked out by hand
HAND = {
    # 2 MLA layers x (32 latent + 8 rope) x 4 B; 6 KDA layers x (conv 3 x 3 x 4x16 x 2 B + 4 x 16 x 16 x 4 B)
    "tiny-kimi": (_tiny(tiny.KIMI_LINEAR), 2 * 40 * 4, 6 * (3 * 3 * 64 * 2 + 4 * 16 * 16 * 4) + AUX, 0, 0),
    # 2 GQA layers x 2 heads x (16 K + 16 V) x 4 B; 6 GDN layers x (3 x (2 x 32 + 64) x 2 B + 4 x 16 x 16 x 4 B)
    "tiny-qwen35": (_tiny(tiny.QWEN35_HYBRID), 2 * 2 * 32 * 4, 6 * (3 * 128 * 2 + 4 * 16 * 16 * 4) + AUX, 0, 0),
    # 2 GQA layers x 1 head x (16 + 8) x 4 B; 6 SWA layers x 2 heads x (16 + 8) x 4 B over 127 tokens
    "tiny-mimo": (_tiny(tiny.MIMO_SWA), 2 * 24 * 4, AUX, 6 * 2 * 24 * 4, 127),
    # 7 MLA layers x 576 x 2 B; 20 KDA layers x (3 x 3 x 4096 x 2 B + 32 x 128 x 128 x 4 B)
    "kimi-48b": (KIMI_LINEAR_48B, 7 * 576 * 2, 20 * (73_728 + 2_097_152) + AUX, 0, 0),
    # 15 GQA layers x 2 heads x 512 x 2 B; 45 GDN layers x (3 x (2 x 2048 + 8192) x 2 B + 64 x 128 x 128 x 4 B)
    "qwen35": (QWEN35_SHAPED, 15 * 2 * 512 * 2, 45 * (73_728 + 4_194_304) + AUX, 0, 0),
    # 9 GQA layers x 4 heads x (192 + 128) x 2 B; 39 SWA layers x 8 heads x 320 x 2 B over 128 tokens
    "mimo": (MIMO_V2_FLASH, 9 * 4 * 320 * 2, AUX, 39 * 8 * 320 * 2, 128),
    # 10 MLA layers x 576 x 2 B; 70 Lightning layers x 64 x 128 x 128 x 4 B (no conv)
    "ring": (RING_SHAPED, 10 * 576 * 2, 70 * 64 * 128 * 128 * 4 + AUX, 0, 0),
    # the same with a short conv is SGLang's KDA variant (Ling-V3): + conv 3 x 3 x 64x128 x 2 B per layer
    "ring-kda": ({**RING_SHAPED, "short_conv_kernel_size": 4}, 10 * 576 * 2,
                 70 * (3 * 3 * 8192 * 2 + 64 * 128 * 128 * 4) + AUX, 0, 0),
}


def s_kv(per_token: int, fixed: int, swa: int, window: int, length: int) -> int:
    return fixed + per_token * length + swa * min(length, window)


@pytest.mark.parametrize("name", sorted(HAND))
def test_s_kv_from_config_matches_hand_count(tmp_path, name):
    conf, per_token, fixed, swa, window = HAND[name]
    scn = load_scenario(SCENARIO, _write(tmp_path, conf))
    kv = scn.system.kv_bytes
    for length in (1, 64, 127, 128, 1000, 32_768, 131_072):
        assert kv.at(length) == pytest.approx(s_kv(per_token, fixed, swa, window, length), rel=1e-12), length
    assert scn.baseline.kv_bytes is kv  # both deployments move the same bytes


def test_swa_beyond_the_window_grows_with_full_layers_only(tmp_path):
    conf, per_token, *_ = HAND["mimo"]
    kv = load_scenario(SCENARIO, _write(tmp_path, conf)).system.kv_bytes
    assert kv.at(65_536) - kv.at(32_768) == pytest.approx(32_768 * per_token)
    # every SWA page would be 8.7x the full layers' bytes per token; the window caps them at 128 tokens
    assert kv.at(32_768) < 32_768 * (per_token + 39 * 8 * 320 * 2) / 8


def test_kv_dtype_overrides_the_configs(tmp_path):
    path = _write(tmp_path, KIMI_LINEAR_48B)
    fp8 = load_scenario(SCENARIO, path, kv_dtype="fp8").system.kv_bytes
    # latents at 1 B; the states keep their own types (conv bf16, recurrent fp32)
    assert fp8.at(1000) == 20 * (73_728 + 2_097_152) + AUX + 1000 * 7 * 576


def test_scenario_file_names_the_config_relative_to_itself(tmp_path):
    model_dir = tmp_path / "kimi"
    model_dir.mkdir()
    _write(model_dir, KIMI_LINEAR_48B)
    doc = tomllib.loads(SCENARIO.read_text())
    doc["model"] = {"config": "kimi"}  # a model directory
    scn = parse_scenario(doc, base_dir=tmp_path)
    assert scn.account.family == "kda"
    assert scn.system.kv_bytes.at(0) == 20 * (73_728 + 2_097_152) + AUX


@pytest.mark.parametrize("model, needle", [
    ({"config": "missing.json"}, "model.config: "),
    ({"config": "bad.json"}, "is not valid JSON"),
    ({"config": "partial.json"}, "lacks a field"),
    ({"config": "partial.json", "kv_dtype": "int3"}, "model.kv_dtype: expected one of"),
])
def test_bad_model_config_names_the_field(tmp_path, model, needle):
    (tmp_path / "bad.json").write_text("{")
    (tmp_path / "partial.json").write_text(json.dumps({"linear_num_value_heads": 4, "num_hidden_layers": 2}))
    doc = copy.deepcopy(tomllib.loads(SCENARIO.read_text()))
    doc["model"] = model
    with pytest.raises(ProfileError, match=needle):
        parse_scenario(doc, base_dir=tmp_path)


def test_cli_plan_with_model_config(tmp_path, capsys):
    path = _write(tmp_path, KIMI_LINEAR_48B)
    assert main(["plan", str(SCENARIO), "--model-config", str(path), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["model"] == {"family": "kda", "kv_bytes_per_token": 8064, "state_bytes": 43_419_200,
                            "swa_bytes_per_token": 0, "swa_window": 0}
    prfaas = doc["rows"][0]
    assert prfaas["name"] == "prfaas_pd" and prfaas["lambda_max_rps"] > 0
    assert main(["plan", str(SCENARIO), "--model-config", str(path)]) == 0
    assert "model: kda, 8064 B/token KV, 41.41 MiB fixed state per request" in capsys.readouterr().out
    assert 43_419_200 / MIB == pytest.approx(41.41, abs=0.005)


def test_cli_plan_missing_model_config_is_an_error(tmp_path, capsys):
    assert main(["plan", str(SCENARIO), "--model-config", str(tmp_path / "nope.json")]) == 2
    assert "model.config" in capsys.readouterr().err
