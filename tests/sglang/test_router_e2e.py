"""The router in front of real SGLang servers on CPU: PrfaaS prefill + local prefill + decode (PD, ``BACKEND``).

Every route must give HF greedy's tokens; routing follows the threshold and the prefix cache; the PrfaaS
server dying leaves requests served locally; bad input gets OpenAI-style 4xx answers. The router runs
in-process on its own event loop thread (``start_router``); clients are synchronous (urllib, ``openai``).
Tests run in file order; the last one kills the PrfaaS server.
"""
from __future__ import annotations

import asyncio
import http.client
import json
import socket
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass

import pytest
from prometheus_client.parser import text_string_to_metric_families

from prfaas_sgl.tools.chaos import hostile
from prfaas_sgl.tools.launch import free_port
from prfaas_sgl.router.app import RouterHandle
from prfaas_sgl.router.config import InstanceSpec, RouterConfig

from .conftest import HYBRID, farm_for, spec
from .live_router import running_router
from .prompts import prompt_ids
from .reference import hf_greedy

pytestmark = [pytest.mark.sglang, pytest.mark.timeout(900)]
THRESHOLD = 200  # tokens: prompts above go to the PrfaaS server
NEW = 8
CHUNK = 256  # PrfaaS chunked prefill below the long prompts: several KV chunks per request
CONTEXT = 8192  # the tiny model's max_position_embeddings
# Long enough that the kill test's first request meets the dead server (and is retried) before a probe does.
HEALTH_S = 60.0
BACKEND = "prfaas_zmq"  # this project's ZeroMQ KV transport (tests/sglang/test_prfaas_zmq.py); "mooncake" works too
ZMQ_ARGS = ("--prfaas-zmq-timeout-s", "120") if BACKEND == "prfaas_zmq" else ()


def _specs(log_dir):
    pd = dict(transfer_backend=BACKEND, extra_args=ZMQ_ARGS)
    return {
        "prfaas": spec(log_dir, "prfaas", HYBRID, mode="prefill", bootstrap_port=free_port(),
                       chunked_prefill_size=CHUNK, **pd),
        "local": spec(log_dir, "local", HYBRID, mode="prefill", bootstrap_port=free_port(), **pd),
        "decode": spec(log_dir, "decode", HYBRID, mode="decode", **pd),
    }


farm = farm_for(_specs)


@dataclass
class Live:
    """A router running on a private event loop thread."""

    handle: RouterHandle
    loop: asyncio.AbstractEventLoop

    @property
    def url(self) -> str:
        return self.handle.url

    def metric(self, name: str, **labels: str) -> float:
        """Value of one sample of ``/metrics`` (0.0 when absent)."""
        text = urllib.request.urlopen(self.url + "/metrics", timeout=10).read().decode()
        for fam in text_string_to_metric_families(text):
            for s in fam.samples:
                if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                    return s.value
        return 0.0


@pytest.fixture(scope="module")
def router(farm, model_paths):
    def inst(name: str) -> InstanceSpec:
        s = farm[name].spec
        return InstanceSpec(s.url, bootstrap_port=s.bootstrap_port, name=name)

    page = farm["prfaas"].spec.page_size or 1  # SGLang's CPU default page size is 1 token
    cfg = RouterConfig.from_flags(port=0, prfaas=(inst("prfaas"),), local_prefill=(inst("local"),), decode=(inst("decode"),),
                       tokenizer_path=model_paths["hybrid"], served_model_name="tiny", context_length=CONTEXT,
                       policy="threshold", threshold=THRESHOLD, block_size=page, health_interval_s=HEALTH_S,
                       prefill_timeout_s=300, request_timeout_s=300)
    with running_router(cfg) as (handle, loop):
        yield Live(handle, loop)


def call(url: str, body: object, timeout: float = 300.0) -> tuple[int, dict, dict]:
    """POST ``body`` (an object, or raw bytes sent as is); returns (status, headers, JSON answer)."""
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    req = urllib.request.Request(url, data, {"content-type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, dict(r.headers), json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, dict(e.headers), json.loads(e.read())


def generate(router: Live, ids: list[int]) -> tuple[str, list[int]]:
    """Greedy /generate through the router; returns (x-prfaas-route, output token ids)."""
    body = {"input_ids": ids, "sampling_params": {"max_new_tokens": NEW, "temperature": 0.0, "ignore_eos": True}}
    status, headers, out = call(router.url + "/generate", body)
    assert status == 200, out
    return headers["x-prfaas-route"], out["output_ids"]


def decisions(router: Live, route: str, reason: str) -> float:
    return router.metric("prfaas_router_decisions_total", route=route, reason=reason)


def test_long_goes_remote_short_stays_local_both_match_hf(router, model_paths):
    path = model_paths["hybrid"]
    short, long = prompt_ids(path, 60, seed=1), prompt_ids(path, 700, seed=2)
    assert generate(router, short) == ("local", hf_greedy(path, short, NEW))
    assert generate(router, long) == ("prfaas", hf_greedy(path, long, NEW))
    assert (decisions(router, "local", "short"), decisions(router, "prfaas", "long")) == (1.0, 1.0)
    assert router.metric("prfaas_router_pool_healthy_instances", pool="prfaas") == 1.0


def test_follow_up_goes_where_its_prefix_is_cached(router, model_paths):
    path = model_paths["hybrid"]
    base = prompt_ids(path, 150, seed=3)  # <= t: computed (and cached) on the local prefill server
    assert generate(router, base)[0] == "local"
    follow = base + prompt_ids(path, 120, seed=4)  # 270 > t, but only 120 are new to the local cache
    assert generate(router, follow) == ("local", hf_greedy(path, follow, NEW))
    fresh = prompt_ids(path, 270, seed=5)  # same length, nothing cached: remote
    assert generate(router, fresh)[0] == "prfaas"
    again = fresh + prompt_ids(path, 40, seed=6)  # its prefix lives on PrfaaS only (scarce rule): remote
    assert generate(router, again) == ("prfaas", hf_greedy(path, again, NEW))


def test_openai_client_streams_on_both_routes(router, model_paths):
    from openai import OpenAI
    from tokenizers import Tokenizer

    path = model_paths["hybrid"]
    tok = Tokenizer.from_file(f"{path}/tokenizer.json")
    client = OpenAI(base_url=router.url + "/v1", api_key="none", timeout=300, max_retries=0)
    for n, route in ((80, "local"), (500, "prfaas")):
        ids = prompt_ids(path, n, seed=10 + n)
        raw = client.completions.with_raw_response.create(model="tiny", prompt=ids, max_tokens=NEW, temperature=0,
                                                          stream=True, extra_body={"ignore_eos": True})
        assert raw.headers["x-prfaas-route"] == route
        text = "".join(c.choices[0].text for c in raw.parse() if c.choices)
        assert text == tok.decode(hf_greedy(path, ids, NEW))
    chat = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "prefill decode"}],
                                          max_tokens=NEW, temperature=0, extra_body={"ignore_eos": True})
    assert chat.usage.completion_tokens == NEW and chat.choices[0].message.content


@pytest.mark.parametrize("body,status,code", [
    (b'{"model": "tiny", "prompt": ', 400, "invalid_json"),
    ({"model": "tiny"}, 400, "missing_field"),
    ({"prompt": "hello"}, 400, "missing_field"),
    ({"model": "tiny", "prompt": [5] * CONTEXT, "max_tokens": 4}, 400, "context_length_exceeded"),
    ({"model": "no-such-model", "prompt": "hello"}, 404, "model_not_found"),
    ({"model": "tiny", "prompt": "hello", "max_tokens": 0}, 400, "invalid_value"),
    ({"model": "tiny", "prompt": "hello", "max_tokens": -3}, 400, "invalid_value"),
])
def test_bad_input_gets_openai_error_and_router_stays_up(router, body, status, code):
    got, headers, out = call(router.url + "/v1/completions", body)
    assert (got, out["error"]["code"], out["error"]["type"]) == (status, code, "invalid_request_error")
    assert out["error"]["message"] and "x-prfaas-route" not in headers
    # ignore_eos: the tiny random-weight model may pick EOS first (a near tie that batch numerics can flip);
    # this request checks that the router still serves, not when the model stops.
    ok, _, answer = call(router.url + "/v1/completions",
                         {"model": "tiny", "prompt": "hello", "max_tokens": 2, "ignore_eos": True})
    assert ok == 200 and answer["usage"]["completion_tokens"] == 2


def open_stream(url: str, body: dict) -> tuple[http.client.HTTPConnection, Iterator[dict]]:
    """POST a streaming /v1/completions; returns the connection and its parsed SSE events (without [DONE])."""
    u = urllib.parse.urlsplit(url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=300)
    conn.request("POST", "/v1/completions", json.dumps(body), {"content-type": "application/json"})
    resp = conn.getresponse()
    assert resp.status == 200, resp.read()

    def events() -> Iterator[dict]:
        for line in resp:
            if line.startswith(b"data: ") and line.strip() != b"data: [DONE]":
                yield json.loads(line[6:])
    return conn, events()


def test_client_rid_cannot_abort_another_clients_request(router, model_paths):
    """H2: SGLang aborts by rid *prefix*. With client rids forwarded, A ("a") leaving aborted B ("abc"). The router
    now refuses a client's rid (the catalog's "field rid" case) and gives each attempt its own: A leaving aborts A."""
    path = model_paths["hybrid"]
    out = 600  # B still decodes when A leaves

    def body(seed: int) -> dict:
        return {"model": "tiny", "prompt": prompt_ids(path, 60, seed=seed), "max_tokens": out, "temperature": 0,
                "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}

    _, b = open_stream(router.url, body(30))
    next(b)  # B is decoding
    conn_a, a = open_stream(router.url, body(31))
    next(a)
    conn_a.sock.shutdown(socket.SHUT_RDWR)  # A leaves: the router drops its stream, SGLang aborts A's rid
    conn_a.close()
    rest = list(b)
    assert not [e for e in rest if "error" in e], rest[-3:]
    finish = [c["finish_reason"] for e in rest for c in e.get("choices", []) if c.get("finish_reason")]
    assert finish == ["length"] and rest[-1]["usage"]["completion_tokens"] == out


def test_hostile_requests_kill_no_server_and_take_none_out_of_rotation(router, farm, model_paths):
    """One client sending out-of-vocabulary ids through the router once killed both prefills (the router retried
    on the local one). Every case of the malformed-request catalog (prfaas_sgl/tools/chaos/hostile.py) goes
    through the router; the cases SGLang itself would crash on also go to every server directly (the plugin's
    request guard must refuse them there too). After each answer every server must answer /health, and at the
    end the router must still count every instance healthy and serve."""
    lim = hostile.Limits(vocab_size=hostile.vocab_size(model_paths["hybrid"]), context_length=CONTEXT, model="tiny")
    servers = {name: farm[name].spec.url for name in ("prfaas", "local", "decode")}
    report = hostile.run({"router": router.url}, servers, hostile.cases(lim), strict=True, say=print)
    hostile.run(servers, servers, hostile.crash_cases(lim), strict=False, say=print, report=report)
    assert report.ok, json.dumps(report.summary(), indent=1)
    for pool, n in (("prfaas", 1), ("local_prefill", 1), ("decode", 1)):
        assert router.metric("prfaas_router_pool_healthy_instances", pool=pool) == n
    ids = prompt_ids(model_paths["hybrid"], 40, seed=7)
    assert generate(router, ids) == ("local", hf_greedy(model_paths["hybrid"], ids, NEW))


def test_prfaas_server_killed_requests_still_served_locally(router, farm, model_paths):
    path = model_paths["hybrid"]
    farm["prfaas"].kill()
    long = prompt_ids(path, 600, seed=20)
    assert generate(router, long) == ("local", hf_greedy(path, long, NEW))  # failed remote, local retry
    assert router.metric("prfaas_router_retries_total", reason="long") == 1.0
    long2 = prompt_ids(path, 650, seed=21)  # PrfaaS now out of rotation: routed locally directly
    assert generate(router, long2) == ("local", hf_greedy(path, long2, NEW))
    assert decisions(router, "local", "no_prfaas") == 1.0
    assert router.metric("prfaas_router_pool_healthy_instances", pool="prfaas") == 0.0
    with urllib.request.urlopen(router.url + "/health", timeout=10) as r:
        assert r.status == 200
