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


class TemplateError(ValueError):
    """The chat template rejected the messages (maps to HTTP 400)."""


# Names the router passes to the template itself; a client's chat_template_kwargs must not override them.
RESERVED_TEMPLATE_KWARGS = frozenset({"messages", "add_generation_prompt", "bos_token", "eos_token"})


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
