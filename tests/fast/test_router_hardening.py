"""The router's request path: each test pins one finding of the reliability review.

A client ``rid`` forwarded, huge bodies stalling the loop, a server's 4xx taken for a dead server, an open
``/admin``, bad ``chat_template_kwargs`` giving 500, a client that left keeping its attempt running.
The router runs in front of in-process stand-ins (``router/standin.py``), which record what they receive.
"""

from __future__ import annotations

import asyncio
import json
import re
import threading
import time
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web

from prfaas_sgl.router.requests import ApiError, Limits, parse_request
from prfaas_sgl.router.tokenize import PromptTokenizer
from tests.support.router_standin import Standin, build_tiny_tokenizer

from .test_router_http import LONG, SHORT, rig, run

pytestmark = pytest.mark.timeout(60)


async def metric(r, name: str) -> float:
    async with r.http.get(r.router.url + "/metrics") as resp:
        for line in (await resp.text()).splitlines():
            if line.startswith(name + " "):
                return float(line.split()[-1])
    return 0.0


async def until(cond, timeout: float = 10.0) -> bool:
    """Poll ``cond`` on this loop until it holds or ``timeout`` passes (no fixed sleep to tune)."""
    end = time.monotonic() + timeout
    while not cond() and time.monotonic() < end:
        await asyncio.sleep(0.01)
    return cond()


# ---------------------------------------------------------------- the router owns rid


def test_client_rid_and_internal_fields_are_refused_and_each_attempt_gets_its_own_rid(tmp_path):
    """SGLang aborts by rid prefix; a client rid "a" would abort others' requests. The router's own fields are
    refused by name (they used to be dropped silently); each attempt gets a fresh rid."""
    async def body():
        async with rig(tmp_path) as r:
            req = {"model": "tiny", "prompt": LONG, "max_tokens": 4}
            internal = {"rid": "a", "bootstrap_room": 5, "bootstrap_host": "10.6.6.6", "bootstrap_pair_key": "k",
                        "http_worker_ipc": "ipc:///tmp/x", "data_parallel_rank": 3, "routed_dp_rank": 3,
                        "disagg_prefill_dp_rank": 1, "session_params": {"id": "s"}, "encoder_urls": ["http://x"]}
            for name, value in internal.items():
                status, out = await r.post("/v1/completions", {**req, name: value})
                assert (status, out["error"]["code"]) == (400, "unsupported_field") and name in out["error"]["message"]
            assert r.remote.received == r.local.received == r.decode.received == []
            assert (await r.post("/v1/completions", req))[0] == 200
            pre, dec = r.remote.received[0], r.decode.received[0]
            assert pre == dec and re.fullmatch("[0-9a-f]{32}", pre["rid"])
            assert pre["bootstrap_host"] == "127.0.0.1"
            r.remote.fail = "http500"  # the local retry is a new attempt: a new rid (SGLang refuses duplicates)
            assert (await r.post("/v1/completions", req))[0] == 200
            first, retry = r.decode.received[1], r.decode.received[2]
            assert r.remote.received[1]["rid"] == first["rid"] and r.local.received[0]["rid"] == retry["rid"]
            assert len({pre["rid"], first["rid"], retry["rid"]}) == 3
    run(body())


# ---------------------------------------------------------------- huge bodies and prompts


def peak_rss() -> int:
    """Peak resident set size of this process (bytes)."""
    status = Path("/proc/self/status").read_text()
    return int(re.search(r"VmHWM:\s+(\d+) kB", status).group(1)) * 1024


async def probe_health(url: str, http: aiohttp.ClientSession, stop: asyncio.Event) -> list[float]:
    """GET /health every 50 ms until ``stop``; returns each probe's latency (s)."""
    took = []
    while not stop.is_set():
        t0 = time.monotonic()
        async with http.get(url + "/health") as resp:
            assert resp.status == 200
        took.append(time.monotonic() - t0)
        await asyncio.sleep(0.05)
    return took


def assert_loop_answers(took: list[float]) -> None:
    """The loop answered /health within 200 ms (the issue's bound) all along, bar the slowest 10% (at least
    one probe: a loaded CI machine may pause this process), and never stalled 1 s. The old router parsed
    and tokenized a 4 MiB prompt on the loop for over 1 s, a 32 MiB one for several."""
    slow = max(1, len(took) // 10)
    assert len(took) >= 4 and sorted(took)[-slow - 1] < 0.2 and max(took) < 1.0, took


HUGE = 32 << 20  # bytes of prompt text


@pytest.mark.parametrize("framing", ["content_length", "chunked"])
def test_huge_prompt_refused_unread_while_health_answers(tmp_path, framing):
    """A 32 MiB prompt used to be parsed on the loop and tokenized holding the GIL (seconds, gigabytes)."""
    payload = json.dumps({"model": "tiny", "prompt": "x" * HUGE}).encode()

    async def chunks():  # 1 MiB at a time: one 32 MiB write would stall this loop (the router's) client-side
        for i in range(0, len(payload), 1 << 20):
            yield payload[i:i + (1 << 20)]

    async def body():
        async with rig(tmp_path) as r:
            base = peak_rss()
            stop = asyncio.Event()
            probes = asyncio.create_task(probe_health(r.router.url, r.http, stop))
            await asyncio.sleep(0.2)
            headers = {"Content-Length": str(len(payload))} if framing == "content_length" else {}
            async with r.http.post(r.router.url + "/v1/completions", data=chunks(), headers=headers) as resp:
                status, out = resp.status, await resp.json()
            await asyncio.sleep(0.2)
            stop.set()
            took = await probes
            assert_loop_answers(took)
            assert status == 413 and out["error"]["code"] == "request_too_large"
            assert "--max-body-bytes" in out["error"]["message"]
            assert peak_rss() - base < 100 << 20
            assert (await r.post("/v1/completions", {"model": "tiny", "prompt": SHORT}))[0] == 200
    run(body())


@pytest.mark.parametrize("path,req", [
    ("/v1/completions", {"model": "tiny", "prompt": "x" * 40_000}),
    ("/generate", {"text": "x" * 40_000}),
    ("/v1/chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": "x" * 40_000}]}),
])
def test_prompt_longer_than_context_in_characters_refused_before_tokenizing(tmp_path, path, req):
    """40k characters cannot fit 2048 tokens at <= 16 characters per token: no need to tokenize them."""
    async def body():
        async with rig(tmp_path) as r:
            def refuse(text: str, add_special_tokens: bool) -> list[int]:
                raise AssertionError("tokenized a prompt that cannot fit")
            r.router.router.tokenizer.encode = refuse
            status, out = await r.post(path, req)
            assert (status, out["error"]["code"]) == (400, "context_length_exceeded")
            assert "40000 characters" in out["error"]["message"] or "characters" in out["error"]["message"]
    run(body())


def test_big_body_within_limits_is_served(tmp_path):
    """Bodies over 64 KiB take the worker-thread path (JSON decode + tokenize under a semaphore)."""
    async def body():
        async with rig(tmp_path) as r:
            req = {"model": "tiny", "prompt": SHORT, "max_tokens": 2, "user": "u" * 200_000}
            statuses = await asyncio.gather(*[r.post("/v1/completions", req) for _ in range(4)])
            assert [s for s, _ in statuses] == [200] * 4
            status, out = await r.post("/v1/completions", b'{"prompt": ' + b" " * 100_000 + b"[}")
            assert (status, out["error"]["code"]) == (400, "invalid_json")
    run(body())


def max_stall(work) -> tuple[float, float]:
    """Run ``work`` on a thread; returns (its duration, the longest gap between this thread's 1 ms ticks while it
    ran). The stretch from the last tick to the work's end counts too: a GIL holder may run from before this
    thread's first tick to its own end, leaving no gap between ticks at all (a clean-clone CI run saw 0.0)."""
    finished: list[float] = []
    t = threading.Thread(target=lambda: (work(), finished.append(time.monotonic())))
    t0 = last = time.monotonic()
    gap = 0.0
    t.start()
    while not finished:
        time.sleep(0.001)
        now = time.monotonic()
        gap, last = max(gap, now - last), now
    t.join()
    return finished[0] - t0, max(gap, finished[0] - last)


def test_tokenizing_releases_the_gil(tmp_path):
    """``Tokenizer.encode`` holds the GIL for its whole run (the control below); ``encode_batch`` releases it."""
    tok = PromptTokenizer(build_tiny_tokenizer(str(tmp_path / "tok")))
    # 800 kB: ~1 s held by the control; encode_batch splits it over the cores (0.06 s for 200 kB on a quiet
    # 2-core machine, too short to tell a release from a lucky schedule, so CI failed there)
    text = "prefill as a service moves long prompts " * 20_000
    assert tok.encode_text(text) == tok.tok.encode(text, add_special_tokens=True).ids
    took, gap = max_stall(lambda: tok.tok.encode(text))
    assert gap > 0.8 * took  # control: the old call froze every other thread
    runs = []
    for _ in range(3):  # a loaded machine may pause this thread once; a GIL holder freezes it every time
        runs.append(max_stall(lambda: tok.encode_text(text)))
        if runs[-1][1] < runs[-1][0] / 4:
            break
    took, gap = runs[-1]
    assert took > 0.1 and gap < took / 4, runs


# ---------------------------------------------------------------- a 4xx is the request's fault


class Strict(Standin):
    """A stand-in that, like SGLang, answers 400 to an argument the router does not check (an invalid regex)."""

    reject_after_s = 0.0

    async def generate(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        if body.get("regex") != "(":
            return await super().generate(request)
        self.received.append(body)
        await asyncio.sleep(self.reject_after_s)
        error = {"object": "error", "message": "invalid regex '('", "type": "BadRequestError", "code": 400}
        if not body.get("stream"):
            return web.json_response(error, status=400)
        out = web.StreamResponse(headers={"Content-Type": "text/event-stream"})  # refused after the stream began
        await out.prepare(request)
        await out.write(b"data: " + json.dumps({"error": error}).encode() + b"\n\ndata: [DONE]\n\n")
        return out


@pytest.mark.parametrize("first", ["prefill", "decode"])
def test_server_4xx_relayed_unchanged_and_servers_stay_in_rotation(tmp_path, first):
    """A prefill 400 marked the prefill dead and retried; the retry's 400 removed the local one too -> 502."""
    async def body():
        async with rig(tmp_path, standin=Strict) as r:
            (r.decode if first == "prefill" else r.remote).reject_after_s = 0.2
            insts = r.router.router.cluster.instances.values()
            for _ in range(20):
                status, out = await r.post("/v1/completions", {"model": "tiny", "prompt": LONG, "regex": "("})
                assert (status, out["message"]) == (400, "invalid regex '('")
                assert all(i.healthy for i in insts)
            assert await metric(r, 'prfaas_router_pool_healthy_instances{pool="prfaas"}') == 1.0
            assert await metric(r, 'prfaas_router_retries_total{reason="long"}') == 0.0
            assert r.local.received == [] and len(r.remote.received) == len(r.decode.received) == 20
            assert await until(lambda: all(i.inflight == 0 for i in insts))  # the other attempt ended too
            assert (await r.post("/v1/completions", {"model": "tiny", "prompt": LONG, "max_tokens": 1}))[0] == 200
    run(body())


def test_stream_refused_with_a_4xx_event_is_relayed_not_retried(tmp_path):
    """SGLang refuses some requests inside the stream (an error event with code 400): relay, no retry."""
    async def body():
        async with rig(tmp_path, standin=Strict) as r:
            req = {"model": "tiny", "prompt": LONG, "regex": "(", "stream": True}
            async with r.http.post(r.router.url + "/v1/completions", json=req) as resp:
                assert resp.status == 200
                events = [line[6:] for line in (await resp.text()).split("\n") if line.startswith("data: ")]
            assert json.loads(events[0])["error"]["code"] == 400 and events[-1] == "[DONE]"
            assert r.local.received == [] and await metric(r, 'prfaas_router_retries_total{reason="long"}') == 0.0
    run(body())


BAD_SAMPLING = [
    ("/v1/completions", {"temperature": -1}, "invalid_value"),
    ("/v1/completions", {"temperature": float("inf")}, "invalid_value"),
    ("/v1/completions", {"top_p": 0}, "invalid_value"),
    ("/v1/chat/completions", {"top_p": 5}, "invalid_value"),
    ("/v1/completions", {"top_k": 0}, "invalid_value"),
    ("/v1/completions", {"temperature": "hot"}, "invalid_type"),
    ("/v1/completions", {"presence_penalty": 3}, "invalid_value"),
    ("/v1/completions", {"stream": "yes"}, "invalid_type"),
    ("/generate", {"sampling_params": {"temperature": -1}}, "invalid_value"),
    ("/generate", {"sampling_params": {"min_p": 2}}, "invalid_value"),
]


def test_router_refuses_bad_sampling_params_itself(tmp_path):
    async def body():
        async with rig(tmp_path) as r:
            for path, extra, code in BAD_SAMPLING:
                req = ({"text": SHORT} if path == "/generate" else {"model": "tiny", "prompt": SHORT}) | extra
                if path == "/v1/chat/completions":
                    req = {"model": "tiny", "messages": [{"role": "user", "content": SHORT}]} | extra
                status, out = await r.post(path, req)
                assert (status, out["error"]["code"]) == (400, code), (path, extra, out)
            assert r.remote.received == r.local.received == r.decode.received == []
            ok = {"model": "tiny", "prompt": SHORT, "temperature": 0, "top_p": 1, "top_k": -1, "stream": None}
            assert (await r.post("/v1/completions", ok))[0] == 200
    run(body())


# ---------------------------------------------------------------- /admin needs a token off loopback


def test_admin_needs_the_token_when_one_is_set(tmp_path):
    async def body():
        async with rig(tmp_path, admin_token="s3cret") as r:
            url = r.router.url + "/admin/routing"
            for headers in ({}, {"Authorization": "Bearer nope"}, {"Authorization": "s3cret"}):
                async with r.http.post(url, json={"policy": "all_remote"}, headers=headers) as resp:
                    assert resp.status == 401 and "Bearer" in (await resp.json())["error"]["message"]
                async with r.http.get(url, headers=headers) as resp:
                    assert resp.status == 401
            assert r.router.router.core.policy_name == "threshold"
            auth = {"Authorization": "Bearer s3cret"}
            async with r.http.post(url, json={"policy": "all_remote"}, headers=auth) as resp:
                assert resp.status == 200 and (await resp.json())["policy"] == "all_remote"
            async with r.http.get(url, headers=auth) as resp:
                assert resp.status == 200
    run(body())


def test_admin_refused_on_a_public_listener_without_a_token(tmp_path):
    async def body():
        async with rig(tmp_path, host="0.0.0.0") as r:
            url = r.router.url.replace("0.0.0.0", "127.0.0.1")
            async with r.http.post(url + "/admin/routing", json={"threshold": 0}) as resp:
                out = await resp.json()
                assert resp.status == 403 and "--admin-token" in out["error"]["message"]
            async with r.http.get(url + "/admin/routing") as resp:
                assert resp.status == 403
            assert r.router.router.core.policy.threshold == 32
            async with r.http.post(url + "/v1/completions", json={"model": "tiny", "prompt": SHORT}) as resp:
                assert resp.status == 200
    run(body())


# ---------------------------------------------------------------- chat_template_kwargs


@pytest.mark.parametrize("kwargs,code", [
    ("x", "invalid_type"), ([1], "invalid_type"), ({"messages": []}, "invalid_value"),
    ({"add_generation_prompt": False}, "invalid_value"), ({"bos_token": "!"}, "invalid_value"),
])
def test_bad_chat_template_kwargs_get_400_and_are_counted(tmp_path, kwargs, code):
    """These raised TypeError inside the router: HTTP 500, no error metric."""
    async def body():
        async with rig(tmp_path) as r:
            req = {"model": "tiny", "messages": [{"role": "user", "content": SHORT}], "chat_template_kwargs": kwargs}
            status, out = await r.post("/v1/chat/completions", req)
            assert (status, out["error"]["code"]) == (400, code)
            assert await metric(r, f'prfaas_router_errors_total{{code="{code}"}}') == 1.0
            req["chat_template_kwargs"] = {"enable_thinking": False}
            assert (await r.post("/v1/chat/completions", req))[0] == 200
    run(body())


def test_template_runtime_error_is_a_400(tmp_path):
    """A template failing on client data with a non-Jinja error (here TypeError) is the request's fault."""
    path = build_tiny_tokenizer(str(tmp_path / "tok"))
    cfg = Path(path) / "tokenizer_config.json"
    cfg.write_text(json.dumps({**json.loads(cfg.read_text()), "chat_template": "{{ messages[0]['content'] + 1 }}"}))
    tok = PromptTokenizer(path)
    body = {"model": "tiny", "messages": [{"role": "user", "content": "x"}]}
    with pytest.raises(ApiError) as e:
        parse_request("/v1/chat/completions", body, tok, "tiny", Limits(2048, 32768, tok.vocab_size))
    assert (e.value.status, e.value.code) == (400, "invalid_messages") and "TypeError" in e.value.message


# ---------------------------------------------------------------- a client that leaves


class Watched(Standin):
    """Records when a request's handler was cancelled (its client, the router, closed the connection)."""

    def __init__(self, *a, **kw) -> None:
        super().__init__(*a, **kw)
        self.cancelled_at: list[float] = []

    async def generate(self, request: web.Request) -> web.StreamResponse:
        try:
            return await super().generate(request)
        except asyncio.CancelledError:
            self.cancelled_at.append(time.monotonic())
            raise


def test_client_disconnect_cancels_the_attempt(tmp_path):
    """aiohttp did not cancel the handler: decode kept generating for a client that was gone."""
    async def body():
        async with rig(tmp_path, standin=Watched) as r:
            r.decode.delay_s = 5.0
            quick = aiohttp.ClientTimeout(total=0.5)
            with pytest.raises(asyncio.TimeoutError):
                await r.http.post(r.router.url + "/v1/completions", timeout=quick,
                                  json={"model": "tiny", "prompt": LONG, "max_tokens": 4})
            left = time.monotonic()
            assert await until(lambda: r.decode.cancelled_at)
            assert r.decode.cancelled_at[0] - left < 2.0  # not the 5 s the decode would have kept running
            insts = r.router.router.cluster.instances.values()
            assert await until(lambda: all(i.inflight == 0 for i in insts))
            assert r.router.router.cluster.link.transfers == {}
    run(body())
