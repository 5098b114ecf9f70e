"""Real SGLang on CPU: colocated greedy == HF greedy; mooncake_tcp PD == colocated (hybrid model). The colocated
servers are the session's shared references (conftest.reference_spec: batch 1, chunk 64, prefix caching off),
started by an earlier module."""
from __future__ import annotations

import pytest

from prfaas_sgl.tools.launch import free_port

from .conftest import HYBRID, LLAMA, farm_for, reference_spec, spec
from .pd import generate_body, pd_generate, post
from .prompts import prompt_ids
from .reference import hf_greedy

pytestmark = pytest.mark.sglang
NEW = 16
LENGTHS = (12, 300, 1600)  # one prompt >= 1,500 tokens (several chunked-prefill chunks in PD)
CHUNK = 512  # chunked prefill smaller than the long prompts, so PD sends several chunks


def _specs(log_dir):
    boot = free_port()
    return {
        "llama": reference_spec(log_dir, LLAMA),
        "hybrid": reference_spec(log_dir, HYBRID),
        "hybrid_mc_prefill": spec(log_dir, "hybrid_mc_prefill", HYBRID, mode="prefill",
                                  transfer_backend="mooncake", bootstrap_port=boot, chunked_prefill_size=CHUNK),
        "hybrid_mc_decode": spec(log_dir, "hybrid_mc_decode", HYBRID, mode="decode", transfer_backend="mooncake"),
    }


farm = farm_for(_specs, shared=("llama", "hybrid"))


@pytest.mark.parametrize("model", ["llama", "hybrid"])
@pytest.mark.parametrize("length", LENGTHS)
def test_colocated_matches_hf(farm, model_paths, model, length):
    ids = prompt_ids(model_paths[model], length, seed=length)
    out = post(farm[model].url + "/generate", generate_body(ids, NEW))
    assert out["meta_info"]["prompt_tokens"] == length
    assert out["output_ids"] == hf_greedy(model_paths[model], ids, NEW)


@pytest.mark.parametrize("length", LENGTHS)
def test_mooncake_tcp_pd_matches_colocated(farm, model_paths, length):
    ids = prompt_ids(model_paths["hybrid"], length, seed=length)
    body = generate_body(ids, NEW)
    colocated = post(farm["hybrid"].url + "/generate", body)
    boot = farm["hybrid_mc_prefill"].spec.bootstrap_port
    pd = pd_generate(farm["hybrid_mc_prefill"].url, farm["hybrid_mc_decode"].url, boot, body)
    assert "output_ids" in pd, pd
    assert pd["output_ids"] == colocated["output_ids"]
