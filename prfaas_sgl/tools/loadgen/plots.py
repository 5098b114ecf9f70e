"""PNG plots from a results document (works on a saved JSON too). matplotlib with the Agg backend,
imported lazily so the library stays light for callers that never plot."""

from __future__ import annotations

from pathlib import Path

import numpy as np


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")  # no display on servers; must precede the pyplot import
    import matplotlib.pyplot as plt

    return plt


def plot_ttft_cdf(results: dict, path: Path) -> None:
    """Empirical TTFT CDF, one line per route plus "all"."""
    plt = _pyplot()
    ok = [r for r in results["requests"] if r["ok"]]
    groups = {"all": ok}
    for route in sorted({r["route"] for r in ok} - {"-"}):
        groups[route] = [r for r in ok if r["route"] == route]
    fig, ax = plt.subplots(figsize=(6, 4))
    for name, recs in groups.items():
        x = np.sort([r["ttft_s"] for r in recs])
        if len(x):
            ax.step(x, np.arange(1, len(x) + 1) / len(x), where="post", label=f"{name} (n={len(x)})")
    slo = results["slo"]["ttft_s"]
    ax.axvline(slo, color="gray", linestyle="--", linewidth=1, label=f"SLO {slo} s")
    ax.set(xlabel="TTFT (s)", ylabel="fraction of requests", title="TTFT CDF", ylim=(0, 1.02))
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def plot_timeseries(results: dict, path: Path) -> None:
    """Output tokens/s (and completed req/s) over time; link utilization below when scraped."""
    plt = _pyplot()
    link = results["timeseries"]["link"]
    has_link = bool(link) and any(u is not None for u in link["link_utilization"])
    fig, axes = plt.subplots(2 if has_link else 1, 1, figsize=(7, 5 if has_link else 3.5), sharex=True,
                             squeeze=False)
    tp = results["timeseries"]["throughput"]
    ax = axes[0][0]
    if tp["t_s"]:
        edges = tp["t_s"] + [tp["t_s"][-1] + tp["bin_s"]]
        ax.stairs(tp["output_tokens_per_s"], edges, label="output tok/s")
        ax2 = ax.twinx()
        ax2.stairs(tp["requests_per_s"], edges, color="tab:orange", label="completed req/s")
        ax2.set(ylabel="completed req/s (orange)", ylim=(0, None))
    ax.set(ylabel="output tokens/s (blue)", title="throughput over time", ylim=(0, None))
    ax.grid(alpha=0.3)
    if has_link:
        pts = [(t, u) for t, u in zip(link["t_s"], link["link_utilization"]) if u is not None]
        axes[1][0].plot(*zip(*pts), marker=".", color="tab:green")
        axes[1][0].set(ylabel="link pressure (drain time / budget)", ylim=(0, max(1.0, max(u for _, u in pts) * 1.05)))
        axes[1][0].grid(alpha=0.3)
    axes[-1][0].set_xlabel("time since start (s)")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def write_plots(results: dict, out_dir: str | Path, prefix: str = "") -> list[Path]:
    """Write ``<prefix>ttft_cdf.png`` and ``<prefix>timeseries.png``; returns their paths."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = [out / f"{prefix}ttft_cdf.png", out / f"{prefix}timeseries.png"]
    plot_ttft_cdf(results, paths[0])
    plot_timeseries(results, paths[1])
    return paths
