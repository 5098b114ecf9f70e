"""Bytes a prefill hands to decode, derived from a model's config.json (no torch, no sglang).

What SGLang 0.5.23 moves per request in PD (and so what crosses the inter-datacenter link):

    full-attention / MLA pages  every prompt token, page-rounded      grows with the prompt
    SWA window pages            the last `sliding_window_size` tokens  capped at the window
    linear-attention state      one slot per layer (conv + recurrent)  fixed
    aux row                     first token + metadata                 fixed

Per token of one full-attention layer: K + V = kv_heads x (head_dim + v_head_dim) elements; of one MLA
layer: a single latent of kv_lora_rank + qk_rope_head_dim elements. Linear-attention states follow
SGLang's `mamba_utils` shapes: GDN conv (K-1) x (2 key_dim + value_dim), recurrent H_v x D_k x D_v; KDA
conv (K-1) x 3 H D, recurrent H x D x D; Lightning no conv, recurrent H x D x D. Conv states are bf16 and recurrent states fp32 unless the
environment says otherwise (SGLANG_MAMBA_CONV_DTYPE / SGLANG_MAMBA_SSM_DTYPE, read by the caller).

    account(json.load(open("config.json"))).request_bytes(tokens, page_size)
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

# One SGLang 0.5.23 `MetadataBuffers` row without speculative decoding, sampling masks or checksums:
# int32 x 16 (output ids, cached tokens, logprob idx) + f32 x 16 (logprob val, topk p) + int64 x 16
# (topk index) + 128 x (f32 + int32) top logprobs + f32 x 16 hidden-state pad + uint64 x 8 room.
AUX_ROW_BYTES = 16 * 4 * 3 + 16 * 4 * 2 + 16 * 8 + 128 * 8 + 16 * 4 + 8 * 8
DTYPE_BYTES = {"float32": 4, "float": 4, "bfloat16": 2, "float16": 2, "half": 2, "fp8": 1, "float8_e4m3fn": 1}


@dataclass(frozen=True, slots=True)
class Dtypes:
    """Element sizes in bytes: KV cache (the server's --dtype / --kv-cache-dtype), linear-attention conv
    state and recurrent state (SGLang defaults: bf16 and fp32)."""

    kv: int = 2
    conv: int = 2
    ssm: int = 4


@dataclass(frozen=True, slots=True)
class KVAccount:
    """A model's transfer bytes. `kv_bytes_per_token` sums every full-attention / MLA layer;
    `swa_bytes_per_token` every SWA layer, of which only `swa_window` tokens move; `state_bytes` is the
    per-request linear-attention state plus the aux row; `kv_layers` counts the full-attention / MLA layers
    (those whose pages layer-wise streaming sends in groups)."""

    family: str
    kv_bytes_per_token: int
    state_bytes: int
    swa_bytes_per_token: int = 0
    swa_window: int = 0
    kv_layers: int = 0

    def request_bytes(self, tokens: int, page_size: int = 1, cached_prefix: int = 0) -> int:
        """Bytes one PD transfer moves for a prompt of `tokens`, the decode already holding
        `cached_prefix` (page-aligned) of them.

            [0 ............ cached_prefix | ............................. tokens)
                                          [ full pages, rounded up to a page  )
                            [ window_start = floor(max(prefix, tokens - W) / P) * P ... tokens)
        """
        full = page_size * math.ceil(max(tokens - cached_prefix, 0) / page_size)
        window = 0
        if self.swa_bytes_per_token:
            start = max(cached_prefix, tokens - self.swa_window) // page_size * page_size
            window = page_size * math.ceil(max(tokens - start, 0) / page_size)
        return full * self.kv_bytes_per_token + window * self.swa_bytes_per_token + self.state_bytes

    @property
    def fixed_bytes(self) -> int:
        """Per-request bytes that do not grow with the prompt (a full SWA window counted): the router's
        linear cost model `fixed + per_token x l` then never underestimates a transfer."""
        return self.state_bytes + self.swa_window * self.swa_bytes_per_token


def _layers(conf: dict) -> list[str]:
    return list(conf.get("layer_types") or ["full_attention"] * int(conf["num_hidden_layers"]))


def _gqa_token_bytes(conf: dict, layers: int, dt: Dtypes) -> int:
    head = int(conf.get("head_dim") or conf["hidden_size"] // conf["num_attention_heads"])
    kv_heads = int(conf.get("num_key_value_heads") or conf["num_attention_heads"])
    return layers * kv_heads * (head + int(conf.get("v_head_dim") or head)) * dt.kv


def _dense(conf: dict, dt: Dtypes) -> KVAccount:
    layers = int(conf["num_hidden_layers"])
    return KVAccount("dense", _gqa_token_bytes(conf, layers, dt), AUX_ROW_BYTES, kv_layers=layers)


def _gdn(conf: dict, dt: Dtypes) -> KVAccount:
    """Qwen3-Next / Qwen3.5: Gated DeltaNet layers + GQA layers."""
    types = _layers(conf)
    key_dim = conf["linear_num_key_heads"] * conf["linear_key_head_dim"]
    value_dim = conf["linear_num_value_heads"] * conf["linear_value_head_dim"]
    conv = (conf["linear_conv_kernel_dim"] - 1) * (2 * key_dim + value_dim) * dt.conv
    ssm = conf["linear_num_value_heads"] * conf["linear_key_head_dim"] * conf["linear_value_head_dim"] * dt.ssm
    state = types.count("linear_attention") * (conv + ssm)
    full = types.count("full_attention")
    return KVAccount("gdn", _gqa_token_bytes(conf, full, dt), state + AUX_ROW_BYTES, kv_layers=full)


def _kda(conf: dict, dt: Dtypes) -> KVAccount:
    """Kimi Linear: KDA layers + MLA layers (1-based layer lists in `linear_attn_config`)."""
    lin = conf["linear_attn_config"]
    heads, dim = lin["num_heads"], lin["head_dim"]
    conv = (lin["short_conv_kernel_size"] - 1) * 3 * heads * dim * dt.conv
    state = len(lin["kda_layers"]) * (conv + heads * dim * dim * dt.ssm)
    latent = conf["kv_lora_rank"] + conf["qk_rope_head_dim"]
    full = len(lin["full_attn_layers"])
    return KVAccount("kda", full * latent * dt.kv, state + AUX_ROW_BYTES, kv_layers=full)


def _swa(conf: dict, dt: Dtypes) -> KVAccount:
    """MiMo-V2-Flash: SWA layers + GQA layers. SGLang reads `hybrid_layer_pattern` (1 = SWA) and `swa_*`;
    a transformers-native config has only `layer_types`, and its SWA layers carry twice the KV heads."""
    pattern = conf.get("hybrid_layer_pattern") or [int(t == "sliding_attention") for t in _layers(conf)]
    swa_conf = {
        "head_dim": conf.get("swa_head_dim", conf.get("head_dim")),
        "v_head_dim": conf.get("swa_v_head_dim", conf.get("v_head_dim")),
        "num_key_value_heads": conf.get("swa_num_key_value_heads", 2 * conf["num_key_value_heads"]),
        "num_attention_heads": conf.get("swa_num_attention_heads", conf["num_attention_heads"]),
    }
    window = next(conf[k] for k in ("sliding_window_size", "sliding_window", "window_size") if conf.get(k))
    return KVAccount("swa", _gqa_token_bytes(conf, pattern.count(0), dt), AUX_ROW_BYTES,
                     _gqa_token_bytes(swa_conf, pattern.count(1), dt), int(window), kv_layers=pattern.count(0))


def _bailing_layers(conf: dict) -> list[bool]:
    """True per linear layer, as SGLang's BailingHybridConfig.layers_block_type reads `layer_group_size`:
    an int g puts full attention at every g-th layer; a list marks linear layers with 1."""
    g = conf.get("layer_group_size", 1)
    if isinstance(g, list):
        return [x == 1 for x in g]
    return [(i + 1) % int(g) != 0 for i in range(int(conf["num_hidden_layers"]))]


def _lightning(conf: dict, dt: Dtypes) -> KVAccount:
    """Ring-2.5 / Ring-linear (SGLang's `bailing_hybrid`): Lightning layers + MLA (or GQA) layers. A
    Lightning state is Mamba2StateShape(num_heads = num_attention_heads, head_dim, state_size = head_dim)
    with no conv (conv_dim 0); a checkpoint with `short_conv_kernel_size` is Ling-V3's KDA variant."""
    linear = _bailing_layers(conf)
    heads = int(conf["num_attention_heads"])
    dim = int(conf.get("head_dim") or conf["hidden_size"] // heads)
    kernel = conf.get("short_conv_kernel_size")
    conv = (int(kernel) - 1) * 3 * heads * dim * dt.conv if kernel else 0
    state = linear.count(True) * (conv + heads * dim * dim * dt.ssm)
    full = linear.count(False)
    if conf.get("full_attention_type", "mla") == "mla":
        per_token = full * (conf["kv_lora_rank"] + conf["qk_rope_head_dim"]) * dt.kv
    else:
        per_token = _gqa_token_bytes(conf, full, dt)
    return KVAccount("kda" if kernel else "lightning", per_token, state + AUX_ROW_BYTES, kv_layers=full)


# First match wins; the dense rule takes whatever is left.
FAMILIES: tuple[tuple[Callable[[dict], bool], Callable[[dict, Dtypes], KVAccount]], ...] = (
    (lambda c: c.get("model_type") == "bailing_hybrid", _lightning),
    (lambda c: bool(c.get("linear_attn_config")) and "kv_lora_rank" in c, _kda),
    (lambda c: "linear_num_value_heads" in c, _gdn),
    (lambda c: bool(c.get("hybrid_layer_pattern")) or "sliding_attention" in (c.get("layer_types") or ()), _swa),
    (lambda c: True, _dense),
)


def account(conf: dict, dtypes: Dtypes | None = None) -> KVAccount:
    """The transfer bytes of the model `conf` (a config.json as a dict; a multimodal config's
    `text_config` is used). `dtypes` default: KV in the config's dtype, conv bf16, recurrent fp32."""
    conf = conf.get("text_config") or conf
    if dtypes is None:
        dtypes = Dtypes(kv=DTYPE_BYTES[str(conf.get("dtype") or conf.get("torch_dtype") or "bfloat16")])
    for matches, build in FAMILIES:
        if matches(conf):
            return build(conf, dtypes)
    raise AssertionError("unreachable: the dense rule matches every config")


def account_path(model_path: str | Path, dtypes: Dtypes | None = None) -> KVAccount:
    path = Path(model_path) / "config.json"
    if not path.is_file():
        raise ValueError(f"--model-path {model_path!r}: no config.json there")
    return account(json.loads(path.read_text()), dtypes)
