"""The tiers' counters as Prometheus counters (what SGLang's /metrics serves with --enable-metrics): hits
by tier, misses, bytes loaded and stored, refusals by reason, write-through; each sync adds the growth."""
from __future__ import annotations

from prometheus_client import CollectorRegistry

from prfaas_sgl.cachepool.tiers import KV, STATE, Fingerprint, HostTier, TierStack
from prfaas_sgl.srt.cachepool_backend.tier_metrics import TierMetrics

FP = Fingerprint("tiny|metrics-test")
PAYLOAD = bytes(1000)


def test_tier_counters_reach_prometheus_with_their_labels():
    reg = CollectorRegistry()
    stack = TierStack(FP, HostTier(1 << 20), None, key=b"k" * 64)
    metrics = TierMetrics(stack.counters, {"tp_rank": "0"}, registry=reg)
    stack.put(KV, 1, PAYLOAD)
    stack.put(STATE, 1, PAYLOAD)
    assert stack.get(KV, 1, len(PAYLOAD)) == PAYLOAD and stack.get(KV, 2, len(PAYLOAD)) is None
    bad = bytearray(stack.host.get(FP.key(STATE, 1)))
    bad[50] ^= 1  # inside the MAC
    stack.host.put(FP.key(STATE, 1), bytes(bad))
    assert stack.get(STATE, 1, len(PAYLOAD)) is None
    metrics.sync()
    value = lambda name, **lab: reg.get_sample_value(f"prfaas_tier_{name}_total", {"tp_rank": "0", **lab})  # noqa: E731
    assert value("hits", tier="host") == 1 and value("misses") == 2 and value("loaded_bytes") == 1000
    assert value("refused", reason="mac") == 1
    assert stack.get(KV, 1, len(PAYLOAD)) == PAYLOAD
    metrics.sync()
    assert value("hits", tier="host") == 2 and value("loaded_bytes") == 2000  # growth, not totals again
