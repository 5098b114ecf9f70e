"""prfaas_zmq data-plane faults on real SGLang (CPU), CURVE on: a decode server with a keys directory, a
prefill server with the authorized key that corrupts chunk CORRUPT_SEQ of every transfer (only long
prompts have that many chunks), and a prefill server whose client key is not authorized (it shares the
Register secret and trusts the decode's server key, so the refusal comes from the CURVE handshake)."""
from __future__ import annotations

import shutil

import pytest

from prfaas_sgl.srt.backend.settings import FAULTS_ENV
from prfaas_sgl.tools.launch import free_port
from prfaas_sgl.transfer.security import generate_keys

from .conftest import LLAMA, farm_for, spec
from .pd import generate_body, pd_generate
from .prompts import prompt_ids
from .reference import hf_greedy
from .test_prfaas_zmq import error_text, healthy

pytestmark = pytest.mark.sglang
NEW = 8
CHUNK_BYTES = 4096  # Llama: 128 B per page and K/V buffer → 32 pages per chunk
CORRUPT_SEQ = 100  # a 300-token request sends ~50 chunks, a 2,000-token one ~260


def _specs(log_dir):
    good, other = log_dir / "keys", log_dir / "other-keys"
    generate_keys(str(good))
    generate_keys(str(other))  # a client key pair decode never authorized
    for name in ("server.key", "register.secret"):
        shutil.copy(good / name, other / name)

    def prefill(name: str, keys, env=None):
        return spec(log_dir, name, LLAMA, mode="prefill", transfer_backend="prfaas_zmq",
                    bootstrap_port=free_port(), chunked_prefill_size=512, env=env or {},
                    extra_args=("--prfaas-zmq-curve-keys", str(keys), "--prfaas-zmq-chunk-bytes", str(CHUNK_BYTES)))

    return {
        "decode": spec(log_dir, "curve_decode", LLAMA, mode="decode", transfer_backend="prfaas_zmq",
                       extra_args=("--prfaas-zmq-curve-keys", str(good))),
        "corrupting": prefill("curve_prefill_corrupting", good, {FAULTS_ENV: f"corrupt_chunk={CORRUPT_SEQ}"}),
        "intruder": prefill("curve_prefill_intruder", other),
    }


farm = farm_for(_specs)


def _pd(prefill, decode, ids):
    return pd_generate(prefill.url, decode.url, prefill.spec.bootstrap_port, generate_body(ids, NEW), timeout=180)


def test_curve_transfer_with_authorized_key(farm, model_paths):
    ids = prompt_ids(model_paths["llama"], 300, seed=11)
    out = _pd(farm["corrupting"], farm["decode"], ids)
    assert error_text(out) == "", out
    assert out["output_ids"] == hf_greedy(model_paths["llama"], ids, NEW)


def test_corrupted_chunk_is_rejected(farm, model_paths):
    ids = prompt_ids(model_paths["llama"], 2000, seed=12)
    out = _pd(farm["corrupting"], farm["decode"], ids)
    assert f"checksum mismatch in chunk {CORRUPT_SEQ}" in error_text(out), out
    assert healthy(farm["decode"].url) and healthy(farm["corrupting"].url)


def test_unauthorized_sender_cannot_deliver(farm, model_paths):
    ids = prompt_ids(model_paths["llama"], 300, seed=13)
    out = _pd(farm["intruder"], farm["decode"], ids)
    assert "CURVE" in error_text(out), out
    assert "output_ids" not in out or not out.get("output_ids"), out
    # the decode server is unharmed: the authorized prefill still delivers
    out = _pd(farm["corrupting"], farm["decode"], ids)
    assert out["output_ids"] == hf_greedy(model_paths["llama"], ids, NEW)


def test_forged_register_is_refused_and_servers_stay_up(farm, model_paths):
    """Issue 12 H1 on a real prefill: anyone who reads the bootstrap /route may write to the prefill's
    control socket. Unsigned and wrongly signed Registers, and garbage, are refused with a named reason;
    the authorized decode keeps receiving correct KV."""
    import json
    import time
    import urllib.request

    import zmq

    from prfaas_sgl.srt.backend import control
    from prfaas_sgl.transfer.layout import MemoryLayout
    from prfaas_sgl.transfer.security import server_public_key

    prefill = farm["corrupting"]
    url = (f"http://127.0.0.1:{prefill.spec.bootstrap_port}/route?prefill_dp_rank=0&prefill_cp_rank=0"
           "&target_tp_rank=0&target_pp_rank=0")
    with urllib.request.urlopen(url, timeout=10) as r:
        rank = json.loads(r.read())
    keys = prefill.spec.extra_args[prefill.spec.extra_args.index("--prfaas-zmq-curve-keys") + 1]
    forged = control.Register(endpoint="127.0.0.1", dst_port=1, data_host="127.0.0.1", data_port=2,
                              server_key=server_public_key(keys), layout=MemoryLayout(()), page_size=1,
                              attn_tp_size=1, tp_rank=0)
    ctx = zmq.Context()
    push = ctx.socket(zmq.PUSH)
    push.connect(f"tcp://{rank['rank_ip']}:{rank['rank_port']}")
    try:
        for frames in (control.encode(forged), control.encode(forged, b"g" * 64), [control.TAG, b"\xc1junk"]):
            push.send_multipart(frames)
        time.sleep(1.0)
    finally:
        push.close(linger=1000)
        ctx.term()
    log = open(prefill.spec.log_path).read()
    assert "refused Register from decode 127.0.0.1:1 (unsigned" in log
    assert "refused Register from decode 127.0.0.1:1 (bad_mac" in log
    ids = prompt_ids(model_paths["llama"], 300, seed=14)
    out = _pd(prefill, farm["decode"], ids)
    assert out["output_ids"] == hf_greedy(model_paths["llama"], ids, NEW)
    assert healthy(prefill.url) and healthy(farm["decode"].url)
