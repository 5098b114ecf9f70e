"""What a client may send to each generation endpoint: one table per endpoint, field -> check of its value.

The tables are allow-lists. A field outside them is refused (400 ``unsupported_field``, naming it), not dropped:
- SGLang 0.5.23's request classes carry fields no client of this service may set: a dill-serialized
  ``custom_logit_processor`` (code execution where a server enables it), ``priority`` (starves others),
  ``no_logs`` (audit evasion), ``lora_path`` and ``image_data``/``audio_data``/``video_data`` (server-side
  fetches), ``input_embeds`` (bypasses the router's token count and link accounting), ``return_hidden_states``,
  ``custom_labels``; and the router's own ``rid`` (SGLang aborts by rid *prefix*: a client's "a" would abort
  every request whose id starts with "a"), ``bootstrap_*`` and data-parallel placement. Each SGLang release
  adds fields; an allow-list fails closed.
- Dropping a field silently changes the answer the client asked for (a typo ``max_token`` would give the
  default 16 tokens without a word); OpenAI's API refuses unknown arguments with a 400 too.

Each check raises ``ApiError`` (400) where SGLang would crash, answer 500, or fan one request out to many: token
ids must index the vocabulary, nested fields must have their types, and ``n`` must be 1 (each parallel sample is
its own prefill-to-decode KV transfer, which the router neither routes nor counts on the link).
"""

from __future__ import annotations

import json
import math
from typing import Any, Callable

from .errors import ApiError, bad

Check = Callable[[Any, str, int], None]  # (value, dotted field name, vocabulary size); raises ApiError

INT32_MAX = 2**31 - 1  # SGLang keeps top_k, lengths and offsets in int32 tensors
INT64 = (-(2**63), 2**63 - 1)
MAX_TOP_LOGPROBS = 20  # OpenAI's bound; each one adds a [logprob, id, text] per token to the answer
LOGIT_BIAS = 100.0  # OpenAI's bound on a logit bias


def unsupported(name: str, endpoint: str) -> ApiError:
    return bad(f"'{name}' is not a field this router accepts on {endpoint}", "unsupported_field")


def token_ids(ids: list[Any], name: str, vocab: int) -> None:
    """Every element of ``ids`` is an int in [0, vocab): an id past the embedding's rows crashes the scheduler
    (IndexError on CPU, a device-side assert on CUDA), and ``True`` is an int to Python but no token."""
    if set(map(type, ids)) <= {int} and (not ids or (min(ids) >= 0 and max(ids) < vocab)):
        return  # the common case, in C: under 30 ms for a million ids
    for i, t in enumerate(ids):
        if type(t) is not int:
            raise bad(f"'{name}[{i}]' must be an integer token id, got {t!r:.40}", "invalid_token_id")
        if not 0 <= t < vocab:
            raise bad(f"'{name}[{i}]' = {t} is not a token id of this model (valid: 0 <= id < {vocab})",
                      "invalid_token_id")


# ---------------------------------------------------------------- value checks


def _parsed(value: Any, name: str, vocab: int) -> None:
    """Checked where it is used (router/requests.py): the model, the prompt, token budgets, ``stream``."""


def _bool(value: Any, name: str, vocab: int) -> None:
    if not isinstance(value, bool):
        raise bad(f"'{name}' must be true or false", "invalid_type")


def _text(value: Any, name: str, vocab: int) -> None:
    if not isinstance(value, str):
        raise bad(f"'{name}' must be a string", "invalid_type")


def _texts(value: Any, name: str, vocab: int) -> None:
    if not (isinstance(value, str) or isinstance(value, list) and all(isinstance(s, str) for s in value)):
        raise bad(f"'{name}' must be a string or a list of strings", "invalid_type")


def _json_text(value: Any, name: str, vocab: int) -> None:
    """SGLang's ``json_schema`` is a JSON document in a string; one that does not parse failed in the grammar
    backend instead of the request."""
    _text(value, name, vocab)
    try:
        json.loads(value)
    except (ValueError, RecursionError) as e:
        raise bad(f"'{name}' is not valid JSON: {e}", "invalid_value") from None


def _integer(lo: int, hi: int) -> Check:
    def check(value: Any, name: str, vocab: int) -> None:
        if type(value) is not int:
            raise bad(f"'{name}' must be an integer", "invalid_type")
        if not lo <= value <= hi:
            raise bad(f"'{name}' must be in [{lo}, {hi}], got {value}", "invalid_value")
    return check


def _top_k(value: Any, name: str, vocab: int) -> None:
    _integer(-1, INT32_MAX)(value, name, vocab)
    if value == 0:
        raise bad(f"'{name}' must be -1 (all) or >= 1, got 0", "invalid_value")


def _number(ok: Callable[[float], bool], want: str) -> Check:
    """The cheap part of SGLang's SamplingParams.verify, answered here so a bad request never reaches a server."""
    def check(value: Any, name: str, vocab: int) -> None:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise bad(f"'{name}' must be a number", "invalid_type")
        if not ok(value):
            raise bad(f"'{name}' must be {want}, got {value}", "invalid_value")
    return check


def _one(value: Any, name: str, vocab: int) -> None:
    if value != 1 or type(value) is not int:
        raise bad(f"'{name}' must be 1, got {value!r:.40}: each parallel sample would be its own prefill-to-decode "
                  "transfer, which this router does not route; send separate requests", "unsupported_value")


def _token_id_list(value: Any, name: str, vocab: int) -> None:
    if not isinstance(value, list):
        raise bad(f"'{name}' must be a list of token ids", "invalid_type")
    token_ids(value, name, vocab)


def _logit_bias(value: Any, name: str, vocab: int) -> None:
    if not isinstance(value, dict):
        raise bad(f"'{name}' must be an object of token id -> bias", "invalid_type")
    for key, bias in value.items():  # int() of a 5,000-digit key raises: the length test comes first
        if not (len(key) <= 10 and key.isascii() and key.isdigit()) or int(key) >= vocab:
            raise bad(f"'{name}' key {key!r:.40} is not a token id of this model (valid: 0 <= id < {vocab})",
                      "invalid_token_id")
        if isinstance(bias, bool) or not isinstance(bias, (int, float)) or not -LOGIT_BIAS <= bias <= LOGIT_BIAS:
            raise bad(f"'{name}[{key}]' must be a number in [-100, 100], got {bias!r:.40}", "invalid_value")


def _stream_options(value: Any, name: str, vocab: int) -> None:
    if not isinstance(value, dict):
        raise bad(f"'{name}' must be an object", "invalid_type")
    for key, flag in value.items():
        if key not in ("include_usage", "continuous_usage_stats"):
            raise bad(f"'{name}.{key}' is not a stream option (include_usage, continuous_usage_stats)",
                      "unsupported_field")
        if flag is not None:
            _bool(flag, f"{name}.{key}", vocab)


RESPONSE_FORMATS = ("text", "json_object", "json_schema", "structural_tag")


def _response_format(value: Any, name: str, vocab: int) -> None:
    if not isinstance(value, dict) or value.get("type") not in RESPONSE_FORMATS:
        raise bad(f"'{name}' must be an object whose 'type' is one of {list(RESPONSE_FORMATS)}", "invalid_value")
    if value["type"] != "json_schema":
        return
    spec = value.get("json_schema")
    if not isinstance(spec, dict) or not isinstance(spec.get("name"), str) or not isinstance(
            spec.get("schema", {}), (dict, type(None))):
        raise bad(f"'{name}.json_schema' must be an object with a string 'name' and an object 'schema'",
                  "invalid_value")


def _tools(value: Any, name: str, vocab: int) -> None:
    if not isinstance(value, list):
        raise bad(f"'{name}' must be a list of tool objects", "invalid_type")
    for i, tool in enumerate(value):
        fn = tool.get("function") if isinstance(tool, dict) else None
        if not (isinstance(fn, dict) and tool.get("type", "function") == "function"
                and isinstance(fn.get("name"), str) and isinstance(fn.get("parameters", {}), (dict, type(None)))
                and isinstance(fn.get("description", ""), (str, type(None)))):
            raise bad(f"'{name}[{i}]' must be {{'type': 'function', 'function': {{'name': string, 'description': "
                      "string, 'parameters': object}}", "invalid_value")


def _tool_choice(value: Any, name: str, vocab: int) -> None:
    if value in ("none", "auto", "required"):
        return
    fn = value.get("function") if isinstance(value, dict) else None
    if not (isinstance(fn, dict) and value.get("type", "function") == "function" and isinstance(fn.get("name"), str)):
        raise bad(f"'{name}' must be 'none', 'auto', 'required' or {{'type': 'function', 'function': "
                  "{'name': string}}", "invalid_value")


def _messages(value: Any, name: str, vocab: int) -> None:
    """Message contents are text: a string, or a list of text parts. Image and audio parts would make a server
    fetch a client's URL (this router serves text models)."""
    if not isinstance(value, list):
        return  # the prompt's own check (router/requests.py) says what is missing
    for i, msg in enumerate(value):
        if not isinstance(msg, dict):
            return
        if not isinstance(msg.get("role"), str):
            raise bad(f"'{name}[{i}].role' must be a string", "invalid_type")
        content = msg.get("content")
        if content is None or isinstance(content, str):
            continue
        if not isinstance(content, list):
            raise bad(f"'{name}[{i}].content' must be a string or a list of text parts", "invalid_type")
        for j, part in enumerate(content):
            if not (isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)):
                raise bad(f"'{name}[{i}].content[{j}]' must be {{'type': 'text', 'text': string}}: this router "
                          "serves text prompts only", "invalid_content")


# ---------------------------------------------------------------- the tables

SAMPLING_NUMBERS: dict[str, Check] = {
    "temperature": _number(lambda v: math.isfinite(v) and v >= 0, "a finite number >= 0"),
    "top_p": _number(lambda v: 0 < v <= 1, "in (0, 1]"),
    "min_p": _number(lambda v: 0 <= v <= 1, "in [0, 1]"),
    "frequency_penalty": _number(lambda v: -2 <= v <= 2, "in [-2, 2]"),
    "presence_penalty": _number(lambda v: -2 <= v <= 2, "in [-2, 2]"),
    "repetition_penalty": _number(lambda v: 0 < v <= 2, "in (0, 2]"),
}
# What every endpoint's sampling shares, under the same names in /generate's sampling_params and OpenAI bodies.
SAMPLING_COMMON: dict[str, Check] = {
    **SAMPLING_NUMBERS, "top_k": _top_k, "n": _one, "stop": _texts, "stop_token_ids": _token_id_list,
    "stop_regex": _texts, "regex": _text, "ebnf": _text, "ignore_eos": _bool, "skip_special_tokens": _bool,
    "no_stop_trim": _bool, "logit_bias": _logit_bias,
}
SAMPLING_PARAMS: dict[str, Check] = {  # /generate's sampling_params (SGLang's SamplingParams API fields)
    **SAMPLING_COMMON, "max_new_tokens": _parsed, "min_new_tokens": _integer(0, INT32_MAX),
    "json_schema": _json_text, "structural_tag": _text, "spaces_between_special_tokens": _bool,
    "sampling_seed": _integer(*INT64),
}


def _sampling_params(value: Any, name: str, vocab: int) -> None:
    if not isinstance(value, dict):
        raise bad(f"'{name}' must be an object", "invalid_type")
    for key, item in value.items():
        check = SAMPLING_PARAMS.get(key)
        if check is None:
            raise unsupported(f"{name}.{key}", "/generate")
        if item is not None:
            check(item, f"{name}.{key}", vocab)


GENERATE: dict[str, Check] = {
    "model": _parsed, "text": _parsed, "input_ids": _parsed, "stream": _parsed, "sampling_params": _sampling_params,
    "return_logprob": _bool, "logprob_start_len": _integer(-1, INT32_MAX),
    "top_logprobs_num": _integer(0, MAX_TOP_LOGPROBS), "token_ids_logprob": _token_id_list,
    "return_text_in_logprobs": _bool,
}
OPENAI: dict[str, Check] = {
    **SAMPLING_COMMON, "model": _parsed, "stream": _parsed, "max_tokens": _parsed, "stream_options": _stream_options,
    "min_tokens": _integer(0, INT32_MAX), "seed": _integer(*INT64), "user": _text,
    "response_format": _response_format,
}
COMPLETIONS: dict[str, Check] = {
    **OPENAI, "prompt": _parsed, "echo": _bool, "logprobs": _integer(0, MAX_TOP_LOGPROBS), "json_schema": _json_text,
}
CHAT: dict[str, Check] = {
    **OPENAI, "messages": _messages, "max_completion_tokens": _parsed, "chat_template_kwargs": _parsed,
    "logprobs": _bool, "top_logprobs": _integer(0, MAX_TOP_LOGPROBS), "tools": _tools, "tool_choice": _tool_choice,
    "parallel_tool_calls": _bool, "continue_final_message": _bool, "separate_reasoning": _bool,
    "stream_reasoning": _bool, "reasoning_effort": _text,
}
FIELDS: dict[str, dict[str, Check]] = {"/generate": GENERATE, "/v1/completions": COMPLETIONS,
                                       "/v1/chat/completions": CHAT}


def _tools_named(body: dict[str, Any]) -> None:
    """A ``tool_choice`` that makes the model call a tool needs that tool in ``tools``."""
    choice, tools = body.get("tool_choice"), body.get("tools") or []
    if choice is None or choice in ("none", "auto"):
        return
    names = {t["function"]["name"] for t in tools}
    if choice == "required" and not names:
        raise bad("'tool_choice' 'required' needs a non-empty 'tools'", "invalid_value")
    if isinstance(choice, dict) and choice["function"]["name"] not in names:
        raise bad(f"'tool_choice' names {choice['function']['name']!r:.60}, which is not in 'tools'", "invalid_value")


def check_fields(endpoint: str, body: dict[str, Any], vocab: int) -> None:
    """Refuse a field ``endpoint`` does not take, or a value its check refuses (``None`` means "the default")."""
    table = FIELDS[endpoint]
    for name, value in body.items():
        check = table.get(name)
        if check is None:
            raise unsupported(name, endpoint)
        if value is not None:
            check(value, name, vocab)
    if endpoint == "/v1/chat/completions":
        _tools_named(body)
