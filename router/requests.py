"""Parse and validate client requests; every rejection is an ``ApiError`` with an OpenAI-style body."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .tokenize import PromptTokenizer, TemplateError

PD_FIELDS = ("bootstrap_host", "bootstrap_port", "bootstrap_room")


class ApiError(Exception):
    """An error returned to the client as ``{"error": {"message", "type", "code"}}``."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", code: str = "") -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.code = status, message, type_, code or type_

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "code": self.code}}


@dataclass(frozen=True, slots=True)
class ParsedRequest:
    endpoint: str  # path on the servers, e.g. "/v1/chat/completions"
    body: dict[str, Any]  # client body minus any PD fields; forwarded unchanged otherwise
    stream: bool
    tokens: list[int]
    max_tokens: int


def _bad(message: str, code: str = "invalid_request_error") -> ApiError:
    return ApiError(400, message, "invalid_request_error", code)


def _max_tokens(value: Any, name: str, default: int) -> int:
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int):
        raise _bad(f"'{name}' must be an integer", "invalid_type")
    if value <= 0:
        raise _bad(f"'{name}' must be >= 1, got {value}", "invalid_value")
    return value


def _token_list(value: Any, name: str) -> list[int]:
    if not isinstance(value, list) or not value or not all(isinstance(t, int) and t >= 0 for t in value):
        raise _bad(f"'{name}' must be a string or a non-empty list of token ids (batches are not supported)")
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


def _tokens_for(endpoint: str, body: dict[str, Any], tok: PromptTokenizer) -> list[int]:
    if endpoint == "/v1/chat/completions":
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages or not all(isinstance(m, dict) for m in messages):
            raise _bad("'messages' must be a non-empty list of message objects", "missing_field")
        extra = body.get("chat_template_kwargs") or {}
        if body.get("tools"):
            extra = {**extra, "tools": body["tools"]}
        try:
            return tok.encode_chat(messages, **extra)
        except TemplateError as e:
            raise _bad(str(e), "invalid_messages") from e
    key = "prompt" if endpoint == "/v1/completions" else "text"
    value = body.get(key)
    if endpoint == "/generate" and value is None:
        return _token_list(body.get("input_ids"), "input_ids")
    if isinstance(value, str):
        return tok.encode_text(value)
    if value is None:
        raise _bad(f"missing required field '{key}'", "missing_field")
    return _token_list(value, key)


def parse_request(endpoint: str, body: Any, tok: PromptTokenizer, model_name: str,
                  context_length: int) -> ParsedRequest:
    """Validate ``body`` for ``endpoint``; tokenizes the prompt. Raises ``ApiError``."""
    if not isinstance(body, dict):
        raise _bad("request body must be a JSON object")
    _check_model(body, model_name, required=endpoint != "/generate")
    if endpoint == "/generate":
        sp = body.get("sampling_params") or {}
        if not isinstance(sp, dict):
            raise _bad("'sampling_params' must be an object")
        max_tokens = _max_tokens(sp.get("max_new_tokens"), "sampling_params.max_new_tokens", 128)
    elif endpoint == "/v1/chat/completions":
        value = body.get("max_completion_tokens", body.get("max_tokens"))
        max_tokens = _max_tokens(value, "max_tokens", 0)
    else:
        max_tokens = _max_tokens(body.get("max_tokens"), "max_tokens", 16)
    tokens = _tokens_for(endpoint, body, tok)
    budget = max_tokens or 1  # chat without max_tokens: the server fills the rest of the context
    if len(tokens) + budget > context_length:
        raise _bad(f"prompt has {len(tokens)} tokens and asks for {budget} more; the context length is "
                   f"{context_length}", "context_length_exceeded")
    stream = bool(body.get("stream", False))
    clean = {k: v for k, v in body.items() if k not in PD_FIELDS}
    return ParsedRequest(endpoint, clean, stream, tokens, max_tokens)
