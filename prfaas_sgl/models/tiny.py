"""Tiny models built offline: seeded random weights, a byte-level BPE tokenizer, nothing downloaded.

Each model directory is a normal Hugging Face checkpoint (config.json, model.safetensors, tokenizer files
with a ChatML chat template) that both SGLang and transformers load. Directories are cached under
`cache_dir()/<name>-<spec hash>`, so a spec change rebuilds and an unchanged spec is reused.

    python -m prfaas_sgl.models.tiny            # builds all, prints their paths
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

    def digest(self) -> str:
        blob = json.dumps({**asdict(self), "vocab": VOCAB_SIZE, "v": 2}, sort_keys=True).encode()
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

SPECS = {s.name: s for s in (LLAMA, QWEN35_HYBRID)}


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

    cls = {"LlamaForCausalLM": "LlamaConfig", "Qwen3_5ForCausalLM": "Qwen3_5TextConfig"}[spec.architecture]
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
    (out / "config.json").write_text(json.dumps(conf, indent=2))


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
