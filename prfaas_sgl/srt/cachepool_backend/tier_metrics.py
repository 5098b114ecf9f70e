"""The tiers' counters in SGLang's /metrics (`--enable-metrics`): `prfaas_tier_*`.

SGLang serves /metrics from its HTTP process and collects the scheduler processes' metrics through
prometheus_client's multiprocess files (PROMETHEUS_MULTIPROC_DIR, set before the schedulers start): a
Counter made here, in the scheduler process, shows up there like SGLang's own. TierStack keeps plain
ints (the scheduler thread and the publisher's worker write them); one daemon thread adds their growth
to the Prometheus counters every `period_s`, so the hot path never touches prometheus_client.

    prfaas_tier_hits_total{tier=host|storage}  prfaas_tier_misses_total
    prfaas_tier_loaded_bytes_total             prfaas_tier_stored_total, prfaas_tier_stored_bytes_total
    prfaas_tier_refused_total{reason=mac|checksum}
    prfaas_tier_published_total, prfaas_tier_published_bytes_total, prfaas_tier_publish_dropped_total,
    prfaas_tier_publish_failed_total           prfaas_tier_storage_errors_total, prfaas_tier_dropped_total
    prfaas_tier_storage_attach_failures_total  (a storage tier down at start, retried)
    prfaas_tier_prefetched_total, prfaas_tier_prefetched_bytes_total, prfaas_tier_prefetch_abandoned_total
"""
from __future__ import annotations

import os
import threading
from typing import Callable, Optional

# counter name in TierStack.counters() -> (metric, labels, help)
METRICS: dict[str, tuple[str, dict[str, str], str]] = {
    "host_hits": ("hits", {"tier": "host"}, "Tier entries loaded back, by tier"),
    "storage_hits": ("hits", {"tier": "storage"}, "Tier entries loaded back, by tier"),
    "misses": ("misses", {}, "Tier lookups that found no loadable entry"),
    "loaded_bytes": ("loaded_bytes", {}, "Payload bytes loaded back from the tiers"),
    "stored": ("stored", {}, "Entries demoted into the storage tier"),
    "stored_bytes": ("stored_bytes", {}, "Encoded bytes demoted into the storage tier"),
    "refused_mac": ("refused", {"reason": "mac"}, "Entries refused and dropped: MAC or checksum/header"),
    "corrupt": ("refused", {"reason": "checksum"}, "Entries refused and dropped: MAC or checksum/header"),
    "dropped": ("dropped", {}, "Demoted entries no tier kept"),
    "storage_errors": ("storage_errors", {}, "Storage backend failures"),
    "storage_attach_failures": ("storage_attach_failures", {}, "Failed tries to reach a storage tier down at start"),
    "prefetch_fetched": ("prefetched", {}, "Storage entries read and verified ahead of their request's match"),
    "prefetch_fetched_bytes": ("prefetched_bytes", {}, "Payload bytes read from storage ahead of the match"),
    "prefetch_abandoned": ("prefetch_abandoned", {}, "Prefetches still running when their request's hold ran out"),
    "published": ("published", {}, "Entries written through to the storage tier"),
    "published_bytes": ("published_bytes", {}, "Encoded bytes written through to the storage tier"),
    "publish_failed": ("publish_failed", {}, "Write-through puts the store refused or failed"),
    "publish_dropped": ("publish_dropped", {}, "Write-through entries dropped: queue full"),
}


class TierMetrics:
    def __init__(self, counters: Callable[[], dict[str, int]], labels: dict[str, str], period_s: float = 1.0,
                 registry=None) -> None:
        from prometheus_client import REGISTRY, Counter

        names = sorted({m for m, _, _ in METRICS.values()})
        helps = {m: h for m, _, h in METRICS.values()}
        extra = {m: sorted({k for mm, lab, _ in METRICS.values() if mm == m for k in lab}) for m in names}
        self._counters = {m: Counter(f"prfaas_tier_{m}", helps[m], [*labels, *extra[m]],
                                     registry=registry or REGISTRY) for m in names}
        self._read, self._labels, self.period_s = counters, labels, period_s
        self._last: dict[str, int] = {}
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None

    def start(self) -> "TierMetrics":
        self._thread = threading.Thread(target=self._run, name="prfaas-tier-metrics", daemon=True)
        self._thread.start()
        return self

    def sync(self) -> None:
        """Add each counter's growth since the last sync."""
        for name, value in self._read().items():
            if name not in METRICS:
                continue
            delta = value - self._last.get(name, 0)
            if delta > 0:
                metric, lab, _ = METRICS[name]
                self._counters[metric].labels(**self._labels, **lab).inc(delta)
                self._last[name] = value

    def stop(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        while not self._stop.wait(self.period_s):
            self.sync()
        self.sync()


def exported() -> bool:
    """Whether this process's metrics reach SGLang's /metrics (the server runs with --enable-metrics)."""
    return bool(os.environ.get("PROMETHEUS_MULTIPROC_DIR"))
