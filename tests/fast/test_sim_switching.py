"""The simulator moves local servers between prefill and decode when the controller says so, at a cost."""

from pathlib import Path

import numpy as np
import pytest

from prfaas_sgl.router.planner import ProfileError, load_scenario
from prfaas_sgl.router.sim.config import sim_config
from prfaas_sgl.router.sim.run import build

ROOT = Path(__file__).resolve().parents[2]
CASE = load_scenario(ROOT / "scenarios" / "paper_case_study.toml")


def short_heavy_sim(**kw):
    """Ten minutes of short prompts (lengths x 0.3) at 3 req/s on the case study's 3/5 split: the planner
    wants fewer local prefills (0/8 at this mix, one step at a time here)."""
    c = sim_config(CASE.sim, duration_s=600.0, drain_s=600.0, phases=((0.0, 3.0, 0.3),), controller=True,
                   actuate=True, controller_interval_s=30.0, controller_window=256, dwell_s=120.0, confirm=2,
                   switch_s=60.0, prefill=3, **kw)
    sim = build(CASE, c)
    sim.run()
    return sim


def test_short_heavy_traffic_moves_a_prefill_to_decode_without_losing_requests():
    sim = short_heavy_sim()
    done = sim.mover.done
    assert done, "no server moved"
    first = done[0]
    assert first.name.startswith("pd-p-") and first.to == "decode"
    assert first.start < first.drained and first.ready == pytest.approx(first.drained + 60.0)
    # the draining server got no request routed after its drain began, and served every one it had
    mine = [r for r in sim.reqs if r.prefill == first.name]
    assert mine and max(r.arrival for r in mine) <= first.start
    assert all(r.prefill_end <= first.drained for r in mine)
    assert any(r.decode == first.new_name for r in sim.reqs)  # the new decode serves
    assert all(not np.isnan(r.decode_end) for r in sim.reqs)  # nothing lost
    moves = [b.start - a.start for a, b in zip(done, done[1:])]
    assert all(gap >= 120.0 for gap in moves)  # dwell time between moves
    ns = [(s.n_prefill, s.n_decode) for s in sim.samples]
    assert ns[0] == (3, 5) and ns[-1][0] < 3 and all(p + d <= 8 for p, d in ns)


def test_without_actuate_the_split_stays():
    c = sim_config(CASE.sim, duration_s=300.0, phases=((0.0, 3.0, 0.3),), controller=True,
                   controller_interval_s=30.0, controller_window=256, prefill=3)
    sim = build(CASE, c)
    sim.run()
    assert sim.mover is None and {(s.n_prefill, s.n_decode) for s in sim.samples} == {(3, 5)}


def test_phases_shift_arrival_rate_and_lengths():
    c = sim_config(CASE.sim, duration_s=1200.0, phases=((0.0, 1.0, 0.5), (600.0, 2.0, 2.0)))
    sim = build(CASE, c)
    first = [r.input_len for r in sim.reqs if r.arrival < 600]
    second = [r.input_len for r in sim.reqs if r.arrival >= 600]
    assert 1.6 < len(second) / len(first) < 2.4
    assert np.median(second) > 3 * np.median(first)
    with pytest.raises(ProfileError, match="sim.phases"):
        sim_config({"phases": [[0, -1, 1]]})
