"""Throughput model pieces: curves, length splits, bisection vs brute force, CLI output."""

import json
import math
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from prfaas_sgl.cli import main
from prfaas_sgl.router.planner import Curve, best_threshold, load_scenario, stages
from prfaas_sgl.router.planner.report import plan_doc
from prfaas_sgl.router.planner.scenario import with_prefix_hits
from prfaas_sgl.workload.lengths import Empirical, TruncLogNormal

ROOT = Path(__file__).resolve().parents[2]
CASE = ROOT / "scenarios" / "paper_case_study.toml"


def test_curve_table_interpolates_and_extrapolates():
    c = Curve((1024, 8192, 32768, 131072), (0.44, 0.72, 1.84, 7.40))
    assert c.at(8192) == pytest.approx(0.72)
    assert c.at(62_300) == pytest.approx(3.51, abs=0.005)  # the paper's P90 request on H200
    assert c.at(0) == pytest.approx(0.44 - 1024 * 0.28 / 7168)  # first segment extended
    xs = np.array([0, 1024, 5000, 62_300, 200_000])
    assert np.allclose(c.many(xs), [c.at(x) for x in xs])


def test_curve_polynomial():
    c = Curve(poly=(0.468, 1.3e-4, 2.98e-10))
    assert c.at(10_000) == pytest.approx(0.468 + 1.3 + 0.0298)


def test_empirical_split_exact():
    d = Empirical.from_samples([100, 200, 300, 400])
    sp = d.split(250)
    assert (sp.p, sp.l_long, sp.l_short) == (0.5, 350.0, 150.0)
    assert d.split(400).p == 0.0 and d.split(50).p == 1.0 and d.mean == 250.0


def test_lognormal_split_matches_samples():
    d = TruncLogNormal(9.9, 1.0, 128, 131072)
    s = Empirical.from_samples(d.sample(np.random.default_rng(0), 200_000))
    for t in (5_000, 19_400, 60_000):
        a, b = d.split(t), s.split(t)
        assert a.p == pytest.approx(b.p, abs=0.005)
        assert a.l_long == pytest.approx(b.l_long, rel=0.01)
        assert a.l_short == pytest.approx(b.l_short, rel=0.01)
    assert d.mean == pytest.approx(27_486, rel=1e-3)
    assert d.quantile(0.9) == pytest.approx(62_410, rel=1e-3)


def test_bisection_matches_brute_force():
    sys = load_scenario(CASE).system
    for n_p in (2, 3, 4):
        best = best_threshold(sys, n_p, 8 - n_p)
        grid = max(stages(sys, t, n_p, 8 - n_p).lam for t in np.geomspace(128, 131072, 4000))
        assert best.lam == pytest.approx(grid, rel=2e-3)
        assert best.lam >= grid * (1 - 1e-9) or best.bound == "pdd"


def test_bisection_on_empirical_is_best_side():
    scn = load_scenario(CASE)
    emp = Empirical.from_samples(scn.raw_lengths.sample(np.random.default_rng(1), 500))
    sys = replace(scn.system, dist=emp)
    best = best_threshold(sys, 3, 5)
    brute = max(stages(sys, float(t), 3, 5).lam for t in sys.dist.values)
    assert best.lam == pytest.approx(brute, rel=1e-9)


def test_prefix_hits_shrink_lengths():
    d = TruncLogNormal(9.9, 1.0, 128, 131072)
    h = with_prefix_hits(d, 0.5, 0.5)
    assert h.mean == pytest.approx(d.mean * 0.75, rel=2e-3)


def test_cli_json_and_plots(tmp_path, capsys):
    assert main(["plan", str(CASE), "--json", "--out", str(tmp_path)]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert [r["name"] for r in doc["rows"]] == ["prfaas_pd", "homogeneous_pd", "naive_heterogeneous"]
    for name in ("lambda_vs_t.png", "lambda_vs_split.png"):
        assert (tmp_path / name).read_bytes()[:4] == b"\x89PNG"


@pytest.mark.parametrize("path", sorted((ROOT / "scenarios").glob("*.toml")), ids=lambda p: p.stem)
def test_every_shipped_scenario_plans(path):
    rows = {r["name"]: r for r in plan_doc(load_scenario(path))["rows"]}
    assert all(math.isfinite(r["lambda_max_rps"]) and r["lambda_max_rps"] > 0 for r in rows.values())
