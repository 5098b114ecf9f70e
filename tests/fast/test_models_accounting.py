"""Model-derived transfer bytes (router/kv_accounting.py) against values worked out by hand, for every
family's tiny config and for released configs; the router's --model-path default and its overrides.
The same accounting against bytes measured on the wire: tests/sglang/test_families.py."""
from __future__ import annotations

import json

import pytest

from prfaas_sgl.tools.models import tiny
from prfaas_sgl.router.config import parse_config
from prfaas_sgl.router.kv_accounting import AUX_ROW_BYTES, Dtypes, account

FP32 = Dtypes(kv=4)  # CPU servers run --dtype float32; conv states stay bf16, recurrent fp32


def tiny_conf(spec: tiny.TinySpec) -> dict:
    return {"num_hidden_layers": spec.config["num_hidden_layers"], "dtype": "float32", **spec.config}


def test_aux_row_is_sglang_metadata_row():
    # 16 x int32 ids + cached + logprob idx, 16 x f32 logprob val + topk p, 16 x int64 topk idx,
    # 128 x (f32 + int32) top logprobs, 16 x f32 hidden pad, 8 x uint64 room
    assert AUX_ROW_BYTES == 192 + 128 + 128 + 1024 + 64 + 64 == 1600


@pytest.mark.parametrize("spec, family, per_token, state", [
    # 2 layers x 2 KV heads x (16 K + 16 V) x 4 B
    (tiny.LLAMA, "dense", 2 * 2 * 32 * 4, 0),
    # 2 GQA layers as llama; 6 GDN layers x (conv 3 x (2 x 2x16 + 4x16) x 2 B + 4 x 16 x 16 x 4 B)
    (tiny.QWEN35_HYBRID, "gdn", 2 * 2 * 32 * 4, 6 * (3 * 128 * 2 + 4 * 16 * 16 * 4)),
    # 2 MLA layers x (32 latent + 8 rope) x 4 B; 6 KDA layers x (conv 3 x 3 x 4x16 x 2 B + 4 x 16 x 16 x 4 B)
    (tiny.KIMI_LINEAR, "kda", 2 * 40 * 4, 6 * (3 * 192 * 2 + 4 * 16 * 16 * 4)),
    # 2 GQA layers x 1 KV head x (16 K + 8 V) x 4 B; no state
    (tiny.MIMO_SWA, "swa", 2 * 1 * 24 * 4, 0),
])
def test_tiny_models(spec, family, per_token, state):
    acct = account(tiny_conf(spec), FP32)
    assert (acct.family, acct.kv_bytes_per_token, acct.state_bytes) == (family, per_token, state + AUX_ROW_BYTES)
    assert account(tiny_conf(spec)) == acct  # dtype from the config's "dtype"


def test_tiny_swa_sends_only_the_window():
    acct = account(tiny_conf(tiny.MIMO_SWA), FP32)
    # 6 SWA layers x 2 KV heads x (16 + 8) x 4 B; SGLang's window is sliding_window_size = 127
    assert (acct.swa_bytes_per_token, acct.swa_window) == (6 * 2 * 24 * 4, 127)
    assert acct.request_bytes(1500) == 1500 * 192 + 127 * 1152 + 1600 == 435_904
    assert acct.request_bytes(100) == 100 * (192 + 1152) + 1600  # shorter than the window: every page
    every_page = 1500 * (192 + 1152) + 1600
    assert every_page / acct.request_bytes(1500) == pytest.approx(4.63, abs=0.01)
    assert acct.fixed_bytes == 1600 + 127 * 1152


def test_request_bytes_page_rounding_and_cached_prefix():
    acct = account(tiny_conf(tiny.MIMO_SWA), FP32)
    # page 16, prompt 1500: full pages [0, 1504); window from floor((1500 - 127) / 16) * 16 = 1360
    assert acct.request_bytes(1500, page_size=16) == 1504 * 192 + 144 * 1152 + 1600
    # decode holds [0, 1456): full pages [1456, 1504); the window starts at 1456 too
    assert acct.request_bytes(1500, page_size=16, cached_prefix=1456) == 48 * 192 + 48 * 1152 + 1600
    kda = account(tiny_conf(tiny.KIMI_LINEAR), FP32)
    assert kda.request_bytes(1500) == 1500 * 320 + kda.state_bytes


KIMI_LINEAR_48B = {  # moonshotai/Kimi-Linear-48B-A3B-Instruct config.json (attention part)
    "model_type": "kimi_linear", "dtype": "bfloat16", "num_hidden_layers": 27, "hidden_size": 2304,
    "num_attention_heads": 32, "kv_lora_rank": 512, "qk_rope_head_dim": 64, "qk_nope_head_dim": 128,
    "v_head_dim": 128, "linear_attn_config": {
        "full_attn_layers": [4, 8, 12, 16, 20, 24, 27], "head_dim": 128, "num_heads": 32,
        "kda_layers": [1, 2, 3, 5, 6, 7, 9, 10, 11, 13, 14, 15, 17, 18, 19, 21, 22, 23, 25, 26],
        "short_conv_kernel_size": 4}}
QWEN3_NEXT_80B = {  # transformers 5.19 Qwen3NextConfig defaults (Qwen/Qwen3-Next-80B-A3B-Instruct)
    "dtype": "bfloat16", "num_hidden_layers": 48, "num_attention_heads": 16, "num_key_value_heads": 2,
    "head_dim": 256, "linear_num_key_heads": 16, "linear_num_value_heads": 32, "linear_key_head_dim": 128,
    "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4,
    "layer_types": (["linear_attention"] * 3 + ["full_attention"]) * 12}
MIMO_V2_FLASH = {  # transformers 5.19 MiMoV2FlashConfig defaults (XiaomiMiMo/MiMo-V2-Flash)
    "dtype": "bfloat16", "num_hidden_layers": 48, "num_attention_heads": 64, "num_key_value_heads": 4,
    "head_dim": 192, "v_head_dim": 128, "sliding_window": 128,
    "layer_types": ["full_attention" if i == 0 or (i + 1) % 6 == 0 else "sliding_attention" for i in range(48)]}


def test_released_configs():
    kimi = account(KIMI_LINEAR_48B)
    # 7 MLA layers x 576 latent x 2 B; 20 KDA layers x (3 x 3 x 4096 x 2 B + 32 x 128 x 128 x 4 B)
    assert (kimi.kv_bytes_per_token, kimi.state_bytes) == (8064, 20 * (73_728 + 2_097_152) + 1600)
    assert kimi.kv_layers == 7
    qwen = account(QWEN3_NEXT_80B)
    # 12 GQA layers x 2 heads x 512 x 2 B; 36 GDN layers x (3 x (2 x 2048 + 4096) x 2 B + 32 x 128 x 128 x 4 B)
    assert (qwen.family, qwen.kv_bytes_per_token, qwen.state_bytes) == ("gdn", 24_576, 36 * 2_146_304 + 1600)
    assert qwen.kv_layers == 12
    mimo = account(MIMO_V2_FLASH)
    # 9 GQA layers x 4 heads x (192 + 128) x 2 B; 39 SWA layers with 8 heads (twice the GQA layers')
    assert (mimo.kv_bytes_per_token, mimo.swa_bytes_per_token, mimo.swa_window) == (23_040, 199_680, 128)
    assert mimo.kv_layers == 9
    # a 32K-token prompt: the SWA layers move 128 tokens, not 32K
    assert mimo.request_bytes(32768) == 32768 * 23_040 + 128 * 199_680 + 1600


def test_router_model_path_default_and_override(tmp_path):
    model = tmp_path / "m"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(KIMI_LINEAR_48B))
    (model / "tokenizer.json").write_text("{}")
    base = ["--decode", "http://d:1", "--prfaas", "http://p:1;bootstrap=2", "--tokenizer-path", str(model)]
    cfg = parse_config(base + ["--model-path", str(model)])
    assert (cfg.cost.kv_bytes_per_token, cfg.cost.state_bytes) == (8064.0, float(account(KIMI_LINEAR_48B).fixed_bytes))
    assert cfg.kv_stream.attention_layers == 7  # its MLA layers: what a layer-wise prefill streams in groups
    assert parse_config(base + ["--model-path", str(model), "--attention-layers", "3"]).kv_stream.attention_layers == 3
    cfg = parse_config(base + ["--model-path", str(model), "--kv-bytes-per-token", "5"])
    assert (cfg.cost.kv_bytes_per_token, cfg.cost.state_bytes) == (5.0, float(account(KIMI_LINEAR_48B).fixed_bytes))
    assert parse_config(base).cost.kv_bytes_per_token == 17_100.0  # no model: the paper's case-study default
    with pytest.raises(ValueError, match="no config.json"):
        parse_config(base + ["--model-path", str(tmp_path)])
