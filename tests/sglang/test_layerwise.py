"""Layer-group streaming over prfaas_zmq on real SGLang servers (CPU), one PD pair per dense Llama and GDN
family (the check: layerwise.py), checked against the session's shared colocated reference of the model
(conftest.reference_spec, chunk 64). KDA + MLA and SWA + GQA run the same check in test_families.py, on a
layer-wise prefill added to their family farm."""
from __future__ import annotations

import pytest

from prfaas_sgl.tools.launch import free_port
from prfaas_sgl.tools.models.tiny import ensure

from .conftest import HYBRID, LLAMA, Farm, forked, reference_spec, spec
from .layerwise import ZMQ, check_layerwise, prefill_spec

pytestmark = pytest.mark.sglang
PAGE = 1


def _specs(log_dir, model: str, stats: int) -> dict:
    return {
        "colocated": reference_spec(log_dir, model),
        "prefill": prefill_spec(log_dir, f"lw_{model}_prefill", model, PAGE, stats),
        "decode": spec(log_dir, f"lw_{model}_decode", model, mode="decode", transfer_backend="prfaas_zmq",
                       max_running_requests=1, page_size=PAGE, extra_args=ZMQ),
    }


@pytest.fixture(scope="module", params=[LLAMA, HYBRID])
def family(request, log_dir, shared_servers):
    stats = free_port()
    farm = Farm(_specs(log_dir, request.param, stats), ("colocated",), shared_servers, forked(request)).start()
    try:
        yield request.param, str(ensure(request.param)), farm, f"http://127.0.0.1:{stats}/stats"
    finally:
        farm.stop()


def test_layerwise_pd_matches_colocated_and_streams_only_long_prompts(family):
    name, path, farm, stats_url = family
    check_layerwise(name, path, farm["prefill"], farm["decode"], farm["colocated"], stats_url, PAGE)
