"""Bad scenario input: the error names the field and what is expected."""

import copy
import tomllib
from pathlib import Path

import pytest

from prfaas_sgl.cli import main
from prfaas_sgl.router.planner import ProfileError, parse_scenario

ROOT = Path(__file__).resolve().parents[2]
BASE = tomllib.loads((ROOT / "scenarios" / "paper_case_study.toml").read_text())


def mutated(path: str, value):
    doc = copy.deepcopy(BASE)
    *parents, leaf = path.split(".")
    tbl = doc
    for p in parents:
        tbl = tbl[p]
    if value is None:
        del tbl[leaf]
    else:
        tbl[leaf] = value
    return doc


@pytest.mark.parametrize("path,value,needle", [
    ("link.gbps", -5, "link.gbps: expected > 0"),
    ("link.gbps", None, "link.gbps: missing"),
    ("hardware.h200.prefill_s", [0.44, 0.72, 0.70, 7.40], "hardware.h200.prefill_s: values must be strictly increasing"),
    ("hardware.h200.prefill_s", [0.44, 0.72, 1.84], "hardware.h200.prefill_s: table needs"),
    ("hardware.h20.prefill_poly", [0.468, -1e-4], "hardware.h20.prefill_poly: polynomial"),
    ("model.kv_mib", [190.8, 150.0, 701.3, 2316.3], "model.kv_mib: values must be strictly increasing"),
    ("prfaas.hardware", "b200", "prfaas.hardware: expected one of ['h20', 'h200']"),
    ("local.instances", 0, "local.instances: expected >= 1"),
    ("workload.input.sigma", 0, "workload.input.sigma: expected > 0"),
    ("workload.input.kind", "zipf", "workload.input.kind: expected lognormal"),
    ("workload", None, "workload: missing table"),
])
def test_field_errors(path, value, needle):
    with pytest.raises(ProfileError) as e:
        parse_scenario(mutated(path, value))
    assert needle in str(e.value)


def test_split_larger_than_cluster():
    doc = mutated("local.prefill", 6)
    doc["local"]["decode"] = 5
    with pytest.raises(ProfileError, match=r"local.prefill \+ local.decode: expected to sum to local.instances = 8, "
                                           r"got 6 \+ 5 = 11"):
        parse_scenario(doc)


def test_fixed_split_is_used():
    doc = mutated("local.prefill", 4)
    doc["local"]["decode"] = 4
    from prfaas_sgl.router.planner import plan_prfaas

    scn = parse_scenario(doc)
    st = plan_prfaas(scn.system, scn.fixed_split).stages
    assert (st.n_p, st.n_d) == (4, 4)


def test_cli_reports_error(tmp_path, capsys):
    bad = tmp_path / "bad.toml"
    bad.write_text((ROOT / "scenarios" / "paper_case_study.toml").read_text().replace("gbps = 100", "gbps = -1"))
    assert main(["plan", str(bad)]) == 2
    assert "link.gbps: expected > 0, got -1" in capsys.readouterr().err
