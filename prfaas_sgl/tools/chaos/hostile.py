"""Malformed and hostile requests against real servers: none may kill a server or take it out of rotation.

A catalog of requests (`cases`) that SGLang 0.5.23 or the router once crashed on or might: token ids past the
vocabulary, `true` and 2**70 as ids, sampling parameters of the wrong type or range, grammars that do not
compile, chat messages and tool definitions of the wrong shape, lengths at and past every limit, and the fields
a client may not set. `run` sends each case to each target (the router, and servers directly) and after every
answer checks that every server still answers `/health`.

Each answer is classified (`Answer.kind`):

    refused   4xx with an error message                      fine
    served    200 (a valid edge case, e.g. a prompt exactly at the context length)   fine
    aborted   200 whose finish reason is an abort, with a message                  fine (SGLang's in-band error)
    failed    5xx, no message, not JSON, or no answer at all                        a finding

and the campaign fails when any answer is `failed`, any case expected to be refused was served, or a server
stopped answering `/health` (`Report.ok`).
"""
from __future__ import annotations

import json
import urllib.error
import urllib.request
from collections import Counter
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from prfaas_sgl.router.tokenize import embedding_rows

GEN, CMPL, CHAT = "/generate", "/v1/completions", "/v1/chat/completions"
BIG = 2**70


@dataclass(frozen=True, slots=True)
class Case:
    name: str
    path: str
    body: Any  # a JSON value, or bytes sent as they are
    expect: str = "refused"  # "refused" | "served" | "either"


@dataclass(frozen=True, slots=True)
class Limits:
    vocab_size: int
    context_length: int
    model: str


def _gen(ids: Any, **sp: Any) -> dict:
    return {"input_ids": ids, "sampling_params": {"max_new_tokens": 2, **sp}}


def _cmpl(m: str, **kw: Any) -> dict:
    return {"model": m, "prompt": "hello", "max_tokens": 2, **kw}


def _chat(m: str, messages: Any = None, **kw: Any) -> dict:
    return {"model": m, "messages": messages or [{"role": "user", "content": "hi"}], "max_tokens": 2, **kw}


def id_cases(lim: Limits) -> list[Case]:
    v, m = lim.vocab_size, lim.model
    bad_lists = {"oov": [1, 10_000_000], "at_vocab": [1, v], "negative": [1, -1], "bool": [True, 1],
                 "huge": [1, BIG], "float": [1, 1.5], "string": [1, "2"], "nested": [[1, 2]], "null": [1, None]}
    out = [Case(f"generate ids {k}", GEN, _gen(ids)) for k, ids in bad_lists.items()]
    out += [Case(f"completions ids {k}", CMPL, {"model": m, "prompt": ids, "max_tokens": 2})
            for k, ids in bad_lists.items() if k != "nested"]
    out += [Case("generate ids empty", GEN, _gen([])), Case("generate ids object", GEN, _gen({"0": 1})),
            Case("generate last id", GEN, _gen([1, v - 1]), "served")]
    return out


def sampling_cases(lim: Limits) -> list[Case]:
    v, m = lim.vocab_size, lim.model
    bad = {"temperature": ["hot", -1, 1e309], "top_p": [0, 2, "x"], "top_k": [0, -2, BIG, 1.5],
           "min_p": [-1, 2], "max_new_tokens": [-1, "5", BIG, 1.5], "min_new_tokens": [5, BIG, -1],
           "frequency_penalty": [3, "x"], "repetition_penalty": [0, 1e309], "stop": [5, [5], {"a": 1}],
           "stop_token_ids": [[10_000_000], [-1], "x", [BIG], [True]], "logit_bias": [{"10000000": 1}, {"x": 1},
                                                                                    {"1": "x"}, [1]],
           "sampling_seed": [BIG, "x", 1.5], "n": [0, -1, 10**6, "x"], "regex": ["(", 5],
           "json_schema": ["{", "not json", 5], "ebnf": ["root ::= (", 7], "ignore_eos": ["x"],
           "skip_special_tokens": ["x"], "no_stop_trim": [[1]]}
    out = [Case(f"sampling {k}={val!r:.30}", GEN, _gen([1, 2, 3], **{k: val}), "either" if k == "n" else "refused")
           for k, vals in bad.items() for val in vals]
    out += [Case("sampling min_new>max_new", GEN, _gen([1, 2], min_new_tokens=4)),
            Case("sampling params not object", GEN, {"input_ids": [1, 2], "sampling_params": [1]}),
            Case("logprob start past prompt", GEN, {**_gen([1, 2]), "return_logprob": True,
                                                    "logprob_start_len": 10**9}, "either"),
            Case("logprob start negative", GEN, {**_gen([1, 2]), "return_logprob": True, "logprob_start_len": -5},
                 "either"),
            Case("top logprobs huge", GEN, {**_gen([1, 2]), "return_logprob": True, "top_logprobs_num": 10**6}),
            Case("top logprobs negative", GEN, {**_gen([1, 2]), "return_logprob": True, "top_logprobs_num": -1}),
            Case("token ids logprob oov", GEN, {**_gen([1, 2]), "return_logprob": True,
                                                "token_ids_logprob": [v + 5]}),
            Case("stop token at vocab", GEN, _gen([1, 2], stop_token_ids=[v]))]
    out += [Case(f"completions {k}={val!r:.30}", CMPL, _cmpl(m, **{k: val}))
            for k, val in (("temperature", "x"), ("top_p", 5), ("max_tokens", BIG), ("logprobs", 10**6),
                           ("seed", BIG), ("seed", "x"), ("stop", 5), ("logit_bias", {"99999999": 1}),
                           ("n", 0), ("echo", "x"), ("stream", "yes"))]
    return out


def chat_cases(lim: Limits) -> list[Case]:
    m = lim.model
    fn = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    msgs = {"content int": [{"role": "user", "content": 5}],
            "role bad": [{"role": "wizard", "content": "x"}],
            "no content": [{"role": "user"}],
            "image part": [{"role": "user", "content": [{"type": "image_url",
                                                         "image_url": {"url": "http://127.0.0.1:9/x.png"}}]}],
            "part bad type": [{"role": "user", "content": [{"type": "nope", "text": "x"}]}],
            "tool without id": [{"role": "user", "content": "x"}, {"role": "tool", "content": "r"}],
            "messages string": "hello", "messages empty": [], "message list": [["user", "x"]]}
    out = [Case(f"chat {k}", CHAT, {"model": m, "messages": v, "max_tokens": 2}, "either" if k in (
        "tool without id", "role bad", "no content") else "refused") for k, v in msgs.items()]
    extra = {"tools string": {"tools": "x"}, "tools bad name": {"tools": [{"type": "function",
                                                                          "function": {"name": 5}}]},
             "tool_choice without tools": {"tool_choice": "required"},
             "tool_choice unknown fn": {"tools": [fn], "tool_choice": {"type": "function",
                                                                       "function": {"name": "g"}}},
             "response_format bad": {"response_format": {"type": "nonsense"}},
             "json_schema not object": {"response_format": {"type": "json_schema", "json_schema": {"schema": 5}}},
             "json_schema broken": {"response_format": {"type": "json_schema",
                                                       "json_schema": {"name": "x", "schema": {"type": "nope"}}}},
             "template kwargs string": {"chat_template_kwargs": "x"},
             "template kwargs tokenize": {"chat_template_kwargs": {"tokenize": True}},
             "continue final without assistant": {"continue_final_message": True},
             "top_logprobs huge": {"logprobs": True, "top_logprobs": 10**6},
             "stream_options bad": {"stream": True, "stream_options": {"include_usage": "x"}}}
    out += [Case(f"chat {k}", CHAT, _chat(m, **v), "either" if k in (
        "continue final without assistant", "tool_choice unknown fn", "json_schema broken") else "refused")
            for k, v in extra.items()]
    return out


def field_cases(lim: Limits) -> list[Case]:
    m = lim.model
    risky = {"custom_logit_processor": "gASVAAAAAA==", "priority": BIG, "no_logs": True, "lora_path": "x",
             "image_data": "http://127.0.0.1:9/a.png", "input_embeds": [[0.1, 0.2]], "return_hidden_states": True,
             "rid": "a", "bootstrap_host": "127.0.0.1", "bootstrap_room": BIG, "data_parallel_rank": 99,
             "session_params": {"id": "x"}}
    return [Case(f"field {k}", GEN, {**_gen([1, 2, 3]), k: v}) for k, v in risky.items()] + [
        Case("field unknown", CMPL, _cmpl(m, no_such_field=1), "either"),
        Case("body not JSON", GEN, b'{"input_ids": [1,'), Case("body array", GEN, b"[1, 2]"),
        Case("body deep", GEN, b"[" * 100_000 + b"]" * 100_000), Case("lone surrogate", CMPL,
                                                                     b'{"model": "%s", "prompt": "\\ud800"}' % m.encode())]


def length_cases(lim: Limits) -> list[Case]:
    c, m = lim.context_length, lim.model
    return [Case("prompt at context - 1, 1 new", GEN, _gen([5] * (c - 1), max_new_tokens=1), "either"),
            Case("prompt at context", GEN, _gen([5] * c, max_new_tokens=1)),
            Case("prompt past context", GEN, _gen([5] * (c + 1), max_new_tokens=1)),
            Case("total past context", GEN, _gen([5] * 8, max_new_tokens=c)),
            Case("text past context", CMPL, {"model": m, "prompt": "a " * (4 * c), "max_tokens": 1}),
            Case("max_tokens at context", CMPL, _cmpl(m, max_tokens=c)),
            Case("stop string huge", CMPL, _cmpl(m, stop="x" * 200_000), "either")]


def cases(lim: Limits) -> list[Case]:
    return id_cases(lim) + sampling_cases(lim) + chat_cases(lim) + field_cases(lim) + length_cases(lim)


def crash_cases(lim: Limits) -> list[Case]:
    """What took a stock SGLang 0.5.23 server down (CPU, measured): sent to servers directly, each must be refused."""
    v, m = lim.vocab_size, lim.model
    return [Case("generate id past vocabulary", GEN, _gen([1, 10_000_000])),  # IndexError in the embedding
            Case("generate id at vocabulary", GEN, _gen([1, v])),
            Case("generate id negative", GEN, _gen([1, -1])),
            Case("completions id past vocabulary", CMPL, {"model": m, "prompt": [1, v], "max_tokens": 2}),
            Case("n = 10**6", GEN, _gen([1, 2, 3], n=10**6)),  # queued a million sequences: OOM-killed at 14 GiB
            Case("top logprobs 10**6", GEN, {**_gen([1, 2]), "return_logprob": True, "top_logprobs_num": 10**6}),
            Case("stop id past vocabulary", GEN, _gen([1, 2], stop_token_ids=[v], min_new_tokens=1)),
            Case("batch x n past the bound", GEN, _gen([[1, 2]] * 64, n=64))]


def vocab_size(model_path: str) -> int:
    """Rows of the model's token embedding: the limit the router and the servers' guard check ids against."""
    rows = embedding_rows(model_path)
    if rows is None:
        raise ValueError(f"no readable vocab_size in {model_path}/config.json")
    return rows


@dataclass(frozen=True, slots=True)
class Answer:
    target: str
    case: str
    status: int  # 0: no HTTP answer
    kind: str  # refused | served | aborted | failed
    message: str
    expected: str  # what the router must answer; a server asked directly need only not fail
    strict: bool

    @property
    def finding(self) -> bool:
        if self.kind == "failed" or not self.strict:
            return self.kind == "failed"
        return (self.expected == "refused" and self.kind == "served") or (
            self.expected == "served" and self.kind != "served")


def _message(body: Any) -> str:
    if isinstance(body, dict):
        err = body.get("error")
        if isinstance(err, dict):
            return str(err.get("message") or "")
        if isinstance(err, str):
            return err
        if "message" in body:
            return str(body["message"])
        if "detail" in body:
            return str(body["detail"])
    return ""


def _finish(body: Any) -> Any:
    if isinstance(body, dict):
        if "meta_info" in body:
            return body["meta_info"].get("finish_reason")
        choices = body.get("choices") or [{}]
        return choices[0].get("finish_reason") if isinstance(choices[0], dict) else None
    return None


def classify(status: int, raw: bytes) -> tuple[str, str]:
    """(kind, message) of one HTTP answer (a 200 stream is judged by its events)."""
    if status == 200 and raw.startswith(b"data:"):
        return _classify_stream(raw)
    try:
        body = json.loads(raw)
    except ValueError:
        body = None
    if status == 0 or status >= 500 or body is None:
        return "failed", raw[:200].decode(errors="replace")
    message = _message(body)
    if 400 <= status < 500:
        return ("refused" if message else "failed"), message
    finish = _finish(body)
    if isinstance(finish, dict) and finish.get("type") == "abort":
        return ("aborted" if finish.get("message") else "failed"), str(finish.get("message") or "")
    return "served", ""


def _classify_stream(raw: bytes) -> tuple[str, str]:
    events = [line[5:].strip() for line in raw.splitlines() if line.startswith(b"data:")]
    for event in events:
        if event == b"[DONE]":
            continue
        try:
            body = json.loads(event)
        except ValueError:
            return "failed", event[:200].decode(errors="replace")
        if isinstance(body, dict) and "error" in body:
            message = _message(body)
            return ("aborted" if message else "failed"), message
    return "served", ""


def post(url: str, body: Any, timeout_s: float) -> tuple[int, bytes]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    req = urllib.request.Request(url, data, {"content-type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()
    except (OSError, urllib.error.URLError) as e:
        return 0, repr(e).encode()


def healthy(url: str, timeout_s: float = 10.0) -> bool:
    try:
        with urllib.request.urlopen(url + "/health", timeout=timeout_s) as r:
            return r.status == 200
    except (OSError, urllib.error.URLError):
        return False


@dataclass
class Report:
    answers: list[Answer] = field(default_factory=list)
    down: list[str] = field(default_factory=list)  # "<server> after <target>: <case>"

    @property
    def findings(self) -> list[Answer]:
        return [a for a in self.answers if a.finding]

    @property
    def ok(self) -> bool:
        return not self.findings and not self.down

    def summary(self) -> dict[str, Any]:
        kinds = Counter(f"{a.target} {a.kind}" for a in self.answers)
        return {"answers": len(self.answers), "kinds": dict(sorted(kinds.items())), "servers_down": self.down,
                "findings": [{"target": a.target, "case": a.case, "status": a.status, "kind": a.kind,
                              "expected": a.expected, "message": a.message[:300]} for a in self.findings]}


def run(targets: Mapping[str, str], servers: Mapping[str, str], all_cases: Iterable[Case], strict: bool,
        timeout_s: float = 120.0, say: Callable[[str], None] = lambda _: None, report: Report | None = None) -> Report:
    """Send every case to every target (name -> base URL); after each, every server (name -> URL) must be healthy.

    ``strict``: the targets are routers, which must answer each case as it expects (the router allows only the
    fields it knows); a server asked directly must only never fail or go down. A server that stops answering is
    recorded once, with the request that took it down, and not probed again. Appends to ``report`` if given."""
    report = report if report is not None else Report()
    dead = {d.split(" after ")[0] for d in report.down}
    for case in all_cases:
        for target, base in targets.items():
            status, raw = post(base + case.path, case.body, timeout_s)
            kind, message = classify(status, raw)
            answer = Answer(target, case.name, status, kind, message, case.expect, strict)
            report.answers.append(answer)
            if answer.finding:
                say(f"FINDING {target} {case.name}: {status} {kind} {message[:120]}")
            for name, url in servers.items():
                if name not in dead and not healthy(url):
                    dead.add(name)
                    report.down.append(f"{name} after {target}: {case.name}")
                    say(f"DOWN {name} after {target}: {case.name}")
    return report
