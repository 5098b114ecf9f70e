"""The link's drain rate from measured goodput, on a link that was not busy the whole time.

Goodput is bytes moved over the whole measurement window. On a lightly loaded link that is what the traffic
asked for, not what the link can carry: the router took it as the drain rate, saw a backlog many times too long,
and held (paced) or moved local requests an idle link would have taken. The simulator passes the exact available
rate, so only the router's own path (transport stats -> LinkState -> LinkView) shows it.
"""

from __future__ import annotations

import pytest

from prfaas_sgl.router.cluster import Cluster, LinkState
from prfaas_sgl.router.config import RouterConfig
from prfaas_sgl.router.metrics import RouterMetrics
from prfaas_sgl.router.policy import RouteInput
from prfaas_sgl.router.routing import RoutingCore
from tests.fast.test_router_policy import GBIT, bw, cluster
from tests.support.router_standin import build_tiny_tokenizer

T0 = 1000.0  # a fake monotonic clock: every LinkState call gets its time


def _readings(link: LinkState, goodput_bps: float, t0: float = T0, t1: float = T0 + 1.0) -> None:
    """Two transport readings bounding one measurement window [t0, t1]."""
    link.measured((goodput_bps, 0.0, 0), now=t0)
    link.measured((goodput_bps, 0.0, 0), now=t1)


def test_an_idle_links_low_goodput_is_not_its_drain_rate():
    link = LinkState(10 * GBIT)
    _readings(link, 0.2 * GBIT)  # nothing was in flight: the 0.2 Gbit/s is demand, not capacity
    assert link.view(T0 + 1.0).drain_bps() == 10 * GBIT


def test_a_link_busy_part_of_the_window_drains_at_its_rate_while_busy():
    link = LinkState(10 * GBIT)
    link.measured((0.0, 0.0, 0), now=T0)
    tid = link.add(50e6, start_at=T0, now=T0)
    link.done(tid, now=T0 + 0.05)  # in flight 5% of the window
    link.measured((0.2 * GBIT, 0.0, 0), now=T0 + 1.0)
    assert link.busy == pytest.approx(0.05)
    assert link.view(T0 + 1.0).drain_bps() == pytest.approx(4 * GBIT)  # 0.2 Gbit/s over the window = 4 Gbit/s while busy
    _readings(link, 5 * GBIT, T0 + 1.0, T0 + 2.0)  # idle again: never above the configured capacity
    assert link.view(T0 + 2.0).drain_bps() == 10 * GBIT


def test_a_busy_links_measured_goodput_is_still_the_drain_rate():
    link = LinkState(10 * GBIT)
    link.add(500e6, start_at=T0 - 1.0, now=T0 - 1.0)  # in flight before and throughout the window
    _readings(link, 2 * GBIT)
    assert link.busy == 1.0 and link.view(T0 + 1.0).drain_bps() == 2 * GBIT


def test_bytes_queued_behind_a_prefill_do_not_make_the_link_busy():
    link = LinkState(10 * GBIT)
    link.add(500e6, start_at=T0 + 0.5, now=T0)  # its prefill starts half-way through the window
    _readings(link, 1 * GBIT)
    assert link.busy == pytest.approx(0.5) and link.view(T0 + 1.0).drain_bps() == pytest.approx(2 * GBIT)


def test_bandwidth_aware_routing_over_a_mostly_idle_link_does_not_see_congestion():
    """test_router_policy's congested case (20 MB in flight at 0.1 Gbit/s goodput = 1.6 s > budget), reached through
    the router's LinkState: only a link that was busy while measured is congested."""
    def decide(link: LinkState) -> tuple[str, str]:
        link.add(20e6, start_at=T0 + 1.0, now=T0 + 1.0)  # a transfer that starts now
        d = bw().decide(RouteInput(20_000, cluster(), link.view(T0 + 1.0), T0 + 1.0))
        return d.route, d.reason

    idle = LinkState(GBIT)
    _readings(idle, 0.1 * GBIT)
    assert decide(idle) == ("prfaas", "long")
    busy = LinkState(GBIT)
    busy.add(50e6, start_at=T0 - 1.0, now=T0 - 1.0)
    _readings(busy, 0.1 * GBIT)
    assert decide(busy) == ("local", "link_congested")


class _LinkObserver:
    def __init__(self) -> None:
        self.seen: list[float] = []

    def observe(self, incremental_len: int, now: float) -> None: ...

    def observe_link(self, goodput_bps: float, now: float) -> None:
        self.seen.append(goodput_bps)

    def maybe_update(self, now: float) -> None:
        return None


def test_the_controller_plans_with_the_drain_rate_not_an_idle_links_goodput(tmp_path):
    """The long-timescale controller re-optimises t with the link bandwidth it is given: an idle link's goodput made
    the link look slow, so t rose, fewer requests went remote and the link stayed idle."""
    cfg = RouterConfig.from_flags(local_prefill=("http://h:1;bootstrap=8998",), decode=("http://h:2",), link_gbps=10.0,
                                  tokenizer_path=build_tiny_tokenizer(str(tmp_path / "tok")))
    ctl = _LinkObserver()
    core = RoutingCore(cfg, Cluster(cfg), RouterMetrics(), ctl)
    _readings(core.cluster.link, 0.2 * GBIT)
    core.controller_tick(1.0)
    assert ctl.seen == [10 * GBIT]
