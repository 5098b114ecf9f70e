"""The cost model of one deployment: KV bytes crossing the link, the part of them still to cross once the
prefill's last forward ends, prefill time and queue wait.

Shared by the routing policies (router/policy.py), the router's link accounting (router/routing.py) and the
simulator. Pure arithmetic. Units: tokens, bytes, seconds.
"""

from __future__ import annotations

import math
from dataclasses import MISSING, dataclass, field, fields

from prfaas_sgl.cliargs import FieldError, knob
from prfaas_sgl.transfer.config import LayerwiseConfig

_LAYERWISE = {f.name: f.default for f in fields(LayerwiseConfig)}  # the servers' defaults, declared there


@dataclass(frozen=True, slots=True)
class Streaming:
    """How a PrfaaS prefill hands a request's KV to the link while it computes, in the servers' own settings;
    what it decides is the share of the KV that can only leave after the last forward (the exposed tail)::

        prompt of l uncached tokens, chunks of C:  |--C--|--C--|--C--|-last-|
        chunk path   each chunk's pages leave after its forward      tail = last chunk's pages
        layer-wise   each group of layers' pages leave as it ends    tail = last chunk's last group
                     (l >= min_tokens, layers_per_group > 0)            = last chunk / ceil(layers / group)
        both         linear/SWA states and the aux row                  leave after the last forward

    Everything before the tail streams while later chunks compute, so a remote request's KV is ready at
    max(link drains its bytes, prefill end + tail bytes / rate): the paper's Eq. 3 min, with the tail kept.
    """

    chunk_tokens: int = knob(8192, "the PrfaaS prefills' --chunked-prefill-size (tokens per forward; 0 = one "
                                   "forward for the whole prompt)")
    attention_layers: int = knob(0, "the model's full-attention (KV-carrying) layers; layer-wise streaming "
                                    "splits each chunk's KV into groups of them (0 = not known: no groups)")
    layers_per_group: int = knob(_LAYERWISE["layers_per_group"], "the PrfaaS prefills' "
                                 "--prfaas-layerwise-layers-per-group (0 = off)")
    min_tokens: int = knob(_LAYERWISE["min_tokens"], "the PrfaaS prefills' --prfaas-layerwise-min-tokens")

    def __post_init__(self) -> None:
        if self.chunk_tokens < 0 or self.attention_layers < 0:
            raise FieldError("chunk_tokens", "chunk_tokens and attention_layers must be >= 0")
        LayerwiseConfig(self.layers_per_group, self.min_tokens)  # the servers' own checks

    def groups(self, tokens: int) -> int:
        """Layer groups a chunk of a ``tokens``-token prompt streams in (1 = the chunk path)."""
        if self.layers_per_group <= 0 or self.attention_layers <= 0 or tokens < self.min_tokens:
            return 1
        return math.ceil(self.attention_layers / self.layers_per_group)

    def tail_fraction(self, tokens: int) -> float:
        """Share of a ``tokens``-token prompt's KV pages that leaves after its last forward."""
        if tokens <= 0:
            return 0.0
        chunk = self.chunk_tokens if 0 < self.chunk_tokens < tokens else tokens
        last = tokens - (math.ceil(tokens / chunk) - 1) * chunk
        return last / tokens / self.groups(tokens)


# The router flags and [sim] keys that set a Streaming (cliargs.nested): the servers' own flag names, less
# their --prfaas- prefix, so an operator copies the prefill servers' settings across
STREAMING_FLAGS = {"chunk_tokens": "chunk_tokens", "attention_layers": "attention_layers",
                   "layers_per_group": "layerwise_layers_per_group", "min_tokens": "layerwise_min_tokens"}


@dataclass(frozen=True, slots=True)
class ModelCost:
    """KV size and prefill-time model of one deployment.

    Prefill time is quadratic in the uncached length l: ``a + b*l + c*l^2`` seconds, one triple per pool
    (the paper's H20 fit is a=0.468, b=1.300e-4, c=2.98e-10).
    """

    kv_bytes_per_token: float = knob(MISSING, "full-attention KV bytes per token (link accounting)")
    state_bytes: float = knob(0.0, "fixed per-request state bytes (linear/SWA states + aux)")
    local_coef: tuple[float, float, float] = knob((0.0, 1e-4, 0.0), "local prefill s = a + b*l + c*l^2")
    remote_coef: tuple[float, float, float] = knob((0.0, 5e-5, 0.0), "remote prefill s = a + b*l + c*l^2")
    streaming: Streaming = field(default_factory=Streaming)  # how the PrfaaS prefills stream (the tail)

    def __post_init__(self) -> None:
        if self.kv_bytes_per_token <= 0:
            raise FieldError("kv_bytes_per_token",
                             "kv_bytes_per_token must be > 0 (bytes of full-attention KV per token)")
        if self.state_bytes < 0:
            raise FieldError("state_bytes", "state_bytes must be >= 0")
        for name in ("local_coef", "remote_coef"):
            coef = tuple(float(x) for x in getattr(self, name))  # a TOML/JSON file gives a list
            if len(coef) != 3:
                raise FieldError(name, f"{name} takes three numbers a b c (seconds = a + b*l + c*l^2)")
            object.__setattr__(self, name, coef)

    def kv_bytes(self, tokens: int) -> float:
        """Bytes crossing the link for ``tokens`` of KV plus the fixed state."""
        return self.state_bytes + self.kv_bytes_per_token * max(tokens, 0)

    def tail_bytes(self, tokens: int) -> float:
        """Of ``kv_bytes(tokens)``, the bytes that leave only after the prefill's last forward."""
        return self.state_bytes + self.kv_bytes_per_token * max(tokens, 0) * self.streaming.tail_fraction(tokens)

    def prefill_s_local(self, tokens: int) -> float:
        return _quad(self.local_coef, tokens)

    def prefill_s_remote(self, tokens: int) -> float:
        return _quad(self.remote_coef, tokens)

    def wait_s_local(self, inflight: int, queued_tokens: int) -> float:
        """Seconds a new request waits behind a local prefill instance's queue (see ``queue_wait_s``)."""
        return queue_wait_s(self.local_coef, inflight, queued_tokens)

    def wait_s_remote(self, inflight: int, queued_tokens: int) -> float:
        return queue_wait_s(self.remote_coef, inflight, queued_tokens)


def kv_ready_s(compute_s: float, drain_s: float, tail_s: float) -> float:
    """When a remote request's KV is all at decode (seconds, or absolute times alike): the link drains its
    bytes (``drain_s``) while the prefill computes (``compute_s``), but the tail (``tail_s``: tail_bytes at
    the link's rate) can only leave once the last forward ended."""
    return max(compute_s + tail_s, drain_s)


def _quad(coef: tuple[float, float, float], tokens: int) -> float:
    if tokens <= 0:
        return 0.0
    a, b, c = coef
    return a + b * tokens + c * tokens * tokens


def queue_wait_s(coef: tuple[float, float, float], inflight: int, queued_tokens: int) -> float:
    """Queue wait on one prefill instance: ``a * inflight + b * queued_tokens`` seconds (a, b of its pool's fit).

    The fixed cost once per queued request plus the linear cost of the uncached tokens ahead; the quadratic
    term is left out because the queue's lengths are not known, only their sum.
    """
    a, b, _ = coef
    return a * inflight + b * queued_tokens


@dataclass(frozen=True, slots=True)
class PrefixFetch:
    """Loading ``tokens`` of a cached prefix from the shared store, priced against recomputing them.

    The store holds a prefix as one entry per KV block plus a linear-attention state at every checkpoint
    (the servers' tiers: docs/cachepool-tiers.md); a prefill loads them before its forward, one checkpoint
    interval after another, so each interval costs a round trip on top of its bytes::

        own cache |==== own ====|------------- tokens -------------|  (upto, on the checkpoint grid)
        intervals                 |  grid  |  grid  |  grid  |          states fetched: one per interval
        fetch_s = intervals * rtt_s + nbytes * 8 / rate
        saved_s = prefill(prompt - own) - prefill(prompt - upto)     (the candidate pool's fit)
    """

    tokens: int  # tokens loaded instead of computed
    intervals: int  # checkpoint intervals loaded (one state entry each)
    nbytes: float  # KV of `tokens` + one state per interval
    fetch_s: float
    saved_s: float

    @property
    def pays(self) -> bool:
        return self.fetch_s < self.saved_s


def price_fetch(cost: ModelCost, remote: bool, prompt_len: int, own: int, upto: int, grid: int, rtt_s: float,
                rate_bps: float) -> PrefixFetch:
    """What a prefill holding ``own`` tokens of the prompt pays to load ``[own, upto)`` from the store
    (``remote``: a PrfaaS prefill, priced on its pool's fit). ``grid``: the servers' checkpoint interval in
    tokens (0: one state at the end). ``rate_bps``: store -> prefill bits/s (0: the fetch never ends)."""
    tokens = max(upto - own, 0)
    intervals = (upto // grid - own // grid) if grid > 0 else int(tokens > 0)
    nbytes = cost.kv_bytes_per_token * tokens + cost.state_bytes * intervals
    fetch_s = intervals * rtt_s + (nbytes * 8 / rate_bps if rate_bps > 0 else float("inf"))
    prefill = cost.prefill_s_remote if remote else cost.prefill_s_local
    return PrefixFetch(tokens, intervals, nbytes, fetch_s, prefill(prompt_len - own) - prefill(prompt_len - upto))
