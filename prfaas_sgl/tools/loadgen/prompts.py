"""Deterministic prompt text of a target token length, built block by block from hash ids.

Block text is a pure function of (seed, hash id): a seeded draw of ``block_size`` words, each written
as " word". Equal leading hash ids therefore give byte-identical leading text, and since BPE
pre-tokenizers split before each space, identical leading *tokens* too — which is what a prefix cache
sees. Ids missing from a trace (fewer than ceil(input_len / block_size)) are filled with blocks private
to the request.

Length: without a tokenizer, one word is assumed to be one token (true for these words in common BPE
vocabularies, off by the chat template's tokens). With a ``tokenizer.json`` the word list is cut to the
words that are one token there, and the tail is trimmed or padded until the count is exact.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from prfaas_sgl.tools.loadgen.words import WORDS

_SHARED, _PRIVATE, _FILLER = 0, 1, 2  # seed namespaces: trace ids can never collide with private blocks
_MIN_WORDS = 16


@dataclass(frozen=True, slots=True)
class _Block:
    text: str
    ends: np.ndarray  # ends[k] = len of the text holding the first k+1 words


class PromptBuilder:
    """Builds prompts; keeps an LRU of at most ``cache_blocks`` block texts.

    ``build`` is serialized by a lock so callers may run it in worker threads (long prompts in exact mode
    take ~1 s to tokenize; the tokenizer releases the GIL, the event loop keeps streaming meanwhile).
    """

    def __init__(self, seed: int, block_size: int, tokenizer_path: str | None = None,
                 cache_blocks: int = 4096) -> None:
        if block_size < 1:
            raise ValueError(f"block size must be >= 1 token, got {block_size}")
        self.seed = seed
        self.block_size = block_size
        self._tok = _load_tokenizer(tokenizer_path) if tokenizer_path else None
        self._words = _single_token_words(self._tok) if self._tok else WORDS
        self._cache: OrderedDict[tuple[int, ...], _Block] = OrderedDict()
        self._cache_blocks = cache_blocks
        self._lock = threading.Lock()
        self.exact = self._tok is not None

    def count_tokens(self, text: str) -> int | None:
        """Exact token count with the tokenizer (no special tokens), None without one."""
        return len(self._tok.encode(text, add_special_tokens=False).ids) if self._tok else None

    def build(self, hash_ids: tuple[int, ...], input_len: int, private_key: tuple[int, ...] = ()) -> str:
        """Prompt of ``input_len`` tokens (exact with a tokenizer, else one token per word).

        ``private_key`` (e.g. (session, turn)) seeds the blocks that fill in for missing hash ids.
        """
        with self._lock:
            return self._build(hash_ids, input_len, private_key)

    def _build(self, hash_ids: tuple[int, ...], input_len: int, private_key: tuple[int, ...]) -> str:
        n_blocks = -(-input_len // self.block_size)
        parts = []
        for j in range(n_blocks):
            key = (_SHARED, h % 2**63) if (h := _at(hash_ids, j)) is not None else (_PRIVATE, *private_key, j)
            block = self._block(key)
            take = min(self.block_size, input_len - j * self.block_size)
            parts.append(block.text[: block.ends[take - 1]])
        text = "".join(parts)
        return self._fit(text, input_len, private_key) if self._tok else text

    def _block(self, key: tuple[int, ...]) -> _Block:
        block = self._cache.get(key)
        if block is None:
            rng = np.random.default_rng([self.seed, *key])
            words = [" " + self._words[i] for i in rng.integers(0, len(self._words), self.block_size)]
            block = _Block("".join(words), np.cumsum([len(w) for w in words]))
            self._cache[key] = block
            if len(self._cache) > self._cache_blocks:
                self._cache.popitem(last=False)
        else:
            self._cache.move_to_end(key)
        return block

    def _fit(self, text: str, target: int, private_key: tuple[int, ...]) -> str:
        # Counts are additive for single-token " word"s in BPE, so this normally takes one step; merges
        # at the very start of the text (e.g. SentencePiece's prefix space) are what it corrects.
        filler = self._block((_FILLER, *private_key)).text.split(" ")[1:]
        for step in range(8):
            diff = target - self.count_tokens(text)
            if diff == 0:
                break
            if diff > 0:
                text += "".join(" " + filler[(step * 7 + i) % len(filler)] for i in range(diff))
            else:
                text = " ".join(text.split(" ")[:diff]) if text.count(" ") > -diff else text[: -1]
        return text


def resolve_tokenizer(arg: str, model: str) -> str | None:
    """``none`` -> None (approximate lengths); ``auto`` -> ``<model>/tokenizer.json`` when the served
    model name is a local directory holding one (SGLang serves a local path under that name), else None;
    anything else is a tokenizer.json path that must exist."""
    if arg == "none":
        return None
    if arg == "auto":
        candidate = Path(model) / "tokenizer.json"
        return str(candidate) if model and candidate.is_file() else None
    if not Path(arg).is_file():
        raise ValueError(f"--tokenizer {arg!r} is not a file; pass a tokenizer.json path, auto or none")
    return arg


def _at(ids: tuple[int, ...], j: int) -> int | None:
    return ids[j] if j < len(ids) else None


def _load_tokenizer(path: str):
    from tokenizers import Tokenizer  # lazy: only the exact-length mode needs it

    return Tokenizer.from_file(path)


def _single_token_words(tok) -> tuple[str, ...]:
    words = tuple(w for w in WORDS if len(tok.encode(" " + w, add_special_tokens=False).ids) == 1)
    if len(words) < _MIN_WORDS:
        raise ValueError(
            f"only {len(words)} of the prompt words are single tokens in this tokenizer; "
            "drop --tokenizer to use approximate lengths"
        )
    return words
