"""PNG plots of one or several simulation results (matplotlib imported lazily)."""

from __future__ import annotations

from pathlib import Path


def pyplot():
    """matplotlib.pyplot on the Agg backend (files only, no display), imported on first use; the simulator's
    studies and the demo's plots share it."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_timeseries(docs: dict[str, dict], path: Path, title: str = "") -> Path:
    """Goodput, P90 TTFT (by arrival time), link and pool use, threshold; one line per labelled run."""
    plt = pyplot()
    fig, axes = plt.subplots(5, 1, figsize=(8, 10), sharex=True)
    for label, doc in docs.items():
        ts = doc["timeseries"]
        t = [x / 60 for x in ts["t"]]
        axes[0].plot(t, ts["goodput_rps"], label=label, lw=1)
        axes[1].plot(t, [v if v is not None else float("nan") for v in ts["ttft_p90_s"]], lw=1)
        axes[2].plot(t, ts["link_util"], lw=1)
        axes[3].plot(t, ts["prfaas_util"], lw=1)
        axes[4].plot(t, ts["threshold"], lw=1)
    first = next(iter(docs.values()))["timeseries"]
    axes[2].plot([x / 60 for x in first["t"]], first["link_frac"], "k--", lw=0.8, label="available")
    labels = ["goodput (req/s)", "P90 TTFT (s)", "link use / capacity", "PrfaaS busy", "threshold (tokens)"]
    for ax, lab in zip(axes, labels):
        ax.set_ylabel(lab, fontsize=8)
        ax.grid(alpha=0.3)
    axes[1].set_yscale("log")
    axes[0].legend(fontsize=7)
    axes[2].legend(fontsize=7)
    axes[-1].set_xlabel("simulated time (min)")
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def plot_shift(docs: dict[str, dict], path: Path, title: str = "") -> Path:
    """Goodput, P90 TTFT (by arrival time) and the local prefill servers serving, one line per labelled run."""
    plt = pyplot()
    fig, axes = plt.subplots(3, 1, figsize=(8, 7), sharex=True)
    for label, doc in docs.items():
        ts = doc["timeseries"]
        t = [x / 60 for x in ts["t"]]
        axes[0].plot(t, ts["goodput_rps"], label=label, lw=1)
        axes[1].plot(t, [v if v is not None else float("nan") for v in ts["ttft_p90_s"]], lw=1)
        axes[2].step(t, ts["n_prefill"], where="post", lw=1)
    for ax, lab in zip(axes, ["goodput (req/s)", "P90 TTFT (s)", "local prefill servers"]):
        ax.set_ylabel(lab, fontsize=8)
        ax.grid(alpha=0.3)
    axes[1].set_yscale("log")
    axes[0].legend(fontsize=7)
    axes[-1].set_xlabel("simulated time (min)")
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
