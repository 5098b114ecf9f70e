"""End-to-end HTTP tests: the router in front of in-process stand-in prefill/decode servers."""

from __future__ import annotations

import asyncio
import contextlib
import json
from dataclasses import dataclass
from typing import AsyncIterator

import aiohttp
import pytest

from prfaas_sgl.router.app import RouterHandle, start_router
from prfaas_sgl.router.config import InstanceSpec, RouterConfig
from prfaas_sgl.router.controller_api import ControllerUpdate
from prfaas_sgl.router.requests import parse_raw
from tests.support.router_standin import RoomBoard, Standin, build_tiny_tokenizer
from tests.support.scripted_controller import Recommends

pytestmark = pytest.mark.timeout(60)

LONG = "prefill as a service moves long prompts " * 20  # > threshold below: goes to PrfaaS
SHORT = "hello world"


@dataclass
class Rig:
    router: RouterHandle
    remote: Standin
    local: Standin
    decode: Standin
    http: aiohttp.ClientSession

    async def post(self, path: str, body: object) -> tuple[int, dict]:
        data = body if isinstance(body, (bytes, str)) else json.dumps(body)
        async with self.http.post(self.router.url + path, data=data, headers={"Content-Type": "application/json"}) as r:
            return r.status, await r.json(content_type=None)


@contextlib.asynccontextmanager
async def rig(tmp_path, standin: type[Standin] = Standin, **cfg_kw) -> AsyncIterator[Rig]:
    """Router + stand-ins (``standin``: a Standin subclass for all three); ``cfg_kw`` override RouterConfig."""
    board = RoomBoard()
    remote, local = standin("prefill", board, kv_wait_s=5), standin("prefill", board, kv_wait_s=5)
    decode = standin("decode", board, kv_wait_s=5)
    for s in (remote, local, decode):
        await s.start()
    kw = dict(port=0, prfaas=(InstanceSpec(remote.url, 8998),), local_prefill=(InstanceSpec(local.url, 8999),),
              decode=(InstanceSpec(decode.url),), tokenizer_path=build_tiny_tokenizer(str(tmp_path / "tok")),
              served_model_name="tiny", context_length=2048, policy="threshold", threshold=32, block_size=4,
              prefill_timeout_s=5, request_timeout_s=10)
    cfg = RouterConfig.from_flags(**{**kw, **cfg_kw})
    handle = await start_router(cfg, seed=0)
    http = aiohttp.ClientSession()
    try:
        yield Rig(handle, remote, local, decode, http)
    finally:
        await http.close()
        await handle.close()
        for s in (remote, local, decode):
            await s.close()


def run(coro) -> None:
    asyncio.run(coro)


def test_long_chat_goes_remote_with_same_body_and_bootstrap_fields(tmp_path):
    async def body():
        async with rig(tmp_path) as r:
            req = {"model": "tiny", "messages": [{"role": "user", "content": LONG}], "max_tokens": 4}
            status, out = await r.post("/v1/chat/completions", req)
            assert status == 200 and out["choices"][0]["message"]["content"] == "t0 t1 t2 t3 "
            assert len(r.remote.received) == 1 and r.local.received == []
            pre, dec = r.remote.received[0], r.decode.received[0]
            assert pre == dec
            assert pre["bootstrap_host"] == "127.0.0.1" and pre["bootstrap_port"] == 8998
            assert 0 <= pre["bootstrap_room"] < 2**63
            assert {k: v for k, v in pre.items() if not k.startswith("bootstrap_") and k != "rid"} == req
    run(body())


def test_short_completion_stays_local_and_streams(tmp_path):
    async def body():
        async with rig(tmp_path) as r:
            req = {"model": "tiny", "prompt": SHORT, "max_tokens": 4, "stream": True}
            async with r.http.post(r.router.url + "/v1/completions", json=req) as resp:
                assert resp.status == 200 and resp.headers["Content-Type"].startswith("text/event-stream")
                raw = (await resp.read()).decode()
            events = [line[6:] for line in raw.split("\n") if line.startswith("data: ")]
            assert events[-1] == "[DONE]"
            assert [json.loads(e)["choices"][0]["text"] for e in events[:-1]] == ["t0 ", "t1 ", "t2 ", "t3 "]
            assert r.local.received[0]["bootstrap_port"] == 8999 and r.remote.received == []
    run(body())


def test_generate_native_endpoint(tmp_path):
    async def body():
        async with rig(tmp_path) as r:
            status, out = await r.post("/generate", {"text": SHORT, "sampling_params": {"max_new_tokens": 2}})
            assert status == 200 and out["text"] == "t0 t1 t2 t3 "
            status, out = await r.post("/generate", {"input_ids": list(range(100)),
                                                     "sampling_params": {"max_new_tokens": 2}})
            assert status == 200 and len(r.remote.received) == 1  # 100 uncached tokens > t=32
    run(body())


@pytest.mark.parametrize("fail", ["http500", "drop"])
def test_remote_prefill_failure_is_retried_locally(tmp_path, fail):
    async def body():
        async with rig(tmp_path) as r:
            r.remote.fail = fail
            req = {"model": "tiny", "prompt": LONG, "max_tokens": 4}
            status, out = await r.post("/v1/completions", req)
            assert status == 200 and out["choices"][0]["text"] == "t0 t1 t2 t3 "
            assert len(r.remote.received) == 1 and len(r.local.received) == 1
            assert len(r.decode.received) == 2
            assert r.decode.received[1]["bootstrap_room"] == r.local.received[0]["bootstrap_room"]
            assert r.decode.received[0]["bootstrap_room"] != r.decode.received[1]["bootstrap_room"]
            assert not r.router.router.cluster.instances["prfaas0"].healthy  # out of rotation
            metrics = await (await r.http.get(r.router.url + "/metrics")).text()
            assert 'prfaas_router_retries_total{reason="long"} 1.0' in metrics
            r.remote.fail = "none"
            await asyncio.sleep(0)  # health comes back through /health, not by itself
            from prfaas_sgl.router.cluster import check_health
            await check_health(r.router.router.cluster, r.router.router.session)
            assert r.router.router.cluster.instances["prfaas0"].healthy
    run(body())


def test_both_attempts_fail_gives_openai_error_not_hang(tmp_path):
    async def body():
        async with rig(tmp_path) as r:
            r.remote.fail = r.local.fail = "http500"
            status, out = await r.post("/v1/completions", {"model": "tiny", "prompt": LONG, "max_tokens": 4})
            assert status == 502 and out["error"]["code"] == "upstream_failed"
            assert set(out["error"]) == {"message", "type", "code"}
    run(body())


BAD_REQUESTS = [
    ("/v1/completions", b"{not json", 400, "invalid_json"),
    ("/v1/completions", {"prompt": SHORT}, 400, "missing_field"),
    ("/v1/chat/completions", {"model": "tiny"}, 400, "missing_field"),
    ("/v1/completions", {"model": "gpt-9", "prompt": SHORT}, 404, "model_not_found"),
    ("/v1/completions", {"model": "tiny", "prompt": SHORT, "max_tokens": 0}, 400, "invalid_value"),
    ("/v1/chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": "x"}], "max_tokens": -3},
     400, "invalid_value"),
    ("/v1/completions", {"model": "tiny", "prompt": [5] * 3000, "max_tokens": 1}, 400,
     "context_length_exceeded"),
    ("/v1/completions", {"model": "tiny", "prompt": [[1, 2], [3]]}, 400, "invalid_request_error"),
]


def test_bad_input_gets_4xx_and_router_stays_up(tmp_path):
    async def body():
        async with rig(tmp_path) as r:
            for path, req, want_status, want_code in BAD_REQUESTS:
                status, out = await r.post(path, req)
                assert (status, out["error"]["code"]) == (want_status, want_code), (path, req)
                assert set(out["error"]) == {"message", "type", "code"}
            assert r.remote.received == r.local.received == r.decode.received == []
            status, out = await r.post("/v1/completions", {"model": "tiny", "prompt": SHORT})
            assert status == 200
    run(body())


def test_models_health_admin(tmp_path):
    async def body():
        async with rig(tmp_path) as r:
            async with r.http.get(r.router.url + "/v1/models") as resp:
                assert (await resp.json())["data"][0]["id"] == "tiny"
            async with r.http.get(r.router.url + "/health") as resp:
                assert resp.status == 200
            status, out = await r.post("/admin/routing", {"threshold": 10_000, "policy": "bandwidth_aware"})
            assert status == 200 and out["threshold"] == 10_000 and out["policy"] == "bandwidth_aware"
            status, _ = await r.post("/v1/completions", {"model": "tiny", "prompt": LONG, "max_tokens": 1})
            assert status == 200 and r.remote.received == [] and len(r.local.received) == 1
            status, out = await r.post("/admin/routing", {"low_watermark": 2.0})
            assert status == 400 and "low_watermark" in out["error"]["message"]
            async with r.http.get(r.router.url + "/metrics") as resp:
                text = await resp.text()
            assert "prfaas_router_threshold_tokens 10000.0" in text
            assert 'prfaas_router_decisions_total{reason="short",route="local"} 1.0' in text
    run(body())


def test_openai_client_streams_chat(tmp_path):
    openai = pytest.importorskip("openai", reason="test dependency 'openai' missing")

    async def body():
        async with rig(tmp_path) as r:
            client = openai.AsyncOpenAI(base_url=r.router.url + "/v1", api_key="none", max_retries=0)
            stream = await client.chat.completions.create(
                model="tiny", messages=[{"role": "user", "content": LONG}], max_tokens=4, stream=True)
            text = "".join([c.choices[0].delta.content or "" async for c in stream])
            assert text == "t0 t1 t2 t3 "
            assert len(r.remote.received) == 1
            with pytest.raises(openai.NotFoundError):
                await client.completions.create(model="nope", prompt="x", max_tokens=1)
            await client.close()
    run(body())


class FakeController(Recommends):
    """Recommends t = 7 and 2/5 once it has seen two requests."""

    def maybe_update(self, now: float) -> ControllerUpdate | None:
        return super().maybe_update(now) if len(self.seen) >= 2 else None


def test_controller_observes_and_moves_threshold(tmp_path, caplog):
    async def body():
        async with rig(tmp_path) as r:
            ctl = r.router.router.core.controller = FakeController((2, 5), threshold=7)
            core = r.router.router.core
            await r.post("/generate", {"input_ids": list(range(20)), "sampling_params": {"max_new_tokens": 1}})
            core.controller_tick(1.0)
            assert core.policy.threshold == 32  # not due yet
            await r.post("/generate", {"input_ids": list(range(50)), "sampling_params": {"max_new_tokens": 1}})
            caplog.set_level("INFO", logger="prfaas_sgl.router.routing")
            core.controller_tick(2.0)  # 2nd prompt reuses the 20 routed tokens on l0: 30 incremental
            assert ctl.seen == [20, 30] and core.policy.threshold == 7
            assert any("routing changed" in m and "converged" in m for m in caplog.messages)
            async with r.http.get(r.router.url + "/admin/routing") as resp:
                state = await resp.json()
            assert state["recommended_split"] == {"local_prefill": 2, "decode": 5} and state["threshold"] == 7
            async with r.http.get(r.router.url + "/metrics") as resp:
                assert 'prfaas_router_recommended_instances{role="decode"} 5.0' in await resp.text()
    run(body())


def test_planner_controller_builds_from_scenario(tmp_path):
    from pathlib import Path

    from prfaas_sgl.router.controller_glue import build_controller
    scenario = Path(__file__).resolve().parents[2] / "scenarios" / "paper_case_study.toml"
    cfg = RouterConfig.from_flags(local_prefill=("http://h:1;bootstrap=8998",), decode=("http://h:2",),
                       tokenizer_path=build_tiny_tokenizer(str(tmp_path / "tok")), controller="planner",
                       controller_scenario=str(scenario), threshold=19_000)
    ctl = build_controller(cfg)
    for i in range(200):
        ctl.observe(1000 + 300 * i, float(i))
    upd = ctl.maybe_update(1e6)
    assert upd is not None and upd.threshold > 0


def test_route_header_on_every_answer_and_link_bytes_released(tmp_path):
    async def body():
        async with rig(tmp_path) as r:
            async def route_of(prompt: str, stream: bool) -> str:
                req = {"model": "tiny", "prompt": prompt, "max_tokens": 2, "stream": stream}
                async with r.http.post(r.router.url + "/v1/completions", json=req) as resp:
                    assert resp.status == 200
                    await resp.read()
                    return resp.headers["x-prfaas-route"]

            assert [await route_of(LONG, s) for s in (False, True)] == ["prfaas", "prfaas"]
            assert [await route_of(SHORT, s) for s in (False, True)] == ["local", "local"]
            assert r.router.router.cluster.link.transfers == {}  # every remote attempt released its KV bytes
            r.remote.fail = "http500"  # the local retry answers: its header says so
            assert await route_of(LONG, False) == "local"
            async with r.http.post(r.router.url + "/v1/completions", data=b"{") as resp:
                assert resp.status == 400 and "x-prfaas-route" not in resp.headers  # not routed at all
    run(body())


@pytest.mark.parametrize("slack", [-1, 0])
def test_a_remote_prompt_not_cached_on_decode_puts_all_its_kv_on_the_link(tmp_path, slack):
    """With decode affinity on (slack >= 0) the router records each prompt in the chosen decode's prefix index.
    Before, it did so before counting the link's bytes, so every remote prompt looked cached on decode and its
    KV was left off the link's book (0 bytes here, no state bytes). Off (-1) it was always right."""
    async def body():
        async with rig(tmp_path, decode_affinity_slack=slack, kv_bytes_per_token=1000.0, state_bytes=0.0) as r:
            r.remote.delay_s = 1.0  # the attempt's bytes stay on the link's book while prefill runs
            raw = json.dumps({"model": "tiny", "prompt": LONG, "max_tokens": 2}).encode()
            router = r.router.router
            n = len(parse_raw("/v1/completions", raw, router.tokenizer, "tiny", router.limits).tokens)
            sent = asyncio.create_task(r.post("/v1/completions", raw))
            for _ in range(200):
                if router.cluster.link.transfers or sent.done():
                    break
                await asyncio.sleep(0.01)
            booked = [nbytes for _, nbytes in router.cluster.link.transfers.values()]
            status, _ = await sent
            assert status == 200 and len(r.remote.received) == 1
            assert booked == [1000.0 * n]
    run(body())
