"""Property-based fuzzing of the router's HTTP API, generated from docs/openapi.yaml.

Requests are drawn from the request-body schemas there (valid ones), then mutated: a field removed, a value
anywhere in the document replaced by a wrong type / huge number / odd unicode / random JSON, a random JSON
document, undecodable bytes. They go to the real router in front of stand-in servers that always work, so
every answer >= 500 is caused by the input. After the run the router must still serve, hold no request
state, and its memory must not have grown.

scripts/fuzz_router.py runs the same cases for longer and prints counts.
"""
from __future__ import annotations

import asyncio
import gc
import http.client
import json
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml
from hypothesis import HealthCheck, Phase, given, seed, settings, strategies as st

from prfaas_sgl.router.app import RouterHandle, start_router
from prfaas_sgl.router.config import InstanceSpec, RouterConfig
from tests.support.router_standin import RoomBoard, Standin, build_tiny_tokenizer

SPEC_PATH = Path(__file__).resolve().parents[2] / "docs" / "openapi.yaml"
MODEL = "tiny"
EXAMPLES, SEED = 300, 20261122  # fast tier: ~15 s with the replay on a 2-core machine

pytestmark = pytest.mark.timeout(180)


# ---------------------------------------------------------------- strategies from the OpenAPI file


def load_spec(path: Path = SPEC_PATH) -> dict[str, Any]:
    return yaml.safe_load(path.read_text())


def from_schema(schema: dict[str, Any], spec: dict[str, Any]) -> st.SearchStrategy:
    """Values valid under ``schema`` (the keywords listed in the spec's description)."""
    if "$ref" in schema:
        name = schema["$ref"].rsplit("/", 1)[1]
        return st.deferred(lambda: from_schema(spec["components"]["schemas"][name], spec))
    for key in ("oneOf", "anyOf"):
        if key in schema:
            return st.one_of([from_schema(s, spec) for s in schema[key]])
    if "enum" in schema:
        return st.sampled_from(schema["enum"])
    kind = schema.get("type")
    if isinstance(kind, list):
        return st.one_of([from_schema({**schema, "type": k}, spec) for k in kind])
    if kind == "object":
        return _object(schema, spec)
    if kind == "array":
        items = from_schema(schema.get("items", {}), spec)
        return st.lists(items, min_size=schema.get("minItems", 0), max_size=schema.get("maxItems", 6))
    simple = {
        "string": lambda: st.text(min_size=schema.get("minLength", 0), max_size=schema.get("maxLength", 40)),
        "integer": lambda: st.integers(schema.get("minimum"), schema.get("maximum")),
        "number": lambda: st.floats(schema.get("minimum"), schema.get("maximum"), allow_nan=False,
                                    allow_infinity=False),
        "boolean": st.booleans,
        "null": st.none,
    }
    return simple[kind]() if kind in simple else json_values()


def _object(schema: dict[str, Any], spec: dict[str, Any]) -> st.SearchStrategy:
    props = {k: _property(k, v, spec) for k, v in schema.get("properties", {}).items()}
    required = set(schema.get("required", ()))
    fixed = st.fixed_dictionaries({k: v for k, v in props.items() if k in required},
                                  optional={k: v for k, v in props.items() if k not in required})
    extra = schema.get("additionalProperties", True)
    if not props and extra is not False:
        value = json_values() if extra is True else from_schema(extra, spec)
        return st.dictionaries(st.text(max_size=12), value, max_size=4)
    return fixed


def _property(name: str, schema: dict[str, Any], spec: dict[str, Any]) -> st.SearchStrategy:
    if name == "model":  # mostly the served model: an unknown one is refused before anything else is read
        return st.one_of(st.just(MODEL), st.just(MODEL), st.just(MODEL), from_schema(schema, spec))
    return from_schema(schema, spec)


def json_values(max_leaves: int = 12) -> st.SearchStrategy:
    leaves = st.one_of(st.none(), st.booleans(), st.integers(), st.floats(allow_nan=False), st.text(max_size=20))
    return st.recursive(leaves, lambda kids: st.lists(kids, max_size=4) | st.dictionaries(
        st.text(max_size=8), kids, max_size=4), max_leaves=max_leaves)


# ---------------------------------------------------------------- mutations

HUGE = [2**31, 2**53 + 1, 2**63, 2**64, -(2**63) - 1, 10**30, -1, 0, 1e308, -1e308, 5e-324, 0.5,
        float("nan"), float("inf"), float("-inf")]
ODD_TEXT = st.one_of(
    st.text(st.characters(codec=None, exclude_categories=()), max_size=60),  # lone surrogates included
    st.sampled_from(["", "\x00", "\u202e\u0000", "\ud800", "ok\udfffok", "{{ 7*7 }}", "<|user|>" * 50,
                     "{% for x in range(10**9) %}{% endfor %}", "é" * 300, "\U0001F600" * 100]),
)
NASTY = st.one_of(st.sampled_from(HUGE), ODD_TEXT, json_values(), st.sampled_from([[], {}, [None], {"": None}]))


@st.composite
def mutated(draw, doc: st.SearchStrategy) -> Any:
    """``doc`` with one value somewhere (or one key) replaced by something nasty, or one key removed."""
    value = draw(doc)
    path = draw(_path_in(value))
    if not path:
        return draw(NASTY)
    parent = _at(value, path[:-1])
    key = path[-1]
    if isinstance(parent, dict) and draw(st.booleans()):
        parent.pop(key, None)
    else:
        parent[key] = draw(NASTY)
    return value


@st.composite
def _path_in(draw, value: Any) -> list[Any]:
    """A random path of keys/indices into ``value`` (maybe a new key of a dict); [] = the document itself."""
    path: list[Any] = []
    while isinstance(value, (dict, list)) and value and draw(st.integers(0, 3)) > 0:
        key = draw(st.sampled_from(list(value) if isinstance(value, dict) else range(len(value))))
        path.append(key)
        value = value[key]
    if isinstance(value, dict) and draw(st.integers(0, 4)) == 0:
        path.append(draw(st.text(max_size=10)))  # a key the schema does not know
    return path


def _at(value: Any, path: list[Any]) -> Any:
    for key in path:
        value = value[key]
    return value


def _dumps(value: Any) -> bytes:
    # ensure_ascii escapes lone surrogates as \\udXXX: valid JSON that decodes to an unencodable str
    return json.dumps(value).encode()


BAD_BYTES = st.one_of(
    st.binary(max_size=200),
    st.sampled_from([b"", b"{", b'{"model": "tiny", "prompt": "\xff\xfe"}', b"[" * 100_000, b'{"a":' * 50_000,
                     b"\xef\xbb\xbf{}", b"NaN", b'"' + b"a" * 1000, b"1e999999", b"-" * 10]),
)


@dataclass(frozen=True)
class Case:
    method: str
    path: str
    body: bytes | None
    kind: str  # valid | mutated | random_json | bad_bytes | get

    def __repr__(self) -> str:
        body = self.body if self.body is None or len(self.body) <= 300 else self.body[:300] + b"..."
        return f"Case({self.method} {self.path} kind={self.kind} body={body!r})"


def operations(spec: dict[str, Any]) -> list[tuple[str, str, dict[str, Any] | None]]:
    """(method, path, request-body schema or None) of every operation in the spec."""
    out = []
    for path, item in spec["paths"].items():
        for method, op in item.items():
            body = op.get("requestBody", {}).get("content", {}).get("application/json", {}).get("schema")
            out.append((method.upper(), path, body))
    return out


def cases(spec: dict[str, Any]) -> st.SearchStrategy:
    per_op = []
    for method, path, schema in operations(spec):
        if schema is None:
            per_op.append(st.just(Case(method, path, None, "get")))
            continue
        valid = from_schema(schema, spec)
        per_op.append(st.one_of(
            valid.map(lambda v, m=method, p=path: Case(m, p, _dumps(v), "valid")),
            mutated(valid).map(lambda v, m=method, p=path: Case(m, p, _dumps(v), "mutated")),
            mutated(valid).map(lambda v, m=method, p=path: Case(m, p, _dumps(v), "mutated")),
            json_values().map(lambda v, m=method, p=path: Case(m, p, _dumps(v), "random_json")),
            BAD_BYTES.map(lambda b, m=method, p=path: Case(m, p, b, "bad_bytes")),
        ))
    return st.one_of(per_op)


# ---------------------------------------------------------------- the router under test


class FuzzRig:
    """Router + stand-in remote prefill, local prefill and decode on a private event loop thread."""

    def __init__(self, tmp: Path) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="fuzz-router", daemon=True)
        self.thread.start()
        self.board = RoomBoard()
        self.standins = [Standin("prefill", self.board, kv_wait_s=5, keep_bodies=False) for _ in range(2)]
        self.standins.append(Standin("decode", self.board, kv_wait_s=5, keep_bodies=False))
        self.handle: RouterHandle = self._run(self._start(tmp))
        host, port = self.handle.url.removeprefix("http://").rsplit(":", 1)
        self.conn = http.client.HTTPConnection(host, int(port), timeout=30)

    def _run(self, coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(60)

    async def _start(self, tmp: Path) -> RouterHandle:
        urls = [await s.start() for s in self.standins]
        cfg = RouterConfig.from_flags(port=0, prfaas=(InstanceSpec(urls[0], 8998),), local_prefill=(InstanceSpec(urls[1], 8999),),
                           decode=(InstanceSpec(urls[2]),), tokenizer_path=build_tiny_tokenizer(str(tmp / "tok")),
                           served_model_name=MODEL, context_length=2048, policy="threshold", threshold=32,
                           block_size=4, prefill_timeout_s=5, request_timeout_s=10)
        return await start_router(cfg, seed=0)

    def send(self, case: Case) -> tuple[int, bytes]:
        headers = {"Content-Type": "application/json"} if case.body is not None else {}
        for attempt in (0, 1):  # the router may close a keep-alive connection after an error reply
            try:
                self.conn.request(case.method, case.path, body=case.body, headers=headers)
                r = self.conn.getresponse()
                return r.status, r.read()
            except (http.client.HTTPException, ConnectionError):
                self.conn.close()
                if attempt:
                    raise
        raise AssertionError("unreachable")

    def state(self) -> dict[str, Any]:
        """What a finished request must not leave behind."""
        async def read() -> dict[str, Any]:
            c = self.handle.router.cluster
            names = [t.get_coro().__qualname__ for t in asyncio.all_tasks()]
            return {"inflight": sum(i.inflight for i in c.instances.values()),
                    "inflight_tokens": sum(i.inflight_tokens for i in c.instances.values()),
                    "link_transfers": len(c.link.transfers), "rooms": len(self.board.rooms),
                    # keep-alive connections (one handler task each) come and go with the router's pool
                    "tasks": sum(n != "RequestHandler.start" for n in names),
                    "connections": sum(n == "RequestHandler.start" for n in names)}
        return self._run(read())

    def close(self) -> None:
        self.conn.close()
        self._run(self.handle.close())
        for s in self.standins:
            self._run(s.close())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        self.loop.close()


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


def run_fuzz(rig: FuzzRig, spec: dict[str, Any], examples: int, rng_seed: int,
             on_answer: Callable[[Case, int, bytes], None], shrink: bool = True) -> None:
    """Send ``examples`` cases drawn from ``spec``; ``on_answer`` sees each (and may raise to fail)."""
    phases = [Phase.explicit, Phase.generate] + ([Phase.shrink] if shrink else [])

    @seed(rng_seed)
    @settings(max_examples=examples, deadline=None, database=None, phases=phases, print_blob=False,
              suppress_health_check=list(HealthCheck))
    @given(case=cases(spec))
    def one(case: Case) -> None:
        status, body = rig.send(case)
        on_answer(case, status, body)

    one()


def check_answer(case: Case, status: int, body: bytes) -> None:
    """No input may cause a 5xx; the router's own 4xx are OpenAI-style error objects."""
    assert status < 500, f"{case!r} -> HTTP {status}: {body[:500]!r}"
    if 400 <= status < 500 and case.body is not None:
        err = json.loads(body)["error"]
        assert isinstance(err["message"], str) and isinstance(err["code"], str), body


# ---------------------------------------------------------------- tests


@pytest.fixture(scope="module")
def rig(tmp_path_factory):
    r = FuzzRig(tmp_path_factory.mktemp("fuzz"))
    yield r
    r.close()


VALID_CHAT = Case("POST", "/v1/chat/completions",
                  _dumps({"model": MODEL, "messages": [{"role": "user", "content": "hello"}], "max_tokens": 4}),
                  "valid")


def test_the_spec_lists_exactly_the_routers_endpoints(rig):
    """A route added to the app without the spec (or the reverse) would escape the fuzzing."""
    routes = {(r.method, r.resource.canonical) for r in rig.handle.runner.app.router.routes() if r.method != "HEAD"}
    assert {(m, p) for m, p, _ in operations(load_spec())} == routes


def test_fuzzed_requests_never_cause_a_5xx_and_the_router_keeps_serving(rig):
    for _ in range(20):  # warm up: connections, tokenizer caches, allocator pools
        assert rig.send(VALID_CHAT)[0] == 200
    state0, sent = rig.state(), []

    def answer(case: Case, status: int, body: bytes) -> None:
        sent.append(case)
        check_answer(case, status, body)

    run_fuzz(rig, load_spec(), EXAMPLES, SEED, answer)
    assert rig.send(Case("GET", "/health", None, "get"))[0] == 200
    assert rig.send(VALID_CHAT)[0] == 200
    state = settled(rig, state0)
    assert state["connections"] <= 16, state  # pooled, not one per request
    assert {**state, "connections": 0} == {**state0, "connections": 0}  # nothing in flight, no room, no task
    assert replay_growth(rig, sent, check_answer) < 8 << 20, "the router keeps memory per request"


def settled(rig: FuzzRig, want: dict[str, Any], timeout: float = 10.0) -> dict[str, Any]:
    """The rig's state once it equals ``want`` (connections aside), or its last one after ``timeout``: a
    handler may still be finishing (its counters, its tasks) when its answer has reached the client."""
    end = time.monotonic() + timeout
    while True:
        state = rig.state()
        if {**state, "connections": 0} == {**want, "connections": 0} or time.monotonic() > end:
            return state
        time.sleep(0.05)


def replay_growth(rig: FuzzRig, sent: list[Case], check: Callable[[Case, int, bytes], None]) -> int:
    """RSS growth (bytes) while every fuzzed request is sent again. Measured on a replay because hypothesis
    keeps a record of every example it generated, which would hide or fake a leak in the router."""
    gc.collect()
    before = rss_bytes()
    for case in sent:
        check(case, *rig.send(case))
    gc.collect()
    return rss_bytes() - before


@pytest.mark.parametrize("path, body", [
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "\ud800"}]}),
    ("/v1/completions", {"model": MODEL, "prompt": "ok\udfffok"}),
    ("/generate", {"text": "\udc00"}),
])
def test_unpaired_surrogates_are_a_400(rig, path, body):
    """Found by this fuzzing: JSON's \\ud800 decodes to a str no tokenizer takes (tokenizers raised TypeError
    -> HTTP 500); the router now refuses it while decoding the body."""
    status, answer = rig.send(Case("POST", path, _dumps(body), "surrogate"))
    assert status == 400 and json.loads(answer)["error"]["code"] == "invalid_json", answer
