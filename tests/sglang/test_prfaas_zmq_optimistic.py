"""SGLang's optimistic prefill (`--optimistic-prefill-attempts`) over prfaas_zmq on real servers (CPU, dense
Llama): the prefill computes a request whose decode has not bootstrapped yet and holds its KV in its own
pool; the decode that arrives later gets all of it (greedy tokens == HF), and a decode that never arrives
frees the held request once SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT passed (15 s here; 300 s by default),
leaving the prefill healthy."""
from __future__ import annotations

import random
import re
import threading
import time
from datetime import datetime
from pathlib import Path

import pytest

from prfaas_sgl.tools.launch import free_port

from .conftest import LLAMA, farm_for, spec
from .pd import generate_body, pd_generate, post
from .prompts import prompt_ids
from .reference import hf_greedy
from .test_prfaas_zmq import error_text, healthy

pytestmark = pytest.mark.sglang
NEW = 8
BOOTSTRAP_TIMEOUT_S = 15
HELD_S = 4.0  # the decode's half comes this long after the prefill's: the prefill is done by then


def _specs(log_dir):
    return {
        "prefill": spec(log_dir, "optimistic_prefill", LLAMA, mode="prefill", transfer_backend="prfaas_zmq",
                        bootstrap_port=free_port(), chunked_prefill_size=512,
                        extra_args=("--optimistic-prefill-attempts", "1"),
                        env={"SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT": str(BOOTSTRAP_TIMEOUT_S)}),
        "decode": spec(log_dir, "optimistic_decode", LLAMA, mode="decode", transfer_backend="prfaas_zmq"),
    }


farm = farm_for(_specs)


def _pd_body(ids: list[int], port: int) -> dict:
    return {**generate_body(ids, NEW), "bootstrap_host": "127.0.0.1", "bootstrap_port": port,
            "bootstrap_room": random.getrandbits(63)}


def _prefill_batches_before(log_path: str, t: float) -> int:
    """SGLang's 'Prefill batch' log lines stamped (whole seconds) before `t`."""
    stamps = re.findall(r"\[(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d)[^\]]*\] Prefill batch", Path(log_path).read_text())
    return sum(datetime.strptime(s, "%Y-%m-%d %H:%M:%S").timestamp() < int(t) for s in stamps)


def test_a_decode_that_arrives_after_the_prefill_finished_gets_the_held_kv(farm, model_paths):
    p, d = farm["prefill"], farm["decode"]
    ids = prompt_ids(model_paths["llama"], 1100, seed=5)
    body = _pd_body(ids, p.spec.bootstrap_port)
    before = _prefill_batches_before(p.spec.log_path, time.time())
    out: dict = {}
    t = threading.Thread(target=lambda: out.update(prefill=post(p.url + "/generate", body, 120)))
    t.start()
    time.sleep(HELD_S)
    decode_sent = time.time()
    got = post(d.url + "/generate", body, timeout=120)
    t.join(120)
    assert error_text(got) == "", got
    assert got["output_ids"] == hf_greedy(model_paths["llama"], ids, NEW)
    assert _prefill_batches_before(p.spec.log_path, decode_sent) > before, "the prefill waited for the decode"


def test_a_decode_that_never_arrives_frees_the_held_request_within_the_bootstrap_timeout(farm, model_paths):
    p, d = farm["prefill"], farm["decode"]
    ids = prompt_ids(model_paths["llama"], 600, seed=6)
    started = time.monotonic()
    out = post(p.url + "/generate", _pd_body(ids, p.spec.bootstrap_port), timeout=120)
    waited = time.monotonic() - started
    assert error_text(out) != "", out
    assert BOOTSTRAP_TIMEOUT_S - 1 <= waited <= BOOTSTRAP_TIMEOUT_S + 15, (waited, out)
    assert healthy(p.url) and healthy(d.url)
    again = pd_generate(p.url, d.url, p.spec.bootstrap_port, generate_body(ids, NEW))
    assert again.get("output_ids") == hf_greedy(model_paths["llama"], ids, NEW), again
