"""What the router lets through to its servers: token ids inside the vocabulary, and only the fields of each
endpoint's allow-list (router/fields.py), each of the shape SGLang needs.

Two requests with an id past the vocabulary, sent through the router, killed both prefills of a real deployment
(SGLang does not range-check prompt ids; the router retried on the local prefill with the same ids). The router
runs here in front of stand-ins that accept anything, so whatever the router lets through reaches a "server".
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from prfaas_sgl.router.tokenize import PromptTokenizer, id_limit
from prfaas_sgl.tools.chaos import hostile
from tests.support.router_standin import build_tiny_tokenizer

from .test_router_http import LONG, SHORT, rig, run

pytestmark = pytest.mark.timeout(120)


def received(r) -> int:
    return len(r.remote.received) + len(r.local.received) + len(r.decode.received)


def test_prompt_ids_outside_the_vocabulary_are_refused_naming_the_id_and_the_limit(tmp_path):
    async def body():
        async with rig(tmp_path) as r:
            vocab = r.router.router.limits.vocab_size
            assert vocab == r.router.router.tokenizer.vocab_size  # no config.json next to the tokenizer
            bad = {10_000_000: "10000000", vocab: str(vocab), -1: "-1", 2**70: str(2**70), True: "True", 1.5: "1.5"}
            for value, shown in bad.items():
                for path, key in (("/generate", "input_ids"), ("/v1/completions", "prompt")):
                    req = {"model": "tiny", key: [1, value], "max_tokens": 2} if path != "/generate" else {
                        key: [1, value], "sampling_params": {"max_new_tokens": 2}}
                    status, out = await r.post(path, req)
                    assert (status, out["error"]["code"]) == (400, "invalid_token_id"), (path, key, value, out)
                    assert f"'{key}[1]'" in out["error"]["message"] and shown in out["error"]["message"]
                    if value is not True and not isinstance(value, float):
                        assert str(vocab) in out["error"]["message"]  # the limit
            status, out = await r.post("/generate", {"text": [1, 2]})  # SGLang: a batch of two "strings"
            assert (status, out["error"]["code"]) == (400, "invalid_type") and "input_ids" in out["error"]["message"]
            assert received(r) == 0
            ok = {"input_ids": [0, vocab - 1], "sampling_params": {"max_new_tokens": 2}}
            assert (await r.post("/generate", ok))[0] == 200
    run(body())


def test_the_limit_is_the_models_embedding_rows_when_its_config_is_known(tmp_path):
    """The tiny models' tokenizer has 442 tokens and their embedding 512 rows: ids 442..511 crash nothing."""
    tok_dir = build_tiny_tokenizer(str(tmp_path / "model"))
    tok = PromptTokenizer(tok_dir)
    rows = tok.vocab_size + 70
    (Path(tok_dir) / "config.json").write_text(json.dumps({"vocab_size": rows}))
    assert id_limit(tok, "", tok_dir) == rows
    nested = tmp_path / "mm"
    nested.mkdir()
    (nested / "config.json").write_text(json.dumps({"text_config": {"vocab_size": 99}}))
    assert id_limit(tok, str(nested), tok_dir) == 99  # --model-path first; a multimodal config nests it

    async def body():
        async with rig(tmp_path, tokenizer_path=tok_dir) as r:
            for ids, want in (([1, rows - 1], 200), ([1, rows], 400)):
                assert (await r.post("/generate", {"input_ids": ids, "sampling_params": {}}))[0] == want
    run(body())


RISKY = {"custom_logit_processor": "gASVAAAAAA==", "priority": 10**9, "no_logs": True, "lora_path": "x",
         "image_data": "http://127.0.0.1:9/a.png", "audio_data": "x", "video_data": "x", "input_embeds": [[0.1]],
         "return_hidden_states": True, "custom_labels": {"a": "b"}, "rid": "a", "bootstrap_port": 1, "kv_hints": {},
         "max_token": 5}


@pytest.mark.parametrize("path", ["/generate", "/v1/completions", "/v1/chat/completions"])
def test_fields_outside_the_allow_list_are_refused_by_name(tmp_path, path):
    base = {"/generate": {"text": SHORT}, "/v1/completions": {"model": "tiny", "prompt": SHORT},
            "/v1/chat/completions": {"model": "tiny", "messages": [{"role": "user", "content": SHORT}]}}[path]

    async def body():
        async with rig(tmp_path) as r:
            extra = dict(RISKY, **({"input_ids": [1, 2]} if path == "/v1/chat/completions" else {}))
            for name, value in extra.items():
                status, out = await r.post(path, {**base, name: value})
                assert (status, out["error"]["code"]) == (400, "unsupported_field"), (name, out)
                assert f"'{name}'" in out["error"]["message"] and path in out["error"]["message"]
            if path == "/generate":
                status, out = await r.post(path, {**base, "sampling_params": {"custom_params": {"a": 1}}})
                assert (status, out["error"]["code"]) == (400, "unsupported_field")
                assert "'sampling_params.custom_params'" in out["error"]["message"]
            assert received(r) == 0
    run(body())


def test_allowed_fields_reach_the_servers_unchanged(tmp_path):
    tools = [{"type": "function", "function": {"name": "f", "description": "d", "parameters": {"type": "object"}}}]
    chat = {"model": "tiny", "messages": [{"role": "system", "content": "be brief"},
                                          {"role": "user", "content": [{"type": "text", "text": LONG}]}],
            "max_tokens": 4, "temperature": 0.5, "top_p": 0.9, "top_k": 20, "min_p": 0.1, "seed": -5, "n": 1,
            "stop": ["\n"], "stop_token_ids": [1, 2], "logit_bias": {"3": -100}, "logprobs": True, "top_logprobs": 5,
            "tools": tools, "tool_choice": {"type": "function", "function": {"name": "f"}}, "user": "u",
            "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"}}},
            "stream": False, "stream_options": None, "chat_template_kwargs": {"enable_thinking": False},
            "ignore_eos": True, "min_tokens": 2, "presence_penalty": 0.5, "repetition_penalty": 1.1}
    gen = {"input_ids": [1, 2, 3], "return_logprob": True, "top_logprobs_num": 3, "logprob_start_len": -1,
           "sampling_params": {"max_new_tokens": 4, "min_new_tokens": 1, "json_schema": '{"type": "object"}',
                               "regex": None, "sampling_seed": 7, "stop": "x", "spaces_between_special_tokens": False}}

    async def body():
        async with rig(tmp_path) as r:
            assert (await r.post("/v1/chat/completions", chat))[0] == 200
            assert (await r.post("/generate", gen))[0] == 200
            sent = r.decode.received
            assert [{k: v for k, v in b.items() if k != "rid" and not k.startswith("bootstrap_")} for b in sent] == [
                chat, gen]
    run(body())


BAD_SHAPES = [
    ("/v1/completions", {"n": 2}, "unsupported_value"), ("/generate", {"sampling_params": {"n": 3}}, "unsupported_value"),
    ("/v1/completions", {"stop": [5]}, "invalid_type"), ("/v1/completions", {"top_k": 1.5}, "invalid_type"),
    ("/v1/completions", {"top_k": 2**70}, "invalid_value"), ("/v1/completions", {"seed": 2**70}, "invalid_value"),
    ("/v1/completions", {"logit_bias": {"9" * 5000: 1}}, "invalid_token_id"),
    ("/v1/completions", {"logit_bias": {"1": float("inf")}}, "invalid_value"),
    ("/v1/completions", {"json_schema": "{"}, "invalid_value"), ("/v1/completions", {"logprobs": 10**6}, "invalid_value"),
    ("/v1/completions", {"min_tokens": 5, "max_tokens": 2}, "invalid_value"),
    ("/v1/chat/completions", {"tools": "x"}, "invalid_type"),
    ("/v1/chat/completions", {"tools": [{"type": "function", "function": {"name": 5}}]}, "invalid_value"),
    ("/v1/chat/completions", {"tool_choice": "required"}, "invalid_value"),
    ("/v1/chat/completions", {"response_format": {"type": "json_schema", "json_schema": {"schema": 5}}},
     "invalid_value"),
    ("/v1/chat/completions", {"stream": True, "stream_options": {"include_usage": "x"}}, "invalid_type"),
    ("/v1/chat/completions", {"chat_template_kwargs": {"tokenize": True}}, "invalid_value"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "http://127.0.0.1:9/x.png"}}]}]}, "invalid_content"),
    ("/generate", {"sampling_params": [1]}, "invalid_type"),
    ("/generate", {"sampling_params": {"stop_token_ids": [10**7]}}, "invalid_token_id"),
    ("/generate", {"token_ids_logprob": [True]}, "invalid_token_id"),
]


def test_fields_of_the_wrong_shape_are_refused_before_any_server(tmp_path):
    base = {"/generate": {"input_ids": [1, 2]}, "/v1/completions": {"model": "tiny", "prompt": SHORT},
            "/v1/chat/completions": {"model": "tiny", "messages": [{"role": "user", "content": SHORT}]}}

    async def body():
        async with rig(tmp_path) as r:
            for path, extra, code in BAD_SHAPES:
                status, out = await r.post(path, {**base[path], **extra})
                assert (status, out["error"]["code"]) == (400, code), (path, extra, out)
            assert received(r) == 0
    run(body())


# Catalog cases that only a server can judge: a grammar that does not compile in its grammar backend.
SERVER_JUDGED = {"sampling regex='('", "sampling ebnf='root ::= ('"}


def test_the_malformed_request_catalog_is_refused_by_the_router_itself(tmp_path):
    """Every case of prfaas_sgl/tools/chaos/hostile.py that must be refused gets a 4xx from the router with a
    message, before any server sees it; every case that must be served is."""
    async def body():
        async with rig(tmp_path) as r:
            lim = hostile.Limits(r.router.router.limits.vocab_size, context_length=2048, model="tiny")
            wrong = []
            for case in hostile.cases(lim):
                if case.expect == "either" or case.name in SERVER_JUDGED:
                    continue
                before = received(r)
                data = case.body if isinstance(case.body, bytes) else json.dumps(case.body)
                async with r.http.post(r.router.url + case.path, data=data,
                                       headers={"Content-Type": "application/json"}) as resp:
                    kind, message = hostile.classify(resp.status, await resp.read())
                if kind != case.expect or (kind == "refused" and received(r) != before):
                    wrong.append((case.name, resp.status, kind, message[:80]))
            assert wrong == []
    run(body())
