"""Prompt tokenization in the router: the model's tokenizer.json and chat template, without transformers.

Matches what an SGLang server does with the same files: chat requests are rendered with the template
(``add_generation_prompt=True``) and encoded without extra special tokens (the template carries them);
plain-text prompts are encoded with the tokenizer's special tokens, as ``/generate`` does.

Encoding goes through ``encode_batch``: its binding releases the GIL while Rust works, whereas
``Tokenizer.encode`` keeps it, so a long prompt tokenized on a worker thread would freeze the event loop.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer

from prfaas_sgl.srt.request_guard import TEMPLATE_CALL_ARGS


class TemplateError(ValueError):
    """The chat template rejected the messages (maps to HTTP 400)."""


# Names a client's chat_template_kwargs must not set: those the router passes to the template itself, and the
# parameters of the `apply_chat_template` call SGLang makes (the same name from a client was a TypeError there).
RESERVED_TEMPLATE_KWARGS = frozenset({"messages", "add_generation_prompt", "bos_token", "eos_token"}) | TEMPLATE_CALL_ARGS


def _token_text(tok: Any) -> str:
    if isinstance(tok, dict):
        return str(tok.get("content", ""))
    return tok or ""


def _raise(message: str) -> None:
    raise TemplateError(message)


class PromptTokenizer:
    """Tokenizer + chat template loaded once from a model directory."""

    def __init__(self, path: str) -> None:
        root = Path(path)
        self.tok = Tokenizer.from_file(str(root / "tokenizer.json"))
        cfg_path = root / "tokenizer_config.json"
        cfg = json.loads(cfg_path.read_text()) if cfg_path.is_file() else {}
        self.bos, self.eos = _token_text(cfg.get("bos_token")), _token_text(cfg.get("eos_token"))
        template = cfg.get("chat_template")
        jinja_path = root / "chat_template.jinja"  # where transformers >= 4.43 saves it
        if template is None and jinja_path.is_file():
            template = jinja_path.read_text()
        if isinstance(template, list):  # [{name, template}, ...]: HF picks "default"
            named = {t["name"]: t["template"] for t in template}
            template = named.get("default", next(iter(named.values()), None))
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = _raise
        self.template = env.from_string(template) if template else None

    @property
    def vocab_size(self) -> int:
        """Token ids this tokenizer can produce, its added (special) tokens included."""
        return self.tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool) -> list[int]:
        """Token ids of ``text``; releases the GIL while the tokenizer runs (see the module docstring)."""
        return self.tok.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids

    def encode_text(self, text: str) -> list[int]:
        return self.encode(text, add_special_tokens=True)

    def render_chat(self, messages: list[dict[str, Any]], **extra: Any) -> str:
        if self.template is None:
            raise TemplateError("this model has no chat_template; use /v1/completions")
        try:
            return self.template.render(messages=messages, add_generation_prompt=True,
                                        bos_token=self.bos, eos_token=self.eos, **extra)
        except TemplateError:
            raise
        except Exception as e:  # the template runs on client data: any failure is the request's (TypeError, ...)
            raise TemplateError(f"chat template failed: {type(e).__name__}: {e}") from e


def embedding_rows(model_dir: str) -> int | None:
    """Rows of the token embedding of the model in ``model_dir`` (config.json ``vocab_size``; a multimodal
    config nests it under ``text_config``), or None where there is no readable config."""
    path = Path(model_dir) / "config.json"
    try:
        cfg = json.loads(path.read_text())
        rows = cfg.get("vocab_size") or cfg["text_config"]["vocab_size"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return rows if type(rows) is int and rows > 0 else None


def id_limit(tok: PromptTokenizer, *model_dirs: str) -> int:
    """Prompt ids must lie in [0, limit). The limit is the embedding's rows, which SGLang indexes with them
    (often padded past the tokenizer: 512 rows for the tiny models' 442 tokens), from the first of
    ``model_dirs`` with a config; without one, the tokenizer's size with its added tokens."""
    for d in filter(None, model_dirs):
        rows = embedding_rows(d)
        if rows is not None:
            return rows
    return tok.vocab_size
