"""Router decode cache affinity over real CPU SGLang servers: a PrfaaS prefill (`prfaas_hybrid`) and two
decode servers with the decode-side prefix cache (`prfaas_hybrid` + --disaggregation-decode-enable-radix-cache),
prfaas_zmq between them, the router in-process with --decode-affinity-slack 1.

Two conversations start at once (one lands on each decode); their second turns, sent one after the other,
must each land on the decode that served the first turn: decode reports the first turn's KV as cached (a
decode hit, past the prefill's own checkpoint hit), and every output equals a colocated server without prefix
caching. Without affinity both second turns would go to decode0 (least loaded, ties by name), and the
conversation that started on decode1 would miss (PRFAAS_TEST_DECODE_SLACK=-1 runs this file with affinity
off: it then fails, cached_tokens [192, 0]).
"""
from __future__ import annotations

import os
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from prfaas_sgl.tools.launch import free_port
from prfaas_sgl.router.config import InstanceSpec, RouterConfig

from .conftest import HYBRID, farm_for, spec
from .live_router import running_router
from .pd import generate_body, post
from .prompts import prompt_ids

pytestmark = [pytest.mark.sglang, pytest.mark.timeout(900)]
GRID = 64  # prefill chunk = its state checkpoint grid
BS = 16  # decode cache block = the router's prefix block
NEW = 8
ZMQ = ("--prfaas-zmq-timeout-s", "120")
DECODE_CACHE = ZMQ + ("--radix-cache-backend", "prfaas_hybrid", "--disaggregation-decode-enable-radix-cache")


def _specs(log_dir):
    decode = dict(mode="decode", transfer_backend="prfaas_zmq", max_running_requests=1, extra_args=DECODE_CACHE)
    return {
        "prfaas": spec(log_dir, "dc_prfaas", HYBRID, mode="prefill", transfer_backend="prfaas_zmq",
                       bootstrap_port=free_port(), chunked_prefill_size=GRID,
                       extra_args=ZMQ + ("--radix-cache-backend", "prfaas_hybrid")),
        "decode0": spec(log_dir, "dc_decode0", HYBRID, **decode),
        "decode1": spec(log_dir, "dc_decode1", HYBRID, **decode),
        "colocated": spec(log_dir, "dc_colocated", HYBRID, chunked_prefill_size=GRID, max_running_requests=1,
                          extra_args=("--disable-radix-cache",)),
    }


farm = farm_for(_specs, shared=("colocated",))  # the same reference as test_cachepool_pd.py


@pytest.fixture(scope="module")
def router_url(farm, model_paths):
    def inst(name: str) -> InstanceSpec:
        s = farm[name].spec
        return InstanceSpec(s.url, bootstrap_port=s.bootstrap_port, name=name)

    cfg = RouterConfig(port=0, prfaas=(inst("prfaas"),), decode=(inst("decode0"), inst("decode1")),
                       tokenizer_path=model_paths["hybrid"], served_model_name="tiny", context_length=8192,
                       policy="all_remote", block_size=BS, decode_affinity_slack=int(os.environ.get("PRFAAS_TEST_DECODE_SLACK", "1")), health_interval_s=60,
                       prefill_timeout_s=300, request_timeout_s=300)
    with running_router(cfg) as (handle, _):
        yield handle.url


def _staggered(url: str, prompts: list[list[int]], gap_s: float = 0.05) -> list[dict]:
    """Send each prompt `gap_s` after the previous one, all in flight together: the router has routed
    the first (in flight on decode0) when the second arrives, so the second goes to decode1."""
    def send(i: int) -> dict:
        time.sleep(i * gap_s)
        return post(url + "/generate", generate_body(prompts[i], NEW))

    with ThreadPoolExecutor(len(prompts)) as ex:
        outs = list(ex.map(send, range(len(prompts))))
    for o in outs:
        assert "output_ids" in o, o
    return outs


def test_second_turns_land_on_the_decode_holding_their_first_turn(farm, router_url, model_paths):
    path = model_paths["hybrid"]
    # conversation A starts on decode0, B on decode1; A's first turn is the shorter, so decode0 holds less
    firsts = [prompt_ids(path, 250, seed=41), prompt_ids(path, 400, seed=42)]
    outs1 = _staggered(router_url, firsts)
    seconds = [f + o["output_ids"] + prompt_ids(path, 30, seed=50 + i) for i, (f, o) in enumerate(zip(firsts, outs1))]
    # B's second turn first, alone: least loaded (and ties by name) would say decode0, the wrong one
    outs2 = [post(router_url + "/generate", generate_body(seconds[i], NEW)) for i in (1, 0)][::-1]
    colocated = lambda ids: post(farm["colocated"].url + "/generate", generate_body(ids, NEW))["output_ids"]  # noqa: E731
    for ids, o in zip(firsts + seconds, outs1 + outs2):
        assert o["output_ids"] == colocated(ids)
    # the decode that served turn 1 holds its committed KV (len + 8 - 1 tokens) in 16-token blocks, more
    # than the prefill's own hit (its last 64-token checkpoint: 192 and 384): the decode hit is what shows
    decode_hits = [(len(f) + NEW - 1) // BS * BS for f in firsts]
    assert decode_hits == [256, 400]
    assert [o["meta_info"]["cached_tokens"] for o in outs2] == decode_hits
