"""Parse and validate client requests; every rejection is an ``ApiError`` with an OpenAI-style body."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any, Callable

from aiohttp import web

from .tokenize import RESERVED_TEMPLATE_KWARGS, PromptTokenizer, TemplateError

# Fields of SGLang 0.5.23's GenerateReqInput / OpenAI request classes that belong to the router or to SGLang
# itself, so they never pass from a client:
# - ``rid``: SGLang aborts by rid *prefix*, so a client's rid "a" would abort every request whose id starts
#   with "a", and a reused rid is refused as a duplicate; the forwarder sets a fresh one per attempt.
# - PD pairing (``bootstrap_*``, ``decode_tp_size``) and data-parallel / KV placement (``*_dp_rank``,
#   ``data_parallel_rank``, ``kv_hints``): the router pairs prefill and decode; a client's choice would
#   misplace its KV or steer other requests' placement.
# - Sessions (``session_id``, ``session_params``): a session lives on one server, which per-request routing
#   does not honour, and a guessed id would reach another client's session.
# - Tokenizer-manager and encoder plumbing (``http_worker_ipc``, ``lora_id``, ``received_time``,
#   ``encoder_urls``, ``num_items_assigned``, ``need_wait_for_mm_inputs``): set by SGLang, never by a client
#   (``encoder_urls`` would make the server POST to any address).
INTERNAL_FIELDS = frozenset({
    "rid", "bootstrap_host", "bootstrap_port", "bootstrap_room", "bootstrap_pair_key", "decode_tp_size",
    "routed_dp_rank", "data_parallel_rank", "disagg_prefill_dp_rank", "kv_hints", "kv_router_hint",
    "session_id", "session_params", "http_worker_ipc", "lora_id", "received_time", "encoder_urls",
    "num_items_assigned", "need_wait_for_mm_inputs",
})


class ApiError(Exception):
    """An error returned to the client as ``{"error": {"message", "type", "code"}}``."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", code: str = "") -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.code = status, message, type_, code or type_

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "code": self.code}}


@dataclass(frozen=True, slots=True)
class Limits:
    """What a request may ask for, from the router config."""

    context_length: int  # prompt + output tokens
    max_chars: int  # prompt characters checked before tokenizing (context_length x max_chars_per_token)


@dataclass(frozen=True, slots=True)
class ParsedRequest:
    endpoint: str  # path on the servers, e.g. "/v1/chat/completions"
    body: dict[str, Any]  # client body minus INTERNAL_FIELDS; forwarded unchanged otherwise
    stream: bool
    tokens: list[int]
    max_tokens: int


def _bad(message: str, code: str = "invalid_request_error") -> ApiError:
    return ApiError(400, message, "invalid_request_error", code)


def _too_large(limit: int) -> ApiError:
    return ApiError(413, f"request body exceeds {limit} bytes (the router's --max-body-bytes, by default derived "
                    "from --context-length)", "invalid_request_error", "request_too_large")


async def read_body(request: web.Request, limit: int) -> bytes:
    """The raw body; refused unread when Content-Length exceeds ``limit``, or once ``limit`` bytes of a chunked
    body arrived (the app's ``client_max_size`` is ``limit``)."""
    if request.content_length is not None and request.content_length > limit:
        raise _too_large(limit)
    try:
        return await request.read()
    except web.HTTPRequestEntityTooLarge as e:
        raise _too_large(limit) from e


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


# The cheap part of SGLang's SamplingParams.verify, answered here so a bad request never reaches a server.
SAMPLING_RULES: tuple[tuple[str, Callable[[float], bool], str], ...] = (
    ("temperature", lambda v: math.isfinite(v) and v >= 0, "a finite number >= 0"),
    ("top_p", lambda v: 0 < v <= 1, "in (0, 1]"),
    ("top_k", lambda v: v == -1 or v >= 1, "-1 (all) or >= 1"),
    ("min_p", lambda v: 0 <= v <= 1, "in [0, 1]"),
    ("frequency_penalty", lambda v: -2 <= v <= 2, "in [-2, 2]"),
    ("presence_penalty", lambda v: -2 <= v <= 2, "in [-2, 2]"),
    ("repetition_penalty", lambda v: 0 < v <= 2, "in (0, 2]"),
)


def _check_sampling(params: dict[str, Any], prefix: str) -> None:
    for name, ok, want in SAMPLING_RULES:
        value = params.get(name)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise _bad(f"'{prefix}{name}' must be a number", "invalid_type")
        if not ok(value):
            raise _bad(f"'{prefix}{name}' must be {want}, got {value}", "invalid_value")


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
        return _token_list(body.get("input_ids"), "input_ids")
    if isinstance(value, str):
        return tok.encode_text(_check_chars(value, f"'{key}'", limits))
    if value is None:
        raise _bad(f"missing required field '{key}'", "missing_field")
    return _token_list(value, key)


def _output_budget(endpoint: str, body: dict[str, Any]) -> int:
    """max tokens to generate (0: chat without a limit); also checks the sampling parameters."""
    if endpoint == "/generate":
        sp = body.get("sampling_params") or {}
        if not isinstance(sp, dict):
            raise _bad("'sampling_params' must be an object")
        _check_sampling(sp, "sampling_params.")
        return _max_tokens(sp.get("max_new_tokens"), "sampling_params.max_new_tokens", 128)
    _check_sampling(body, "")
    if endpoint == "/v1/chat/completions":
        return _max_tokens(body.get("max_completion_tokens", body.get("max_tokens")), "max_tokens", 0)
    return _max_tokens(body.get("max_tokens"), "max_tokens", 16)


def parse_request(endpoint: str, body: Any, tok: PromptTokenizer, model_name: str, limits: Limits) -> ParsedRequest:
    """Validate ``body`` for ``endpoint``; tokenizes the prompt. Raises ``ApiError``."""
    if not isinstance(body, dict):
        raise _bad("request body must be a JSON object")
    _check_model(body, model_name, required=endpoint != "/generate")
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
    clean = {k: v for k, v in body.items() if k not in INTERNAL_FIELDS}
    return ParsedRequest(endpoint, clean, stream, tokens, max_tokens)


def parse_raw(endpoint: str, raw: bytes, tok: PromptTokenizer, model_name: str, limits: Limits) -> ParsedRequest:
    """``parse_request`` on the undecoded body: one call to run on a worker thread."""
    return parse_request(endpoint, decode_json(raw), tok, model_name, limits)
