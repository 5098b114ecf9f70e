"""Transport link statistics as the router reads them: parsing of untrusted JSON into one sample.

A sample is (goodput bits/s, queue delay s, number of chunks that delay averages over). Every parser
raises ValueError with the offending value rather than guessing: a number the router cannot trust must
not look like a measured 0.
"""

from __future__ import annotations

import math
from typing import Any, Sequence

Sample = tuple[float, float, int]


class CounterRates:
    """Goodput from the transport's monotonic ``bytes_total`` counters: Δbytes / Δt between two polls.

    The transport's own 1 s window, sampled by a poll every 1-2 s (real servers under load), aliases: a
    chunk acknowledged between two windows is never seen, one inside a window counts for the whole poll
    period, and a poll period in step with the chunks sees all or none. With real SGLang servers the
    router's integrated goodput came to 0.78 of the bytes the transport moved. Counter deltas count every
    byte once. A counter that goes down is a
    restarted transport: that reading falls back to the window and restarts the delta.
    """

    MAX_KEYS = 4096  # one per (stats URL, peer); least recently seen forgotten first

    def __init__(self) -> None:
        self._last: dict[str, tuple[int, float]] = {}
        self.bytes_seen = 0  # sum of the deltas: the router's prfaas_router_link_bytes_total

    def rate(self, key: str, total: int, now: float, fallback: float) -> float:
        last = self._last.pop(key, None)
        self._last[key] = (total, now)
        if len(self._last) > self.MAX_KEYS:
            self._last.pop(next(iter(self._last)))
        if last is None or total < last[0] or now <= last[1]:
            return fallback
        self.bytes_seen += total - last[0]
        return 8.0 * (total - last[0]) / (now - last[1])


def link_sample(payload: Any, rates: CounterRates | None = None, source: str = "",
                now: float = 0.0) -> Sample:
    """(goodput bits/s, queue delay s, chunks that delay averages) of one stats answer; ValueError if none.

    Shapes:
    - prfaas_sgl.transfer's snapshot ``{"links": {peer: {"goodput_bps": {"1s": .., "10s": ..},
      "queue_delay_s": {"n": .., "mean": ..}, ...}}}``. A PrfaaS prefill sends only to decodes behind the
      one inter-DC link the router models, so goodput is summed over peers and delay averaged over chunks;
      no peer yet is a measured 0.
    - flat ``{"goodput_bps": number | windows, "queue_delay_s": number | summary}`` (other transports).
    Goodput is the shortest window's (the policy wants the rate the link drains at now), or, given
    ``rates`` and a ``bytes_total`` counter, the counter's rate since the previous poll of ``source``, over
    the transport's clock (``time_s``) when it sends one, else over ``now`` (the answer's arrival).
    """
    if isinstance(payload, dict) and "time_s" in payload:
        now = _number(payload["time_s"], "time_s")
    if isinstance(payload, dict) and "links" in payload:
        links = payload["links"]
        if not isinstance(links, dict):
            raise ValueError(f"'links' must map peer -> stats, got {short(links)}")
        return combine_samples([_peer_sample(v, rates, f"{source}|{peer}", now) for peer, v in links.items()])
    return _peer_sample(payload, rates, source, now)


def combine_samples(samples: Sequence[Sample]) -> Sample:
    """Goodputs add (one link); delays average weighted by their chunk counts."""
    n = sum(s[2] for s in samples)
    delay = sum(s[1] * s[2] for s in samples) / n if n else 0.0
    return sum(s[0] for s in samples), delay, n


def _peer_sample(d: Any, rates: CounterRates | None, key: str, now: float) -> Sample:
    if not isinstance(d, dict) or "goodput_bps" not in d:
        raise ValueError(f"no goodput_bps in {short(d)}")
    delay, n = _delay(d.get("queue_delay_s", 0.0))
    goodput = _goodput(d["goodput_bps"])
    if rates is not None and "bytes_total" in d:
        goodput = rates.rate(key, count(d["bytes_total"], "bytes_total"), now, goodput)
    return goodput, delay, n


def _goodput(value: Any) -> float:
    if not isinstance(value, dict):
        return _number(value, "goodput_bps")
    try:
        windows = {float(str(k).removesuffix("s")): v for k, v in value.items()}
    except ValueError:
        windows = {}
    if not windows or not all(math.isfinite(w) and w > 0 for w in windows):
        raise ValueError(f"goodput_bps needs windows named like '1s', got {short(value)}")
    return _number(windows[min(windows)], "goodput_bps")


def _delay(value: Any) -> tuple[float, int]:
    if not isinstance(value, dict):
        return _number(value, "queue_delay_s"), 1
    n = count(value.get("n", 0), "queue_delay_s.n")
    return (_number(value.get("mean"), "queue_delay_s.mean"), n) if n else (0.0, 0)


def _number(x: Any, name: str) -> float:
    if isinstance(x, bool) or not isinstance(x, (int, float)) or not (math.isfinite(x) and x >= 0):
        raise ValueError(f"{name} must be a finite number >= 0, got {short(x)}")
    return float(x)


def count(x: Any, name: str) -> int:
    if isinstance(x, bool) or not isinstance(x, (int, float)) or not 0 <= x < 2**53:
        raise ValueError(f"{name} must be a count, got {short(x)}")
    return int(x)


def short(x: Any) -> str:
    text = repr(x)
    return text if len(text) <= 80 else text[:77] + "..."
