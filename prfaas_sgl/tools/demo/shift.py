"""The demo's shift phase: the workload turns from long prompts (prefill-heavy) to short prompts with longer
answers (decode-heavy) mid-run, and the controller moves a local prefill server to decode — drained,
restarted as a decode with the same flags, admitted by the router — while requests keep coming.

The recommendation comes from ``LengthRule``, not the planner: the planner's throughput model needs measured
prefill/decode profiles of real hardware (a scenario file), which a tiny model on CPU does not have. Everything
after the recommendation — hysteresis, the processes actuator, logging and /metrics — is what the router runs.
"""
from __future__ import annotations

from collections import deque
from pathlib import Path

from prfaas_sgl.router.controller_api import ControllerUpdate

# (label, BenchConfig overrides, requests as a multiple of --sessions)
PARTS = (
    ("A: long prompts", {"scale": 1 / 64, "output_len": "fixed:1024"}, 0.5),  # ~430 in, 16 out
    ("B: short prompts, longer answers", {"scale": 1 / 512, "output_len": "fixed:32768"}, 2.0),  # ~54 in, 64 out
    ("C: same, after the switch", {"scale": 1 / 512, "output_len": "fixed:32768"}, 0.5),
)


class LengthRule:
    """A ``Controller`` (router/controller_api.py): recommends 2 local prefill / 1 decode while the last
    ``window`` prompts average more than ``long_tokens`` uncached tokens, 1/2 below ``short_tokens``, else the
    split it was given. Silent until ``active``."""

    def __init__(self, split: tuple[int, int], threshold: int, long_tokens: int = 250, short_tokens: int = 150,
                 window: int = 8) -> None:
        self.split, self.threshold = split, threshold
        self.long_tokens, self.short_tokens = long_tokens, short_tokens
        self.recent: deque[int] = deque(maxlen=window)
        self.active = False

    def observe(self, incremental_len: int, now: float) -> None:
        self.recent.append(incremental_len)

    def observe_link(self, link_bps: float, now: float) -> None: ...  # the rule has no link model

    def maybe_update(self, now: float) -> ControllerUpdate | None:
        if not self.active or len(self.recent) < self.recent.maxlen:
            return None
        mean = sum(self.recent) / len(self.recent)
        n = sum(self.split)
        rec = (n - 1, 1) if mean > self.long_tokens else (1, n - 1) if mean < self.short_tokens else self.split
        return ControllerUpdate(self.threshold, rec, "length_rule")

    def resize(self, split: tuple[int, int]) -> None:
        self.split = split


def switch_ended(actions: list) -> bool:
    """Whether a role switch the controller started has ended, however it ended. Only "applied" and "failed"
    end one: a "refused" recommendation made while the server is still switching is not its end (the demo
    once took one for it, ran "after the switch" with the server still restarting and stopped mid-switch)."""
    if not any(a.outcome == "in_progress" for a in actions):
        return bool(actions)  # only refusals: nothing is switching (no action yet: the controller may still act)
    return any(a.outcome in ("applied", "failed") for a in actions)


def describe(actions: list, at: list[float], t0: float) -> list[str]:
    """One line per controller action, timed from the phase start."""
    return [f"+{t - t0:5.0f}s [{a.actuator}] {a.outcome}: {a.before.prefill}P/{a.before.decode}D -> "
            f"{a.after.prefill}P/{a.after.decode}D ({a.reason}) {a.detail}" for a, t in zip(actions, at)]


def plot_timeline(parts: list[tuple[str, dict]], actions: list, at: list[float], path: Path) -> Path:
    """TTFT of every request by send time across the parts, with the switch's start and end marked."""
    from prfaas_sgl.router.sim.plots import pyplot

    plt = pyplot()
    fig, ax = plt.subplots(figsize=(8, 3.5))
    t0 = min(r["started_unix"] for _, r in parts) if parts else 0.0
    for label, res in parts:
        pts = [(res["started_unix"] + q["send_s"] - t0, q["ttft_s"]) for q in res["requests"] if q["ttft_s"]]
        ax.plot([p[0] for p in pts], [p[1] for p in pts], ".", label=label)
    for a, t in zip(actions, at):
        style = "--" if a.outcome == "in_progress" else "-"
        ax.axvline(t - t0, color="k", ls=style, lw=0.8)
        ax.annotate(f"{a.outcome} {a.after.prefill}P/{a.after.decode}D", (t - t0, ax.get_ylim()[1]),
                    fontsize=7, rotation=90, va="top")
    ax.set(xlabel="seconds since the phase started", ylabel="TTFT (s)", title="workload shift: a server switches role")
    ax.legend(fontsize=7)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
