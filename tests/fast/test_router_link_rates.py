"""The router's link goodput from the transport's byte counters.

With real SGLang servers under load the router polled the transport every 1-2 s and took its 1 s-window
goodput: integrated over a run it came to 0.78 of the bytes the transport moved, because bytes acknowledged
between two windows were never seen (a poll period P > 1 s sees each chunk's acknowledgement with chance
1/P, at weight P: right on average, but a run of a few dozen chunks is off by tens of percent, and a poll
period locked to the chunk period sees all or none). The router now takes the rate of ``bytes_total``
between polls, which counts every byte once.
"""
from __future__ import annotations

import pytest

from prfaas_sgl.router.link_stats import CounterRates, link_sample

MB = 1_000_000
ACKS = [(0.5 + 2.0 * i, MB) for i in range(10)]  # one 1 MB KV chunk acknowledged every 2 s
POLLS = [0.2 + 2.0 * i for i in range(12)]  # a loaded router's 2 s poll period, in step with the chunks


def _snapshot(t: float) -> dict:
    """What prfaas_sgl.transfer.stats answers at time t for ACKS."""
    window = sum(n for a, n in ACKS if t - 1.0 <= a <= t)
    total = sum(n for a, n in ACKS if a <= t)
    peer = {"goodput_bps": {"1s": 8.0 * window, "10s": 0.0}, "bytes_total": total, "queue_delay_s": {"n": 0}}
    return {"links": {"10.0.0.2:7000": peer}}


def _integrated_bits(rates: CounterRates | None) -> float:
    """The router holds each reading until the next poll: the area under that step function."""
    readings = [link_sample(_snapshot(t), rates, "http://prefill/stats", t)[0] for t in POLLS]
    return sum(g * (t1 - t0) for g, t0, t1 in zip(readings, POLLS, POLLS[1:]))


def test_counter_rates_account_for_every_byte():
    assert _integrated_bits(CounterRates()) == pytest.approx(8.0 * 10 * MB, rel=1e-9)


def test_a_sampled_window_does_not_which_is_why_counters_are_used():
    assert _integrated_bits(None) == 0.0  # every acknowledgement fell between two 1 s windows


def test_a_restarted_transport_falls_back_to_its_window_and_restarts_the_delta():
    rates = CounterRates()
    assert rates.rate("k", 5 * MB, 1.0, fallback=7.0) == 7.0  # first reading: no delta yet
    assert rates.rate("k", 6 * MB, 2.0, fallback=7.0) == pytest.approx(8.0 * MB)
    assert rates.rate("k", 1 * MB, 3.0, fallback=9.0) == 9.0  # counter went down: a new process
    assert rates.rate("k", 2 * MB, 4.0, fallback=9.0) == pytest.approx(8.0 * MB)


def test_counter_keys_are_bounded():
    rates = CounterRates()
    for i in range(CounterRates.MAX_KEYS + 10):
        rates.rate(f"peer{i}", i, 1.0, 0.0)
    assert len(rates._last) == CounterRates.MAX_KEYS


@pytest.mark.parametrize("bad", [-1, 1.5e300, "12", True])
def test_a_malformed_counter_is_refused(bad):
    snap = _snapshot(1.0)
    snap["links"]["10.0.0.2:7000"]["bytes_total"] = bad
    with pytest.raises(ValueError, match="bytes_total"):
        link_sample(snap, CounterRates(), "u", 1.0)


def test_the_rate_is_over_the_transports_clock_not_the_answers_arrival():
    """A loaded link delays one answer and not the next: arrival 0.2 s apart, snapshots 1 s apart."""
    rates = CounterRates()
    for t_transport, arrival, total in ((10.0, 50.0, 0), (11.0, 50.2, MB)):
        snap = _snapshot(0.0)
        snap["time_s"] = t_transport
        snap["links"]["10.0.0.2:7000"]["bytes_total"] = total
        goodput = link_sample(snap, rates, "u", arrival)[0]
    assert goodput == pytest.approx(8.0 * MB)


def test_the_transport_sends_its_clock():
    from prfaas_sgl.transfer.stats import StatsBook

    book = StatsBook()
    book.link("10.0.0.2:7000").on_ack(MB, 0.0)
    snap = book.snapshot()
    assert isinstance(snap["time_s"], float) and snap["links"]["10.0.0.2:7000"]["bytes_total"] == MB


@pytest.mark.parametrize("bad", [-1.0, float("nan"), "now", None])
def test_a_malformed_clock_is_refused(bad):
    snap = _snapshot(1.0)
    snap["time_s"] = bad
    with pytest.raises(ValueError, match="time_s"):
        link_sample(snap, CounterRates(), "u", 1.0)


def test_the_router_exports_the_bytes_it_saw_and_the_capacity(tmp_path):
    """The load generator's exact link rate reads these two (prfaas_sgl/tools/loadgen/prom.py); the router used
    not to export them, so it fell back to sampling the goodput gauge."""
    from prfaas_sgl.tools.loadgen.prom import parse_metrics, total
    from prfaas_sgl.router.cluster import Cluster
    from prfaas_sgl.router.config import InstanceSpec, RouterConfig
    from prfaas_sgl.router.metrics import RouterMetrics

    (tmp_path / "tokenizer.json").write_text("{}")
    cfg = RouterConfig(local_prefill=(InstanceSpec("http://h:1", bootstrap_port=1),),
                       decode=(InstanceSpec("http://h:2"),), tokenizer_path=str(tmp_path), link_gbps=0.2)
    cluster, metrics = Cluster(cfg), RouterMetrics()
    seen = []
    for t in POLLS:
        link_sample(_snapshot(t), cluster.link.rates, "u", t)
        seen.append(total(parse_metrics(metrics.render(cluster, 100, 1.0).decode()),
                          "prfaas_router_link_bytes_total"))
    assert seen[-1] == 10 * MB and seen == sorted(seen)
    assert total(parse_metrics(metrics.render(cluster, 100, 1.0).decode()),
                 "prfaas_router_link_capacity_bps") == pytest.approx(0.2e9)
