"""Tiny models built offline: seeded random weights, a byte-level BPE tokenizer, nothing downloaded.

Each model directory is a normal Hugging Face checkpoint (config.json, model.safetensors, tokenizer files
with a ChatML chat template) that both SGLang and transformers load. Directories are cached under
`cache_dir()/<name>-<spec hash>`, so a spec change rebuilds and an unchanged spec is reused.

    python -m prfaas_sgl.tools.models.tiny            # builds all, prints their paths
"""
from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path

VOCAB_SIZE = 512
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHATML = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
WORDS = (
    "prefill decode cache token layer state attention linear window block page router cluster link "
    "bandwidth queue latency throughput request model serve compute memory transfer remote local "
    "the a of to and in is for on with as by at from it this that be are was or an"
).split()


@dataclass(frozen=True)
class TinySpec:
    name: str
    architecture: str
    config: dict = field(default_factory=dict)
    seed: int = 0
    init_std: float = 0.1  # larger than HF's 0.02: peaky logits keep greedy argmax far from ties
    drop_keys: tuple[str, ...] = ()  # config.json keys transformers writes that would mislead SGLang
    renames: tuple[tuple[str, str], ...] = ()  # weight-name fixes after save_pretrained (substring, new)

    def digest(self) -> str:
        fields = {k: v for k, v in asdict(self).items() if v != ()}  # a spec without drop_keys keeps its hash
        blob = json.dumps({**fields, "vocab": VOCAB_SIZE, "v": 2}, sort_keys=True).encode()
        return hashlib.sha256(blob).hexdigest()[:10]


LLAMA = TinySpec(
    name="tiny-llama",
    architecture="LlamaForCausalLM",
    config=dict(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=8192, rope_theta=10000.0,
    ),
)

# Qwen3.5 dense text model: Gated-DeltaNet : full attention = 3 : 1 over 8 layers (dense MLP, so no MoE
# kernel is needed on CPU). `full_attention_interval` is read by SGLang's config class on this path.
QWEN35_HYBRID = TinySpec(
    name="tiny-qwen35-hybrid",
    architecture="Qwen3_5ForCausalLM",
    config=dict(
        hidden_size=64, intermediate_size=128, num_hidden_layers=8, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=8192,
        linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
        linear_value_head_dim=16, linear_conv_kernel_dim=4, full_attention_interval=4,
        layer_types=["linear_attention"] * 3 + ["full_attention"] + ["linear_attention"] * 3
        + ["full_attention"],
    ),
)

# Kimi Linear: KDA : MLA = 3 : 1 over 8 layers (1-based `linear_attn_config` lists, as SGLang and the
# released checkpoint read them), MLA with NoPE (`mla_use_nope`), dense MLP. transformers stores
# `num_local_experts` as `num_experts` (256 by default): dropped, or SGLang would build MoE layers.
KIMI_LINEAR = TinySpec(
    name="tiny-kimi-linear",
    architecture="KimiLinearForCausalLM",
    config=dict(
        hidden_size=64, intermediate_size=128, num_hidden_layers=8, num_attention_heads=4,
        num_key_value_heads=4, max_position_embeddings=8192, q_lora_rank=None, kv_lora_rank=32,
        qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, mla_use_nope=True,
        mlp_layer_types=["dense"] * 8,
        linear_attn_config=dict(kda_layers=[1, 2, 3, 5, 6, 7], full_attn_layers=[4, 8], num_heads=4,
                                head_dim=16, short_conv_kernel_size=4),
    ),
    drop_keys=("num_experts",),
    # save_pretrained reverses transformers' `.block_sparse_moe.` -> `.mlp.` load mapping for every layer;
    # checkpoints (and SGLang) name a dense MLP `.mlp.`
    renames=((".block_sparse_moe.", ".mlp."),),
)

# MiMo-V2-Flash-style SWA : GQA = 3 : 1 (full attention at layers 0 and 5, as transformers' default
# pattern), dense MLP, q/k head dim 16 > v head dim 8, SWA layers with twice the KV heads and attention
# sinks. Both readers are served from one config.json: transformers reads `layer_types`, `sliding_window`
# (a window of 128 tokens, the current one included) and per-type `rope_parameters`; SGLang reads
# `hybrid_layer_pattern`, `swa_*`, `rope_theta`/`partial_rotary_factor` and `sliding_window_size`, whose
# mask `k >= q - size` spans size + 1 tokens, hence 127.
_ROPE = {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5}
MIMO_SWA = TinySpec(
    name="tiny-mimo-v2-swa",
    architecture="MiMoV2FlashForCausalLM",
    config=dict(
        hidden_size=64, intermediate_size=128, num_hidden_layers=8, num_attention_heads=4,
        num_key_value_heads=1, head_dim=16, v_head_dim=8, max_position_embeddings=8192,
        sliding_window=128, sliding_window_size=127, mlp_layer_types=["dense"] * 8,
        layer_types=["full_attention"] + ["sliding_attention"] * 4 + ["full_attention"]
        + ["sliding_attention"] * 2,
        # "rope_type" at the top makes SGLang's `rope_scaling` read as "no scaling"; transformers reads
        # the per-layer-type entries
        rope_parameters={"rope_type": "default", "full_attention": _ROPE, "sliding_attention": _ROPE},
        rope_theta=10000.0, swa_rope_theta=10000.0, partial_rotary_factor=0.5,
        hybrid_layer_pattern=[0, 1, 1, 1, 1, 0, 1, 1], swa_num_attention_heads=4,
        swa_num_key_value_heads=2, swa_head_dim=16, swa_v_head_dim=8, attention_value_scale=0.707,
        add_swa_attention_sink_bias=True, add_full_attention_sink_bias=False, layernorm_epsilon=1e-6,
        rms_norm_eps=1e-6, moe_layer_freq=[0] * 8,
    ),
)

SPECS = {s.name: s for s in (LLAMA, QWEN35_HYBRID, KIMI_LINEAR, MIMO_SWA)}


def cache_dir() -> Path:
    return Path(os.environ.get("PRFAAS_MODEL_CACHE", Path.home() / ".cache" / "prfaas-sgl" / "models"))


def corpus(n_lines: int = 2000, seed: int = 0) -> list[str]:
    """Deterministic training text for the tokenizer (and prompts in tests)."""
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(4, 16))) for _ in range(n_lines)]


def build_tokenizer(out: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE, special_tokens=SPECIALS, show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(corpus(), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>", bos_token=None,
    )
    fast.chat_template = CHATML
    fast.save_pretrained(out)


def _hf_config(spec: TinySpec, eos_id: int, pad_id: int):
    import transformers

    cls = {"LlamaForCausalLM": "LlamaConfig", "Qwen3_5ForCausalLM": "Qwen3_5TextConfig",
           "KimiLinearForCausalLM": "KimiLinearConfig", "MiMoV2FlashForCausalLM": "MiMoV2FlashConfig"}[spec.architecture]
    cfg = getattr(transformers, cls)(
        vocab_size=VOCAB_SIZE, eos_token_id=eos_id, pad_token_id=pad_id, bos_token_id=None,
        tie_word_embeddings=False, initializer_range=spec.init_std, **spec.config,
    )
    cfg.architectures = [spec.architecture]
    cfg.torch_dtype = "float32"
    return cfg


def build_model(spec: TinySpec, out: Path) -> None:
    import torch
    import transformers

    build_tokenizer(out)
    tok = transformers.AutoTokenizer.from_pretrained(out)
    cfg = _hf_config(spec, tok.convert_tokens_to_ids("<|im_end|>"), tok.pad_token_id)
    torch.manual_seed(spec.seed)
    model = getattr(transformers, spec.architecture)(cfg).to(torch.float32)
    model.save_pretrained(out)
    # Keys SGLang reads that transformers does not write for this class.
    conf = json.loads((out / "config.json").read_text())
    conf.update({k: v for k, v in spec.config.items() if k not in conf})
    for key in spec.drop_keys:
        conf.pop(key, None)
    (out / "config.json").write_text(json.dumps(conf, indent=2))
    if spec.renames:
        _rename_weights(out / "model.safetensors", spec.renames)


def _rename_weights(path: Path, renames: tuple[tuple[str, str], ...]) -> None:
    from safetensors.torch import load_file, save_file

    tensors = load_file(path)
    for old, new in renames:
        tensors = {k.replace(old, new): v for k, v in tensors.items()}
    save_file(tensors, path, metadata={"format": "pt"})


def ensure(name: str) -> Path:
    """Path of the built model `name` (see SPECS), building it once if missing. Safe across processes."""
    spec = SPECS[name]
    final = cache_dir() / f"{spec.name}-{spec.digest()}"
    if (final / "model.safetensors").exists():
        return final
    tmp = final.with_name(f"{final.name}.tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    build_model(spec, tmp)
    try:
        tmp.rename(final)  # atomic publish; a concurrent builder that lost the race drops its copy
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)
    return final


def main(argv: list[str] | None = None) -> int:
    names = (argv if argv is not None else sys.argv[1:]) or list(SPECS)
    for name in names:
        print(f"{name}\t{ensure(name)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
