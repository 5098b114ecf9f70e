"""The demo's default workload and link put its planner in the paper's regime on the PD-pair profile the demo
measured (2026-11-27 07:12-07:14 UTC, out/demo-profile.pd.json; numbers rounded here): naive bound by the
link while the local prefill idles, PrfaaS ahead of naive and of both homogeneous baselines, the decode
not binding. The real-server run is `make demo`."""
from __future__ import annotations

import pytest

from prfaas_sgl.router.planner import stages
from prfaas_sgl.tools.demo import __main__ as demo
from prfaas_sgl.tools.demo import plan

TOKENS = [32, 256, 1024]
WIRE = [51776.0, 166464.0, 559680.0]
MEASURED = {  # the pair's measurement: wall s/request, prefill CPU s/request, decode receive CPU s/request
    "prfaas": {"kind": "H200", "role": "prefill", "cores": 0.7, "tokens": TOKENS,
               "s_per_request": [0.0825, 0.1488, 0.3342], "prefill_cpu_s": [0.035, 0.0675, 0.18],
               "decode_recv_cpu_s": [0.0175, 0.0255, 0.0375], "wire_bytes": WIRE},
    "local_prefill": {"kind": "H20", "role": "prefill", "cores": 0.105, "tokens": TOKENS,
                      "s_per_request": [0.2814, 0.7156, 2.3491], "prefill_cpu_s": [0.03, 0.0775, 0.245],
                      "decode_recv_cpu_s": [0.0216, 0.061, 0.162], "wire_bytes": WIRE},
    "decode": {"kind": "H20", "role": "decode", "cores": 0.583, "batch": 8, "step_s": 0.0551},
}


def _predict(argv: list[str]):
    sys_ = demo.workload_system(MEASURED, demo.parse_args(argv))
    return sys_, plan.predict(sys_)


def test_by_default_naive_is_link_bound_and_prfaas_leads_every_baseline():
    """At 20 Mbit/s both PrfaaS and naive were bound by the one decode (6.66 req/s each); at the default link
    naive's KV saturates the link while local-prefill-0 idles, and PrfaaS prefills short prompts locally."""
    sys_, preds = _predict([])
    prfaas, naive = preds["bandwidth_aware"], preds["all_remote"]
    homo, equal = preds["local_only"], preds["local_only_equal_cost"]
    everything_remote = stages(sys_, 0.0, 0, 1)
    assert naive.bound == "prfaas" and everything_remote.prfaas_egress < everything_remote.prfaas_compute
    assert prfaas.lam >= 1.2 * naive.lam
    assert prfaas.lam > equal.lam > homo.lam
    assert prfaas.lam < 0.8 * everything_remote.pdd  # the decode is not what binds PrfaaS
    assert 0.3 < prfaas.offload < 0.7


def test_at_the_old_link_rate_the_decode_binds_both_and_they_tie():
    """The regression the default avoids: 20 Mbit/s carries naive's KV faster than the decode finishes it."""
    _, preds = _predict(["--link-mbit", "20"])
    prfaas, naive = preds["bandwidth_aware"], preds["all_remote"]
    assert prfaas.bound == naive.bound == "pdd"
    assert prfaas.lam == pytest.approx(naive.lam)


def test_the_profiled_lengths_cover_the_prompts_prfaas_routes():
    """The profile measures 32 / 256 / 1024 tokens; the means the planner reads (short prompts locally, long
    ones remotely, at its threshold) fall inside, the curves extrapolate only for the longest ~9 %."""
    sys_, preds = _predict([])
    split = sys_.dist.split(preds["bandwidth_aware"].threshold)
    assert TOKENS[0] < split.l_short < split.l_long < TOKENS[-1]
    assert sys_.dist.split(TOKENS[-1]).p < 0.1
