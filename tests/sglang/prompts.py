"""Deterministic prompts of chosen token lengths for a tiny model's tokenizer."""
from __future__ import annotations

from pathlib import Path

from prfaas_sgl.tools.models.tiny import corpus


def prompt_ids(model_path: str, n_tokens: int, seed: int = 1) -> list[int]:
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(Path(model_path) / "tokenizer.json"))
    ids: list[int] = []
    for line in corpus(n_lines=4000, seed=seed):
        ids += tok.encode(line + "\n").ids
        if len(ids) >= n_tokens:
            return ids[:n_tokens]
    raise ValueError(f"corpus too short for {n_tokens} tokens")
