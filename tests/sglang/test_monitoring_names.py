"""SGLang-side names of the operator's monitoring (issue 18) on real servers: a prfaas_zmq PD pair started with
--enable-metrics serves one request; every sglang:* name the alert rules and the Grafana dashboard use must be
a sample of its /metrics, and the prefill's own transport stats server (--prfaas-zmq-stats-port) must export
the prfaas_transfer_* names. The router's and a stand-alone sender's names: tests/fast/test_monitoring_names.py.
"""
from __future__ import annotations

import urllib.request
from pathlib import Path

import pytest
import sglang
from prometheus_client.parser import text_string_to_metric_families

from prfaas_sgl.launch import free_port
from tests.fast.test_monitoring_names import exported, used_names

from .conftest import HYBRID, farm_for, spec
from .pd import generate_body, pd_generate
from .prompts import prompt_ids

pytestmark = pytest.mark.sglang
STATS_PORT = free_port()
# Counters SGLang creates only when they first count (multiprocess metrics): a healthy run has no sample, so
# their names are checked in SGLang's source instead.
FAILURE_ONLY = {"sglang:num_transfer_failed_reqs_total"}
ZMQ_ARGS = ("--prfaas-zmq-timeout-s", "120", "--enable-metrics")


def _specs(log_dir):
    return {
        "prefill": spec(log_dir, "mon_prefill", HYBRID, mode="prefill", transfer_backend="prfaas_zmq",
                        bootstrap_port=free_port(), extra_args=ZMQ_ARGS + ("--prfaas-zmq-stats-port", str(STATS_PORT))),
        "decode": spec(log_dir, "mon_decode", HYBRID, mode="decode", transfer_backend="prfaas_zmq",
                       extra_args=ZMQ_ARGS),
    }


farm = farm_for(_specs)


def _get(url: str) -> str:
    with urllib.request.urlopen(url, timeout=30) as r:
        return r.read().decode()


def test_sglang_and_transport_names_used_by_rules_and_dashboard_are_exported(farm, model_paths):
    ids = prompt_ids(model_paths["hybrid"], 300, seed=3)
    pre, dec = farm["prefill"], farm["decode"]
    out = pd_generate(pre.url, dec.url, pre.spec.bootstrap_port, generate_body(ids, 4))
    assert len(out.get("output_ids", [])) == 4, out
    samples = set()
    for srv in (pre, dec):
        samples |= exported(_get(srv.url + "/metrics"))[0]
    wanted = used_names()
    sglang_names = {n for n in wanted if n.startswith("sglang:")}
    print("SGLang names counted only on failure (checked in SGLang's source):", sorted(FAILURE_ONLY))
    assert not (sglang_names - FAILURE_ONLY) - samples, "used but not exported by SGLang"
    source = (Path(sglang.__file__).parent / "srt" / "observability" / "metrics_collector.py").read_text()
    for name in FAILURE_ONLY:
        assert f'name="{name}"' in source, name

    transport = _get(f"http://127.0.0.1:{STATS_PORT}/metrics")
    t_samples, t_declared = exported(transport)
    ours = {n for n in wanted if n.startswith("prfaas_transfer_")}
    assert not ours - t_samples - {"prfaas_transfer_failures_total"}
    assert "prfaas_transfer_failures_total" in t_declared  # no failure in this run: declared, no sample
    alive = [s.value for f in text_string_to_metric_families(transport) for s in f.samples
             if s.name == "prfaas_transfer_loop_alive"]
    assert alive == [1.0]
