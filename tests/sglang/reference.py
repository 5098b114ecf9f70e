"""HF transformers greedy decoding: the token-for-token reference for every SGLang route."""
from __future__ import annotations

import functools


@functools.lru_cache(maxsize=4)
def _model(path: str):
    import torch
    import transformers

    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def hf_greedy(path: str, input_ids: list[int], max_new_tokens: int) -> list[int]:
    import torch

    model = _model(path)
    with torch.no_grad():
        out = model.generate(
            torch.tensor([input_ids]), max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens,
            do_sample=False, pad_token_id=0, eos_token_id=None,
        )
    return out[0, len(input_ids):].tolist()
