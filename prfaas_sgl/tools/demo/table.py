"""The demo's side-by-side table of load-generator results (one column per policy)."""
from __future__ import annotations


def _ms(d: dict, key: str) -> str:
    v = (d or {}).get(key)
    return "-" if v is None else f"{v * 1000:.0f}"


def _pct(v) -> str:
    return "-" if v is None else f"{100 * v:.0f}%"


def rows_for(results: dict) -> list[tuple[str, str]]:
    s, router = results["summary"], results.get("router") or {}
    routes = results.get("routes", {})
    head = [("servers (remote + local P/D)", results["servers"])] if "servers" in results else []
    return head + [
        ("requests ok / sent", f"{s['ok']} / {s['requests']}"),
        ("throughput (req/s)", f"{s['request_throughput']:.2f}"),
        ("goodput at SLO (req/s)", f"{s['goodput']:.2f}"),
        ("TTFT p50 / p90 (ms)", f"{_ms(s['ttft_s'], 'p50')} / {_ms(s['ttft_s'], 'p90')}"),
        ("TPOT p50 / p90 (ms)", f"{_ms(s['tpot_s'], 'p50')} / {_ms(s['tpot_s'], 'p90')}"),
        ("E2E p50 (ms)", _ms(s["e2e_s"], "p50")),
        ("routes (remote / local)", f"{routes.get('prfaas', {}).get('requests', 0)} / "
                                    f"{routes.get('local', {}).get('requests', 0)}"),
        ("offload fraction (router)", _pct(router.get("offload_fraction"))),
        ("link pressure mean / max", f"{_pct(router.get('link_utilization_mean'))} / "
                                        f"{_pct(router.get('link_utilization_max'))}"),
    ]


def format_side_by_side(rows: list[tuple[str, dict]]) -> str:
    labels = [label for label, _ in rows]
    cols = [rows_for(r) for _, r in rows]
    head = "| metric | " + " | ".join(labels) + " |"
    sep = "|---|" + "---|" * len(labels)
    lines = [head, sep]
    for i, (name, _) in enumerate(cols[0]):
        lines.append(f"| {name} | " + " | ".join(c[i][1] for c in cols) + " |")
    return "\n".join(lines)


# What the demo cannot show, even with its CPU shares (hardware.py) applied.
NOT_EMULATED = (
    "What this demo does not emulate:",
    "- The GPU kinds themselves: each server is a CPU share (H200-like prefill 0.7 cores, H20-like prefill 0.105,",
    "  H20-like decode 0.583), the same CPU running a tiny random-weight model; a share scales prefill and decode",
    "  alike, so each role's share follows the resource it is bound by (compute 6.7x, memory bandwidth 1.2x).",
    "  Without root the shares fall back to every server unshared on the same CPU cores (the log says so).",
    "- Absolute TTFT, TPOT and throughput, and the link-to-compute ratio (a 6 Mbit/s tc link, KV scaled down",
    "  with the model); the paper's cluster sizes (4 / 3 / 5 servers there, 1 / 1 / 1 here).",
    "- The role switch's cost: a tiny model restarts in about a minute on CPU; a multi-GPU server takes minutes.",
)
