"""The generator's measurements against a scripted stand-in server with known latencies.

Sound bounds only: measured TTFT and end-to-end time can only *exceed* the scripted sleeps (the client
starts its clock before sending), by the HTTP round trip plus event-loop stalls. Other test suites share
the 2-core box (load averages of 8-18 were seen), so a canary task measures the loop's worst wake-up lag
during the run and the allowed excess is a small constant plus that lag. Single inter-token gaps have no
sound lower bound on the client (a stalled reader gets two chunks in one read), so ITL/TPOT are checked
through medians and through the end-to-end time.
"""

import asyncio
import time

import numpy as np
import pytest

from prfaas_sgl.tools.loadgen.cli import bench
from prfaas_sgl.tools.loadgen.config import BenchConfig
from prfaas_sgl.tools.loadgen.report import format_table
from tests.support.loadgen_standin import StandInScript, StandInServer

BASE_TOL = 0.03  # HTTP round trip and parsing on an idle machine, generously
EARLY = 0.002  # asyncio timers may fire up to a clock tick early


async def _canary(lags: list[float], stop: asyncio.Event) -> None:
    """Record how late 5 ms sleeps wake up: the event loop's stalls during the run."""
    while not stop.is_set():
        t = time.perf_counter()
        await asyncio.sleep(0.005)
        lags.append(time.perf_counter() - t - 0.005)


def run_bench(script: StandInScript, lags: list[float] | None = None, **kw) -> tuple[dict, StandInServer]:
    async def go():
        srv = StandInServer(script)
        url = await srv.start()
        stop = asyncio.Event()
        canary = asyncio.create_task(_canary(lags if lags is not None else [], stop))
        try:
            if kw.pop("metrics", False):
                kw["router_metrics"] = url + "/metrics"
            cfg = BenchConfig(url=url, progress=False, request_timeout=20, **kw)
            return await bench(cfg), srv
        finally:
            stop.set()
            await canary
            await srv.stop()

    return asyncio.run(asyncio.wait_for(go(), 40))


SCRIPT = StandInScript(ttft_base_s=0.05, ttft_per_token_s=4e-4, itl_s=0.01)  # TTFT 0.09..0.29 s


def test_latency_percentiles_match_the_script():
    lags: list[float] = []
    res, srv = run_bench(SCRIPT, lags, input_len="uniform:100:600", output_len="fixed:8", num_sessions=16,
                         concurrency=4, seed=3)
    tol = BASE_TOL + 2 * max(lags)  # twice: the server's wake-up and the client's read can both stall
    reqs = res["requests"]
    assert len(reqs) == 16 and all(r["ok"] for r in reqs)
    assert res["config"]["model"] == ""  # config as given; the client asked /v1/models
    assert {b["model"] for b in srv.bodies} == {"standin"}
    assert all(b["max_tokens"] == 8 and b["ignore_eos"] and b["stream_options"] == {"include_usage": True}
               for b in srv.bodies)
    assert 2 <= srv.max_inflight <= 4
    expected = []
    for r in reqs:
        assert r["prompt_tokens"] == r["input_len"]  # one word per token in approximate mode
        assert r["cached_tokens"] == 0
        assert r["output_tokens"] == 8 and len(r["token_times"]) == 8
        exp = srv.expected_ttft_s(r["input_len"])
        expected.append(exp)
        assert exp - EARLY <= r["ttft_s"] <= exp + tol
        assert exp + 7 * SCRIPT.itl_s - EARLY <= r["e2e_s"] <= exp + 7 * SCRIPT.itl_s + tol
    ttft = res["summary"]["ttft_s"]
    for q in (50, 90, 99):
        want = float(np.percentile(expected, q))
        assert want - EARLY <= ttft[f"p{q}"] <= want + tol
    assert np.mean(expected) - EARLY <= ttft["mean"] <= np.mean(expected) + tol
    # the stand-in paces tokens on absolute deadlines, so one late chunk moves a TPOT by its lag / 7 only
    assert res["summary"]["tpot_s"]["p50"] == pytest.approx(SCRIPT.itl_s, abs=0.003 + tol / 7)
    assert res["summary"]["itl_s"]["p50"] == pytest.approx(SCRIPT.itl_s, abs=0.003 + tol / 7)
    s = res["summary"]
    assert s["output_token_throughput"] == pytest.approx(16 * 8 / s["duration_s"])
    assert s["goodput"] == s["request_throughput"] and s["slo_attainment"] == 1.0
    assert s["cached_token_fraction"] == 0.0


def test_routes_offload_fraction_and_link_metrics():
    script = StandInScript(ttft_per_token_s=2e-5, itl_s=0.002, route_threshold=300)
    res, srv = run_bench(script, input_len="uniform:50:600", output_len="fixed:4", num_sessions=24,
                         arrival="uniform", rate=60, metrics=True, metrics_interval=0.1, seed=1)
    reqs = res["requests"]
    n_remote = sum(r["input_len"] > 300 for r in reqs)
    assert 0 < n_remote < 24
    assert {r["route"] for r in reqs if r["input_len"] > 300} == {"prfaas"}
    assert res["routes"]["prfaas"]["ok"] == n_remote and res["routes"]["local"]["ok"] == 24 - n_remote
    router = res["router"]
    assert router["offload_fraction"] == pytest.approx(n_remote / 24)
    assert router["failed_scrapes"] == 0 and router["scrapes"] >= 2  # opening + closing, more in between
    # the opening scrape precedes the first request and the closing one follows the last
    assert router["link_bytes"] == script.link_bytes_per_token * sum(r["input_len"] for r in reqs
                                                                     if r["input_len"] > 300)
    link = res["timeseries"]["link"]
    assert len(link["t_s"]) == router["scrapes"] - 1
    assert all(u == pytest.approx(b / script.link_capacity_bps) for u, b in
               zip(link["link_utilization"], link["link_bps"]))
    assert router["link_utilization_max"] > 0
    table = format_table(res)
    assert "prfaas" in table and "local" in table and "offload fraction" in table


def test_chat_api_without_usage_counts_text_chunks():
    script = StandInScript(ttft_per_token_s=1e-5, itl_s=0.002, honour_usage=False)
    res, srv = run_bench(script, api="chat", input_len="fixed:50", output_len="fixed:6", num_sessions=3,
                         concurrency=3)
    assert all("messages" in b for b in srv.bodies)
    for r in res["requests"]:
        assert r["ok"] and r["output_tokens"] == 6 and r["prompt_tokens"] is None  # role chunk not counted
    assert res["routes"].keys() == {"-"}


def test_failures_are_recorded_and_end_their_session():
    script = StandInScript(ttft_per_token_s=1e-5, itl_s=0.001, fail_every=3)
    res, srv = run_bench(script, input_len="fixed:40", output_len="fixed:3", num_sessions=2, turns=4,
                         concurrency=1)
    reqs = res["requests"]
    # closed loop, one worker: requests 1, 2 ok, 3 fails (ends session 0); session 1: 4, 5 ok, 6 fails
    assert [(r["session"], r["turn"], r["ok"]) for r in reqs] == [
        (0, 0, True), (0, 1, True), (0, 2, False), (1, 0, True), (1, 1, True), (1, 2, False)]
    assert all(r["error"].startswith("HTTP 500") for r in reqs if not r["ok"])
    assert res["summary"]["errors"] == 2 and res["summary"]["slo_attainment"] == pytest.approx(4 / 6)


def test_multi_turn_prompts_grow_and_respect_think_time():
    res, srv = run_bench(StandInScript(ttft_per_token_s=1e-5, itl_s=0.001), input_len="fixed:40",
                         output_len="fixed:3", followup_len="fixed:10", num_sessions=1, turns=3,
                         think_time=0.05, concurrency=1, block_size=8)
    reqs = res["requests"]
    prompts = [b["prompt"] for b in srv.bodies]
    assert [len(p.split()) for p in prompts] == [40, 53, 66]
    assert prompts[1].startswith(prompts[0]) and prompts[2].startswith(prompts[1])
    for a, b in zip(reqs, reqs[1:]):
        assert b["send_s"] >= a["send_s"] + a["e2e_s"] + 0.05 - EARLY


def test_request_cap_and_warmup():
    res, srv = run_bench(SCRIPT, input_len="fixed:20", output_len="fixed:2", num_sessions=20, concurrency=2,
                         max_requests=5, warmup=3)
    assert len(res["requests"]) == 5 and res["stopped_by"] == "max_requests"
    assert len(srv.bodies) == 8 and res["warmup"] == {"requests": 3, "errors": 0}
    warm, measured = {b["prompt"] for b in srv.bodies[:3]}, {b["prompt"] for b in srv.bodies[3:]}
    assert warm.isdisjoint(measured)


def test_duration_cap_and_drain_cancel_slow_requests():
    slow = StandInScript(ttft_per_token_s=1e-5, itl_s=1.0)  # 50 tokens would take ~50 s
    t = time.perf_counter()
    res, srv = run_bench(slow, input_len="fixed:10", output_len="fixed:50", num_sessions=100,
                         arrival="uniform", rate=20, max_duration=0.3, drain_timeout=0.2)
    assert time.perf_counter() - t < 10  # not the ~50 s the streams would take
    reqs = res["requests"]
    # sessions start at 0, 0.05, ..., 0.25 s before the 0.3 s deadline: at most 6 are sent, fewer only
    # when a stalled event loop wakes up past the deadline; the first is sent before any await
    assert res["stopped_by"] == "max_duration" and 1 <= len(reqs) <= 6
    assert all(not r["ok"] and r["error"].startswith("cancelled") for r in reqs)


@pytest.mark.parametrize("msg, is_token", [
    ({"choices": [{"index": 0, "text": "abc", "finish_reason": None}]}, True),
    ({"choices": [{"index": 0, "text": "", "finish_reason": None}]}, True),  # SGLang: incomplete UTF-8
    ({"choices": [{"index": 0, "text": "", "finish_reason": "length"}]}, False),
    ({"choices": [{"index": 0, "text": "x", "finish_reason": "length"}]}, True),
    ({"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]}, False),
    ({"choices": [{"index": 0, "delta": {"role": "assistant", "content": "hi"}}]}, True),
    ({"choices": [{"index": 0, "delta": {"content": "hi"}, "finish_reason": None}]}, True),
    ({"choices": [{"index": 0, "delta": {"reasoning_content": "hm"}, "finish_reason": None}]}, True),
    ({"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]}, False),
    ({"choices": [], "usage": {"completion_tokens": 3}}, False),
])
def test_token_chunk_classification(msg, is_token):
    from prfaas_sgl.tools.loadgen.client import is_token_chunk

    assert is_token_chunk(msg) is is_token
