"""SGLang's optimistic prefill (`--optimistic-prefill-attempts`) over prfaas_zmq on real servers (CPU, dense
Llama): the prefill computes a request whose decode has not bootstrapped yet and holds its KV in its own
pool; the decode that arrives later gets all of it (greedy tokens == HF), and a decode that never arrives
frees the held request once SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT passed (15 s here; 300 s by default),
leaving the prefill healthy. Past `--prfaas-optimistic-max-held-tokens` a request is not started ahead and
waits for its decode; /stats counts what is held (`optimistic`). Neither scheduler spins while it waits (idle_park): a decode waiting for its
KV and a prefill holding a request use a small fraction of the CPU a busy loop gets meanwhile."""
from __future__ import annotations

import json
import random
import re
import subprocess
import sys
import threading
import time
import urllib.request
from datetime import datetime
from pathlib import Path

import psutil
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
WINDOW_S = 3.0  # how long a waiting scheduler's CPU time is measured
# A parked scheduler wakes every idle_park.PARK_S for one loop pass; a spinning one gets what a busy loop
# gets, whatever the machine's load
MAX_SHARE_OF_SPINNER = 0.25
MAX_HELD_TOKENS = 1500  # one 1,100-token request held ahead of its decode, not two


def _specs(log_dir):
    return {
        "prefill": spec(log_dir, "optimistic_prefill", LLAMA, mode="prefill", transfer_backend="prfaas_zmq",
                        bootstrap_port=free_port(), chunked_prefill_size=512,
                        extra_args=("--optimistic-prefill-attempts", "1", "--prfaas-zmq-stats-port", str(free_port()),
                                    "--prfaas-optimistic-max-held-tokens", str(MAX_HELD_TOKENS)),
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


def _optimistic(prefill) -> dict:
    args = list(prefill.spec.extra_args)
    port = args[args.index("--prfaas-zmq-stats-port") + 1]
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/stats", timeout=10) as r:
        return json.loads(r.read())["optimistic"]


def _until_held(prefill, n: int, timeout_s: float = 60.0) -> dict:
    end = time.monotonic() + timeout_s
    while (snap := _optimistic(prefill))["held_requests"] != n and time.monotonic() < end:
        time.sleep(0.2)
    return snap


def test_past_the_held_token_cap_a_request_waits_for_its_decode(farm, model_paths):
    p, d = farm["prefill"], farm["decode"]
    refused = _optimistic(p)["refused_requests"]
    held_ids, late_ids = (prompt_ids(model_paths["llama"], n, seed=s) for n, s in ((1100, 8), (600, 9)))
    held, late = _pd_body(held_ids, p.spec.bootstrap_port), _pd_body(late_ids, p.spec.bootstrap_port)
    out: dict = {}
    threads = [threading.Thread(target=lambda k=k, b=b: out.update({k: post(p.url + "/generate", b, 120)}))
               for k, b in (("held", held), ("late", late))]
    threads[0].start()
    assert _until_held(p, 1)["held_tokens"] == 1100
    threads[1].start()
    time.sleep(3.0)  # SGLang would have computed the 600 tokens ahead by now
    snap = _optimistic(p)
    assert (snap["held_requests"], snap["held_tokens"], snap["refused_requests"]) == (1, 1100, refused + 1), snap
    assert snap["oldest_held_s"] >= 3.0 and snap["max_held_tokens"] == MAX_HELD_TOKENS
    for ids, body in ((late_ids, late), (held_ids, held)):
        got = post(d.url + "/generate", body, timeout=120)
        assert error_text(got) == "", got
        assert got["output_ids"] == hf_greedy(model_paths["llama"], ids, NEW)
    for t in threads:
        t.join(120)
    assert _until_held(p, 0)["held_tokens"] == 0


def _scheduler(server) -> psutil.Process:
    procs = [c for c in psutil.Process(server.proc.pid).children(recursive=True)
             if "scheduler" in " ".join(c.cmdline())]
    assert len(procs) == 1, procs
    return procs[0]


def _cpu_s(proc: psutil.Process) -> float:
    t = proc.cpu_times()
    return t.user + t.system


def _share_of_a_spinner(proc: psutil.Process, seconds: float = WINDOW_S) -> float:
    """`proc`'s CPU time over `seconds`, as a fraction of what a busy loop got over the same seconds."""
    spinner = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        spin = psutil.Process(spinner.pid)
        before = _cpu_s(proc), _cpu_s(spin)
        time.sleep(seconds)
        used, spun = _cpu_s(proc) - before[0], _cpu_s(spin) - before[1]
    finally:
        spinner.kill()
        spinner.wait()
    assert spun > 0.1 * seconds, spun  # the reference itself ran
    return used / spun


def test_a_decode_waiting_for_its_kv_does_not_spin(farm, model_paths):
    p, d = farm["prefill"], farm["decode"]
    ids = prompt_ids(model_paths["llama"], 600, seed=7)
    body = _pd_body(ids, p.spec.bootstrap_port)
    out: dict = {}
    t = threading.Thread(target=lambda: out.update(decode=post(d.url + "/generate", body, 120)))
    t.start()
    time.sleep(1.0)  # bootstrapped with the prefill; waiting for KV that only comes once the prefill is asked
    share = _share_of_a_spinner(_scheduler(d))
    got = post(p.url + "/generate", body, timeout=120)
    t.join(120)
    assert error_text(got) == "", got
    assert out["decode"]["output_ids"] == hf_greedy(model_paths["llama"], ids, NEW)
    assert share < MAX_SHARE_OF_SPINNER, f"the waiting decode used {share:.0%} of a busy loop's CPU"


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
    held: dict = {}  # the prefill's CPU while it holds the computed request (from 4 s on; 600 tokens take < 1 s)
    watch = threading.Timer(4.0, lambda: held.update(share=_share_of_a_spinner(_scheduler(p))))
    watch.start()
    out = post(p.url + "/generate", _pd_body(ids, p.spec.bootstrap_port), timeout=120)
    waited = time.monotonic() - started
    watch.join(30)
    assert error_text(out) != "", out
    share = held["share"]
    assert share < MAX_SHARE_OF_SPINNER, f"the holding prefill used {share:.0%} of a busy loop's CPU"
    assert BOOTSTRAP_TIMEOUT_S - 1 <= waited <= BOOTSTRAP_TIMEOUT_S + 15, (waited, out)
    assert healthy(p.url) and healthy(d.url)
    again = pd_generate(p.url, d.url, p.spec.bootstrap_port, generate_body(ids, NEW))
    assert again.get("output_ids") == hf_greedy(model_paths["llama"], ids, NEW), again
