"""The demo's measured table: the three policies on the emulated clusters, repeated, beside the planner.

Each run is closed-loop (a fixed number of requests in flight) so that it measures what the servers
sustain, the quantity the planner's Λ_max predicts; an open-loop run below capacity would measure its own
arrival rate. Prefix caches are flushed before every run: repetitions reuse their seed, so the policies see
the same prompts, and a cache warmed by the run before would shorten the next one's prefills.
"""
from __future__ import annotations

import dataclasses
import json
import statistics
import urllib.error
import urllib.request
from dataclasses import dataclass, field

from prfaas_sgl.tools.demo.plan import Prediction


@dataclass
class Runs:
    """The measured throughputs (req/s) and TTFT p90s (s) of one policy, one entry per repetition."""

    policy: str
    label: str
    throughput: list[float] = field(default_factory=list)
    ttft_p90: list[float] = field(default_factory=list)
    errors: list[int] = field(default_factory=list)  # failed requests per repetition: 0 in a valid measurement

    def add(self, results: dict) -> None:
        s = results["summary"]
        self.throughput.append(s["request_throughput"])
        self.errors.append(s["errors"])
        self.ttft_p90.append((s["ttft_s"] or {}).get("p90") or float("nan"))

    def mean(self) -> float:
        return statistics.fmean(self.throughput)

    def spread(self) -> str:
        """mean (min–max) over the repetitions."""
        return f"{self.mean():.2f} ({min(self.throughput):.2f}–{max(self.throughput):.2f})"


def flush_caches(urls: list[str], wait_s: float = 30.0) -> None:
    """POST /flush_cache to each server. SGLang flushes only when no request runs or waits; `timeout` lets it
    wait that long for idle (a decode may still be finishing the last run's streams)."""
    for url in urls:
        req = urllib.request.Request(f"{url}/flush_cache?timeout={wait_s:g}", b"", method="POST")
        try:
            with urllib.request.urlopen(req, timeout=wait_s + 10) as r:
                r.read()
        except urllib.error.HTTPError as e:
            raise RuntimeError(f"{url}/flush_cache refused ({e.code}): {e.read().decode(errors='replace')}") from e


def orderings(runs: dict[str, Runs]) -> list[tuple[str, ...]]:
    """Per repetition, the phases from fastest to slowest."""
    reps = len(next(iter(runs.values())).throughput)
    return [tuple(sorted(runs, key=lambda p: -runs[p].throughput[i])) for i in range(reps)]


TIE = 0.02  # predictions closer than this (relative) are a tie: the planner says nothing of their order


def predicted_groups(runs: dict[str, Runs], preds: dict[str, Prediction]) -> list[list[str]]:
    """The planner's ordering, fastest first, with tied predictions (e.g. two policies bound by the same
    decode) in one group."""
    groups: list[list[str]] = []
    for p in sorted(runs, key=lambda p: -preds[p].lam):
        if groups and preds[p].lam >= preds[groups[-1][0]].lam * (1 - TIE):
            groups[-1].append(p)
        else:
            groups.append([p])
    return groups


def consistent(order: tuple[str, ...], groups: list[list[str]]) -> bool:
    rank = {p: i for i, g in enumerate(groups) for p in g}
    return all(rank[a] <= rank[b] for a, b in zip(order, order[1:]))


def stability(runs: dict[str, Runs], preds: dict[str, Prediction]) -> str:
    """A plain sentence: the ordering across repetitions, and whether it is the planner's."""
    orders = orderings(runs)
    name = {p: runs[p].label for p in runs}
    groups = predicted_groups(runs, preds)
    say = lambda order: " > ".join(name[p] for p in order)  # noqa: E731
    planner = " > ".join(" = ".join(name[p] for p in g) for g in groups)
    if len(set(orders)) == 1:
        head = f"ordering stable over {len(orders)} repetition(s): {say(orders[0])}"
    else:
        head = (f"ordering NOT stable over {len(orders)} repetitions: " + "; ".join(say(o) for o in orders)
                + " (the policies' throughputs lie within each other's spread on this machine)")
    if not all(consistent(o, groups) for o in orders):
        return f"{head} — planner: {planner}"
    if all(len(g) == 1 for g in groups) and len(set(orders)) == 1:
        return f"{head} — the planner's"
    return f"{head} — every repetition consistent with the planner's {planner} (= : predicted within {TIE:.0%})"


def format_measured(runs: dict[str, Runs], preds: dict[str, Prediction]) -> str:
    base_m, base_p = runs["local_only"].mean(), preds["local_only"].lam
    lines = ["| policy | servers (remote + P/D) | t (tokens) | measured req/s, mean (min–max) | predicted Λ_max "
             "| measured vs homogeneous | predicted vs homogeneous | measured TTFT p90 (s) | failed requests |",
             "|---|---|---|---|---|---|---|---|---|"]
    for policy, r in runs.items():
        p = preds[policy]
        t = "-" if p.threshold is None else str(p.threshold)
        p90 = statistics.fmean(r.ttft_p90)
        lines.append(f"| {r.label} | {p.servers} | {t} | {r.spread()} | {p.lam:.2f} | {r.mean() / base_m:.2f}x "
                     f"| {p.lam / base_p:.2f}x | {p90:.2f} | {sum(r.errors)} |")
    return "\n".join(lines)


def to_json(runs: dict[str, Runs], preds: dict[str, Prediction]) -> str:
    return json.dumps({p: {"label": r.label, "throughput_rps": r.throughput, "ttft_p90_s": r.ttft_p90,
                           "errors": r.errors,
                           "predicted": dataclasses.asdict(preds[p])}
                       for p, r in runs.items()}, indent=1)
