"""Text table, JSON document and PNG plots of a plan (matplotlib imported lazily)."""

from __future__ import annotations

from pathlib import Path

from .optimize import PlanRow, plan_homogeneous, plan_naive, plan_prfaas, surface
from .model_config import account_doc
from .scenario import Scenario


def plan_rows(scn: Scenario) -> list[PlanRow]:
    return [plan_prfaas(scn.system, scn.fixed_split), plan_homogeneous(scn.baseline), plan_naive(scn.system)]


def plan_doc(scn: Scenario) -> dict:
    rows = plan_rows(scn)
    base = rows[1].stages.lam
    doc = {"scenario": scn.name, "rows": [r.to_dict() for r in rows]}
    if scn.account is not None:
        doc["model"] = account_doc(scn.account)
    for r in doc["rows"]:
        r["vs_homogeneous"] = r["lambda_max_rps"] / base if base > 0 else None
    return doc


def _fmt_t(v) -> str:
    return "-" if v is None or v >= 1e9 else f"{v / 1000:.1f}K"


def plan_table(doc: dict) -> str:
    """The paper's results table layout, one column per deployment."""
    rows = doc["rows"]
    head = ["", *[r["name"] for r in rows]]
    lines = [
        ["PrfaaS / PD-P / PD-D", *[f"{r['instances']['prfaas']} / {r['instances']['local_prefill']} / "
                                   f"{r['instances']['decode']}" for r in rows]],
        ["threshold t", *[_fmt_t(r["threshold"]) if 0 < r["offload_fraction"] < 1 else "-" for r in rows]],
        ["Θ per stage (req/s)", *[" / ".join(f"{r['throughput_rps'][k]:.2f}" for k in ("prfaas", "local_prefill",
                                                                                      "decode")) for r in rows]],
        ["Λ_max (req/s)", *[f"{r['lambda_max_rps']:.2f} ({r['bound']})" for r in rows]],
        ["vs homogeneous", *[f"{r['vs_homogeneous']:.2f}x" for r in rows]],
        ["offloaded", *[f"{100 * r['offload_fraction']:.1f}%" for r in rows]],
        ["egress (Gbit/s)", *[f"{r['egress_gbps']:.1f}" for r in rows]],
        ["mean / P90 TTFT (s)", *[f"{r['ttft_mean_s']:.2f} / {r['ttft_p90_s']:.2f}" for r in rows]],
    ]
    table = [head, *lines]
    widths = [max(len(row[i]) for row in table) for i in range(len(head))]
    out = [f"scenario: {doc['scenario']}"]
    if "model" in doc:
        m = doc["model"]
        swa = f" + {m['swa_bytes_per_token']} B/token SWA over {m['swa_window']} tokens" if m["swa_window"] else ""
        out.append(f"model: {m['family']}, {m['kv_bytes_per_token']} B/token KV{swa}, "
                   f"{m['state_bytes'] / 2**20:.2f} MiB fixed state per request (from its config.json)")
    out += ["  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in table]
    return "\n".join(out)


def write_plots(scn: Scenario, out_dir: Path) -> list[Path]:
    """lambda_vs_t.png (one curve per local split, with the two prefill terms) and lambda_vs_split.png."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir.mkdir(parents=True, exist_ok=True)
    srf = surface(scn.system)
    best = plan_prfaas(scn.system, scn.fixed_split)
    fig, ax = plt.subplots(figsize=(7, 4.2))
    for i, n_p in enumerate(srf.n_prefill):
        style = {"lw": 2.2} if n_p == best.stages.n_p else {"lw": 0.9, "alpha": 0.6}
        ax.plot(srf.thresholds / 1000, srf.lam[i], label=f"{n_p}P/{scn.system.n_local - n_p}D", **style)
    k = list(srf.n_prefill).index(best.stages.n_p) if best.stages.n_p in srf.n_prefill else 0
    ax.plot(srf.thresholds / 1000, srf.prfaas_term[k], "k--", lw=0.8, label="Θ_prfaas/p (best split)")
    ax.plot(srf.thresholds / 1000, srf.pdp_term[k], "k:", lw=0.8, label="Θ_pdp/(1-p) (best split)")
    ax.axvline(best.stages.t / 1000, color="grey", lw=0.6)
    ax.set(xscale="log", xlabel="threshold t (K tokens)", ylabel="Λ_max (req/s)",
           ylim=(0, 1.3 * max(best.stages.lam, 1e-3)), title=f"{scn.name}: Λ_max vs threshold")
    ax.legend(fontsize=7, ncol=2)
    paths = [out_dir / "lambda_vs_t.png"]
    fig.tight_layout(), fig.savefig(paths[0], dpi=110), plt.close(fig)
    fig, ax = plt.subplots(figsize=(6, 3.8))
    ax.plot(srf.n_prefill, srf.lam.max(axis=1), "o-", label="PrfaaS-PD (best t per split)")
    ax.axhline(plan_homogeneous(scn.baseline).stages.lam, color="C1", ls="--", label="homogeneous PD")
    ax.axhline(plan_naive(scn.system).stages.lam, color="C2", ls=":", label="naive heterogeneous")
    ax.set(xlabel=f"local prefill instances (of {scn.system.n_local})", ylabel="Λ_max (req/s)",
           title=f"{scn.name}: Λ_max vs local split")
    ax.legend(fontsize=8)
    paths.append(out_dir / "lambda_vs_split.png")
    fig.tight_layout(), fig.savefig(paths[1], dpi=110), plt.close(fig)
    return paths
