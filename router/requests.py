"""Parse and validate client requests; every rejection is an ``ApiError`` with an OpenAI-style body."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from .errors import ApiError, bad as _bad
from .fields import check_fields, token_ids
from .tokenize import RESERVED_TEMPLATE_KWARGS, PromptTokenizer, TemplateError

__all__ = ["ApiError", "Limits", "ParsedRequest", "decode_json", "parse_raw", "parse_request", "read_body", "too_large"]


@dataclass(frozen=True, slots=True)
class Limits:
    """What a request may ask for, from the router config."""

    context_length: int  # prompt + output tokens
    max_chars: int  # prompt characters checked before tokenizing (context_length x max_chars_per_token)
    vocab_size: int  # token ids a prompt may hold: [0, vocab_size) (``PromptTokenizer.vocab_size``)


@dataclass(frozen=True, slots=True)
class ParsedRequest:
    endpoint: str  # path on the servers, e.g. "/v1/chat/completions"
    body: dict[str, Any]  # the client's body (only fields of router/fields.py's allow-lists), forwarded unchanged
    stream: bool
    tokens: list[int]
    max_tokens: int


def too_large(limit: int) -> ApiError:
    return ApiError(413, f"request body exceeds {limit} bytes (the router's --max-body-bytes, by default derived "
                    "from --context-length)", "invalid_request_error", "request_too_large")


async def read_body(request: web.Request, limit: int) -> bytes:
    """The raw body; refused unread when Content-Length exceeds ``limit``, or once ``limit`` bytes of a chunked
    body arrived (the app's ``client_max_size`` is ``limit``)."""
    if request.content_length is not None and request.content_length > limit:
        raise too_large(limit)
    try:
        return await request.read()
    except web.HTTPRequestEntityTooLarge as e:
        raise too_large(limit) from e


def decode_json(raw: bytes) -> Any:
    try:
        body = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ApiError(400, f"malformed JSON body: {e}", code="invalid_json") from e
    except RecursionError as e:  # deeply nested arrays
        raise ApiError(400, "malformed JSON body: nested too deeply", code="invalid_json") from e
    if b"\\u" in raw:
        _check_unicode(body)
    return body


def _check_unicode(body: Any) -> None:
    """JSON may escape an unpaired UTF-16 surrogate (\\ud800) that no tokenizer can take (tokenizers raises
    TypeError: a 500 here, and a server error that would take the instance out of rotation); only an escape
    can produce one, so bodies without ``\\u`` skip this walk."""
    try:
        json.dumps(body, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError as e:
        raise ApiError(400, f"malformed JSON body: a string is not valid Unicode ({e.reason})",
                       code="invalid_json") from None
    except RecursionError:
        raise ApiError(400, "malformed JSON body: nested too deeply", code="invalid_json") from None


def _max_tokens(value: Any, name: str, default: int) -> int:
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int):
        raise _bad(f"'{name}' must be an integer", "invalid_type")
    if value <= 0:
        raise _bad(f"'{name}' must be >= 1, got {value}", "invalid_value")
    return value


def _token_list(value: Any, name: str, vocab: int) -> list[int]:
    if not isinstance(value, list) or not value or isinstance(value[0], (list, str)):
        raise _bad(f"'{name}' must be a string or a non-empty list of token ids (batches are not supported)")
    token_ids(value, name, vocab)
    return value


def _check_model(body: dict[str, Any], model_name: str, required: bool) -> None:
    model = body.get("model")
    if model is None:
        if required:
            raise _bad("missing required field 'model'", "missing_field")
        return
    if model != model_name:
        raise ApiError(404, f"model {model!r} does not exist; this router serves {model_name!r}",
                       "invalid_request_error", "model_not_found")


def _check_chars(text: str, what: str, limits: Limits) -> str:
    """Refuse a prompt that cannot fit before tokenizing it: tokenizing costs time and ~100 B per token."""
    if len(text) > limits.max_chars:
        raise _bad(f"{what} has {len(text)} characters, more than fit in the context length "
                   f"{limits.context_length}", "context_length_exceeded")
    return text


def _template_kwargs(body: dict[str, Any]) -> dict[str, Any]:
    extra = body.get("chat_template_kwargs")
    if extra is None:
        extra = {}
    if not isinstance(extra, dict):
        raise _bad("'chat_template_kwargs' must be an object", "invalid_type")
    clash = sorted(RESERVED_TEMPLATE_KWARGS & extra.keys())
    if clash:
        raise _bad(f"'chat_template_kwargs' may not set {clash}: the router sets them", "invalid_value")
    if body.get("tools"):
        extra = {**extra, "tools": body["tools"]}
    return extra


def _chat_tokens(body: dict[str, Any], tok: PromptTokenizer, limits: Limits) -> list[int]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages or not all(isinstance(m, dict) for m in messages):
        raise _bad("'messages' must be a non-empty list of message objects", "missing_field")
    try:
        text = tok.render_chat(messages, **_template_kwargs(body))
    except TemplateError as e:
        raise _bad(str(e), "invalid_messages") from e
    return tok.encode(_check_chars(text, "the rendered chat", limits), add_special_tokens=False)


def _tokens_for(endpoint: str, body: dict[str, Any], tok: PromptTokenizer, limits: Limits) -> list[int]:
    if endpoint == "/v1/chat/completions":
        return _chat_tokens(body, tok, limits)
    key = "prompt" if endpoint == "/v1/completions" else "text"
    value = body.get(key)
    if endpoint == "/generate" and value is None:
        return _token_list(body.get("input_ids"), "input_ids", limits.vocab_size)
    if isinstance(value, str):
        return tok.encode_text(_check_chars(value, f"'{key}'", limits))
    if value is None:
        raise _bad(f"missing required field '{key}'", "missing_field")
    if endpoint == "/generate":  # SGLang reads a list here as a batch of strings
        raise _bad("'text' must be a string (token ids go in 'input_ids'; batches are not supported)", "invalid_type")
    return _token_list(value, key, limits.vocab_size)


def _output_budget(endpoint: str, body: dict[str, Any]) -> int:
    """max tokens to generate (0: chat without a limit). The sampling fields' own checks ran in ``check_fields``."""
    if endpoint == "/generate":
        sp = body.get("sampling_params") or {}
        budget = _max_tokens(sp.get("max_new_tokens"), "sampling_params.max_new_tokens", 128)
        least, least_name = sp.get("min_new_tokens"), "sampling_params.min_new_tokens"
    elif endpoint == "/v1/chat/completions":
        budget = _max_tokens(body.get("max_completion_tokens", body.get("max_tokens")), "max_tokens", 0)
        least, least_name = body.get("min_tokens"), "min_tokens"
    else:
        budget = _max_tokens(body.get("max_tokens"), "max_tokens", 16)
        least, least_name = body.get("min_tokens"), "min_tokens"
    if budget and least is not None and least > budget:
        raise _bad(f"'{least_name}' = {least} is more than the {budget} tokens asked for", "invalid_value")
    return budget


def parse_request(endpoint: str, body: Any, tok: PromptTokenizer, model_name: str, limits: Limits) -> ParsedRequest:
    """Validate ``body`` for ``endpoint``; tokenizes the prompt. Raises ``ApiError``."""
    if not isinstance(body, dict):
        raise _bad("request body must be a JSON object")
    _check_model(body, model_name, required=endpoint != "/generate")
    check_fields(endpoint, body, limits.vocab_size)
    max_tokens = _output_budget(endpoint, body)
    tokens = _tokens_for(endpoint, body, tok, limits)
    budget = max_tokens or 1  # chat without max_tokens: the server fills the rest of the context
    if len(tokens) + budget > limits.context_length:
        raise _bad(f"prompt has {len(tokens)} tokens and asks for {budget} more; the context length is "
                   f"{limits.context_length}", "context_length_exceeded")
    stream = body.get("stream")
    stream = False if stream is None else stream
    if not isinstance(stream, bool):
        raise _bad("'stream' must be true or false", "invalid_type")
    return ParsedRequest(endpoint, body, stream, tokens, max_tokens)


def parse_raw(endpoint: str, raw: bytes, tok: PromptTokenizer, model_name: str, limits: Limits) -> ParsedRequest:
    """``parse_request`` on the undecoded body: one call to run on a worker thread."""
    return parse_request(endpoint, decode_json(raw), tok, model_name, limits)
