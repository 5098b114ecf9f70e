"""prfaas_zmq PD on real SGLang (CPU), dense Llama: decode output == HF greedy for 10..4,000-token prompts
with chunked prefill 512; a prefill server with another page size is refused with a reason naming the
mismatch, and both servers stay up."""
from __future__ import annotations

import random
import threading
import time

import pytest

from prfaas_sgl.tools.launch import free_port

from .conftest import LLAMA, farm_for, spec
from .pd import generate_body, pd_generate, post
from .prompts import prompt_ids
from .reference import hf_greedy
from .test_prfaas_zmq import error_text, healthy

pytestmark = pytest.mark.sglang
NEW = 8
CHUNK = 512
LENGTHS = (10, 700, 4100)


def _prefill(log_dir, name: str, **kw):
    return spec(log_dir, name, LLAMA, mode="prefill", transfer_backend="prfaas_zmq", bootstrap_port=free_port(),
                chunked_prefill_size=CHUNK, **kw)


def _specs(log_dir):
    return {
        "prefill": _prefill(log_dir, "dense_prefill"),
        # Another page size; a short bootstrap timeout so its orphaned request ends soon.
        "prefill_p16": _prefill(log_dir, "dense_prefill_p16", page_size=16,
                                env={"SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT": "30"}),
        "decode": spec(log_dir, "dense_decode", LLAMA, mode="decode", transfer_backend="prfaas_zmq"),
    }


farm = farm_for(_specs)


@pytest.mark.parametrize("length", LENGTHS)
def test_dense_pd_matches_hf_greedy(farm, model_paths, length):
    ids = prompt_ids(model_paths["llama"], length, seed=length)
    p = farm["prefill"]
    out = pd_generate(p.url, farm["decode"].url, p.spec.bootstrap_port, generate_body(ids, NEW))
    assert error_text(out) == "", out
    assert out["output_ids"] == hf_greedy(model_paths["llama"], ids, NEW)


def test_page_size_mismatch_fails_with_reason(farm, model_paths):
    bad, decode = farm["prefill_p16"], farm["decode"]
    ids = prompt_ids(model_paths["llama"], 300, seed=3)
    body = {**generate_body(ids, NEW), "bootstrap_host": "127.0.0.1", "bootstrap_port": bad.spec.bootstrap_port,
            "bootstrap_room": random.getrandbits(63)}
    # The prefill half is orphaned (decode never sends it metadata): do not wait for it.
    threading.Thread(target=post, args=(bad.url + "/generate", body, 120), daemon=True).start()
    started = time.monotonic()
    out = post(decode.url + "/generate", body, timeout=120)
    assert time.monotonic() - started < 90
    assert "page size mismatch" in error_text(out).lower(), out
    assert "page_size=16" in error_text(out), out
    assert healthy(decode.url) and healthy(bad.url)
    # decode still serves a compatible prefill server
    good = farm["prefill"]
    out = pd_generate(good.url, decode.url, good.spec.bootstrap_port, generate_body(ids, NEW))
    assert out["output_ids"] == hf_greedy(model_paths["llama"], ids, NEW)
