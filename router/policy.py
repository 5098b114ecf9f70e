"""Routing policies shared by the router process, the simulator and the planner.

Pure: no I/O and no clock reads. Time comes in as ``RouteInput.now`` (seconds, monotonic or simulated).
The only state a policy keeps is its tunables (``threshold``, watermarks) and, for the bandwidth-aware
policy, the hysteresis latch; both change only through ``decide()`` or explicit attribute writes.

Units: lengths in tokens, sizes in bytes, rates in bits/s, times in seconds.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import MappingProxyType
from typing import Literal, Protocol

from prfaas_sgl.cliargs import FieldError, knob

from .cost import ModelCost, kv_ready_s
from .crossfetch import annotate, credit
from .views import Decision, InstanceView, LinkView, Pool, Route, RouteInput  # noqa: F401 - the policies' types

CacheRule = Literal["scarce", "abundant", "auto"]

class NoInstanceError(RuntimeError):
    """No healthy instance can serve the request (no healthy decode, or no healthy prefill at all)."""


@dataclass(frozen=True, slots=True)
class PolicyParams:
    """Tunables of every policy; unused fields are ignored by the simpler ones. The router's flags and the
    simulator's [sim] keys are generated from these fields (help from the metadata; router/config.py)."""

    threshold: int = knob(8192, "incremental-length threshold t (tokens) above which prefill goes remote")
    cache_rule: CacheRule = knob("scarce", "paper cache rule: scarce (per-cluster cache), abundant (max of both; "
                                 "--store-instances load the shared store's prefix) or auto (load it when cheaper "
                                 "than recomputing)")
    overload_tokens: int = knob(32768, "queued tokens beyond which cache affinity is ignored")
    high_watermark: float = knob(0.9, "link pressure (backlog or queue delay / budget) marking the link congested")
    low_watermark: float = knob(0.6, "link pressure below which it is not congested again")
    budget_s: float = knob(1.0, "link pressure 1.0 = this many seconds of transfer backlog or queue delay")
    hold_s: float = knob(1.0, "minimum seconds the link counts as congested once it was")
    slack: float = knob(0.5, "bandwidth_aware: the other pool must be this fraction sooner to take a request")
    target_s: float = knob(6.0, "bandwidth_aware: ... and have its KV ready within this many seconds")
    pace_max_s: float = knob(1.0, "paced: hold a remote-bound request at most this many seconds in all")
    pace_step_s: float = knob(0.25, "paced: decide a held request again after at most this many seconds")
    fetch_gbps: float = knob(0.0, "shared store -> prefill rate for loading a prefix (Gbit/s; 0 = the inter-DC "
                             "link's measured drain rate, its --link-gbps until measured)")
    fetch_rtt_s: float = knob(0.002, "seconds a prefix load costs per checkpoint interval on top of its bytes "
                              "(store round trips)")
    fetch_grid_tokens: int = knob(0, "the servers' state checkpoint interval (tokens; their --chunked-prefill-size "
                                  "for linear-attention models): a loaded prefix ends on it; 0 = block-aligned")

    def __post_init__(self) -> None:
        for name in ("threshold", "overload_tokens", "hold_s", "slack", "pace_max_s", "fetch_gbps", "fetch_rtt_s",
                     "fetch_grid_tokens"):
            if getattr(self, name) < 0:
                raise FieldError(name, f"{name} must be >= 0")
        for name in ("budget_s", "target_s", "pace_step_s"):
            if getattr(self, name) <= 0:
                raise FieldError(name, f"{name} must be > 0 seconds")
        if self.cache_rule not in ("scarce", "abundant", "auto"):
            raise FieldError("cache_rule", "cache_rule must be 'scarce', 'abundant' or 'auto'")
        if not 0 < self.low_watermark <= self.high_watermark:
            raise FieldError("low_watermark", "need 0 < low_watermark <= high_watermark")


class RoutingPolicy(Protocol):
    threshold: int

    def decide(self, inp: RouteInput) -> Decision: ...


# ---------------------------------------------------------------- selection inside a pool


def healthy(inp: RouteInput, pool: Pool, exclude: frozenset[str] = frozenset()) -> list[InstanceView]:
    return [i for i in inp.instances if i.pool == pool and i.healthy and i.name not in exclude]


def best_cached(cands: list[InstanceView]) -> int:
    return max((i.cached_prefix for i in cands), default=0)


def pick_prefill(cands: list[InstanceView], prompt_len: int, overload_tokens: int) -> tuple[InstanceView, str]:
    """Cache affinity unless the affine instance is overloaded, else least queued uncached tokens.

    Returns the instance and "affinity" or "least_loaded". ``cands`` must be non-empty.
    """
    affine = max(cands, key=lambda i: (i.cached_prefix, -i.queued_tokens, -i.inflight))
    if affine.cached_prefix > 0 and affine.queued_tokens <= overload_tokens:
        return affine, "affinity"
    # Cost counts this request's own uncached tokens, so a smaller hit still tips a tie.
    least = min(cands, key=lambda i: (i.queued_tokens + prompt_len - i.cached_prefix, i.inflight, i.name))
    return least, "least_loaded"


def pick_decode(inp: RouteInput) -> InstanceView:
    """Least loaded; with decode affinity on, the decode already holding the longest prefix of the
    prompt if it is not too busy: its hit becomes SGLang's decode_prefix_len and those pages never
    cross the link (decode-side prefix cache: prfaas_hybrid or SGLang's decode radix cache)."""
    cands = healthy(inp, "decode")
    if not cands:
        raise NoInstanceError("no healthy decode instance")
    least = min(cands, key=lambda i: (i.inflight, i.queued_tokens, i.name))
    if inp.decode_slack < 0:
        return least
    affine = max(cands, key=lambda i: (i.cached_prefix, -i.inflight, -i.queued_tokens))
    if affine.cached_prefix > 0 and affine.inflight <= least.inflight + inp.decode_slack:
        return affine
    return least


def decide_on(inp: RouteInput, route: Route, reason: str, overload_tokens: int,
              exclude: frozenset[str] = frozenset()) -> Decision:
    """Build a decision for ``route``; falls over to the other pool when ``route``'s pool is empty."""
    pool: Pool = "prfaas" if route == "prfaas" else "local_prefill"
    cands = healthy(inp, pool, exclude)
    if not cands:
        other: Pool = "local_prefill" if pool == "prfaas" else "prfaas"
        cands = healthy(inp, other, exclude)
        if not cands:
            raise NoInstanceError("no healthy prefill instance")
        route, reason = ("local", "no_prfaas") if other == "local_prefill" else ("prfaas", "no_local")
    inst, _ = pick_prefill(cands, inp.prompt_len, overload_tokens)
    return Decision(route, inst.name, pick_decode(inp).name, inp.prompt_len - inst.cached_prefix, reason)


def local_fallback(inp: RouteInput, exclude: frozenset[str], overload_tokens: int = 1 << 62) -> Decision:
    """The retry after a failed remote prefill: a local prefill instance, never PrfaaS."""
    cands = healthy(inp, "local_prefill", exclude)
    if not cands:
        raise NoInstanceError("no healthy local prefill instance for the retry")
    inst, _ = pick_prefill(cands, inp.prompt_len, overload_tokens)
    return Decision("local", inst.name, pick_decode(inp).name, inp.prompt_len - inst.cached_prefix, "retry_local")


# ---------------------------------------------------------------- policies


class LocalOnlyPolicy:
    """Homogeneous PD baseline: every prefill on the local cluster."""

    def __init__(self, params: PolicyParams = PolicyParams(), cost: ModelCost | None = None) -> None:
        self.params = params
        self.threshold = params.threshold  # unused; kept so the controller can write it uniformly

    def decide(self, inp: RouteInput) -> Decision:
        return decide_on(inp, "local", "local_only", self.params.overload_tokens)


class AllRemotePolicy:
    """Naive heterogeneous: every prefill on PrfaaS."""

    def __init__(self, params: PolicyParams = PolicyParams(), cost: ModelCost | None = None) -> None:
        self.params = params
        self.threshold = params.threshold

    def decide(self, inp: RouteInput) -> Decision:
        return decide_on(inp, "prfaas", "all_remote", self.params.overload_tokens)


class ThresholdPolicy:
    """Static threshold t with the paper's cache rules (paper §4).

    scarce (default): judge each cluster by its own cache, ``l_total - l_pd <= t`` -> local.
    abundant: ``l_total - max(l_prfaas, l_pd) <= t`` -> local. The prefix moves through the shared store:
    a prefill that writes through to it and one that loads from it (router/crossfetch.py) see each other's
    prefixes as their own, so the cluster chosen computes only the increment; a prefix held by a server
    outside the store is still recomputed by the other cluster.
    auto: scarce, except that a store member is credited the store's prefix when loading it is cheaper
    than recomputing it (the measured link and the cost model decide per request).
    """

    def __init__(self, params: PolicyParams = PolicyParams(), cost: ModelCost | None = None) -> None:
        self.params = params
        self.threshold = params.threshold
        self.cost = cost or ModelCost(kv_bytes_per_token=1.0)

    def wants_remote(self, inp: RouteInput) -> bool:
        l_pd = best_cached(healthy(inp, "local_prefill"))
        if self.params.cache_rule == "abundant":
            l_pd = max(l_pd, best_cached(healthy(inp, "prfaas")))
        return inp.prompt_len - l_pd > self.threshold

    def decide(self, inp: RouteInput) -> Decision:
        """``_decide`` on views credited with what each prefill would load from the shared store."""
        credited, priced = credit(inp, self.params, self.cost)
        return annotate(self._decide(credited), priced, self.params.cache_rule)

    def _decide(self, inp: RouteInput) -> Decision:
        if self.wants_remote(inp):
            return decide_on(inp, "prfaas", "long", self.params.overload_tokens)
        return decide_on(inp, "local", "short", self.params.overload_tokens)


class BandwidthAwarePolicy(ThresholdPolicy):
    """Threshold t, plus moves between the pools when the other one has this request ready clearly sooner.

    Estimated seconds from now until decode can start, on the instance each pool would pick::

        local  = wait(l) + fetch(l) + prefill_local(L - cached_l)
        remote = max(wait(r) + fetch(r) + prefill_remote(L - cached_r) + tail_s, link_s) + queue_delay
        wait(i) = a * i.inflight + b * i.queued_tokens      (a, b of that pool's prefill fit)
        fetch(i) = seconds loading the prefix credited from the shared store (router/crossfetch.py)
        link_s  = (max(0, in_flight + queued - drain * wait(r)) + own KV bytes) * 8 / drain
        tail_s  = own bytes that leave after the last forward (cost.Streaming) * 8 / drain

    KV streams while the prefill runs (per chunk, or per layer group), so compute and transfer overlap and the
    later one ends, but the tail (the last chunk's, or its last group's, pages and the states) only follows it.
    Bytes queued behind PrfaaS prefills count only for the part the link cannot clear while this request
    waits: remote queueing is compute load, already in wait(r). (The first version latched on in-flight +
    queued bytes against a 1-2 s budget, so a PrfaaS queue alone closed the route with the link half idle
    and flooded the busier local pool.)

    A request moves off its threshold route only if the other pool is sooner by the factor 1 + ``slack``
    and has it ready within ``target_s``. The target keeps one overloaded pool from dragging the other
    down: when both are late, equalising their queues makes every request miss its TTFT SLO.

    Link pressure p = max(transfer_s(in_flight), queue_delay) / budget_s sees only bytes on the wire, with
    hysteresis: p > ``high_watermark`` marks the link congested until p < ``low_watermark`` and ``hold_s``
    passed. While congested, short requests never move to PrfaaS and a long one moves local on any margin.
    """

    def __init__(self, params: PolicyParams = PolicyParams(), cost: ModelCost | None = None) -> None:
        super().__init__(params, cost)
        self.congested = False
        self.congested_since = 0.0

    def update_latch(self, link: LinkView, now: float) -> bool:
        """Advance the hysteresis latch; returns True while the link is congested."""
        p = link.pressure(self.params.budget_s)
        if self.congested:
            if p < self.params.low_watermark and now - self.congested_since >= self.params.hold_s:
                self.congested = False
        elif p > self.params.high_watermark:
            self.congested, self.congested_since = True, now
        return self.congested

    def remote_parts(self, inp: RouteInput, remote: InstanceView, req_bytes: float) -> tuple[float, float, float]:
        """(compute, link, ahead) estimated seconds of the remote route: PrfaaS wait + prefill; the link's drain
        time of the bytes it cannot clear meanwhile plus this request's; of those bytes alone. KV streams
        during the prefill, so the later of compute and link ends it."""
        c, link = self.cost, inp.link
        wait_r = c.wait_s_remote(remote.inflight, remote.queued_tokens)
        ahead = max(0.0, link.bytes_in_flight + link.bytes_queued - link.drain_bps() / 8 * wait_r)
        compute_s = wait_r + remote.fetch_s + c.prefill_s_remote(inp.prompt_len - remote.cached_prefix)
        return compute_s, link.transfer_s(ahead + req_bytes), link.transfer_s(ahead)

    def ready_s(self, inp: RouteInput, local: InstanceView, remote: InstanceView,
                req_bytes: float) -> tuple[float, float]:
        """(local, remote) estimated seconds until this request's KV is ready for decode."""
        wait_l = self.cost.wait_s_local(local.inflight, local.queued_tokens)
        local_s = wait_l + local.fetch_s + self.cost.prefill_s_local(inp.prompt_len - local.cached_prefix)
        compute_s, link_s, _ = self.remote_parts(inp, remote, req_bytes)
        tail_s = inp.link.transfer_s(self.cost.tail_bytes(inp.prompt_len - remote.cached_prefix))
        return local_s, kv_ready_s(compute_s, link_s, tail_s) + inp.link.queue_delay_s

    def moves(self, stay_s: float, move_s: float, margin: float) -> bool:
        return move_s * margin < stay_s and move_s <= self.params.target_s

    def _decide(self, inp: RouteInput) -> Decision:
        ovl = self.params.overload_tokens
        long = self.wants_remote(inp)
        first = decide_on(inp, "prfaas" if long else "local", "long" if long else "short", ovl)
        r_cands, l_cands = healthy(inp, "prfaas"), healthy(inp, "local_prefill")
        if not r_cands or not l_cands:
            return first
        remote, _ = pick_prefill(r_cands, inp.prompt_len, ovl)
        local, _ = pick_prefill(l_cands, inp.prompt_len, ovl)
        dec = next(i for i in inp.instances if i.name == first.decode)
        req_bytes = self.cost.kv_bytes(inp.prompt_len - dec.cached_prefix)
        local_s, remote_s = self.ready_s(inp, local, remote, req_bytes)
        congested = self.update_latch(inp.link, inp.now)
        margin = 1.0 + self.params.slack
        if long and self.moves(remote_s, local_s, 1.0 if congested else margin):
            return decide_on(inp, "local", "link_congested" if congested else "remote_slower", ovl)
        if not long and not congested and self.moves(local_s, remote_s, margin):
            return decide_on(inp, "prfaas", "local_slower", ovl)
        return first


PACE_MIN_S = 0.05  # shorter holds are not worth a timer (and would re-decide without end)


class PacedPolicy(BandwidthAwarePolicy):
    """Bandwidth-aware, plus pacing: a remote-bound request waits at the router while the link is the
    bottleneck, instead of joining the transfers on it or moving to the local prefill pool.

    Transfers share the link (many TCP flows): one more started on a link that already binds slows every
    one in flight, and a long prompt moved local costs the busy local pool a quadratic prefill that pushes the
    short requests behind it. So when the bandwidth-aware decision for a long request would send it to
    PrfaaS and the link would still be busy with others' bytes when its prefill ends (``ahead > compute``:
    its KV would wait for the wire anyway, and slow theirs meanwhile), the request is held for
    min(ahead - compute, ``pace_step_s``) and decided again, ``pace_max_s`` in all; then the bandwidth-aware
    decision stands. A long request the bandwidth-aware rules move local (the local pool has it ready within
    ``target_s``) is not held: that pool has room. Holding needs the caller to wait (``RouteInput.waited_s``
    finite): the router's ``RoutingCore.route_paced`` and the simulator do.

    Work-conserving: a request whose PrfaaS instance has nothing queued or running is never held. The hold only
    reorders the link, but an idle PrfaaS leaves compute unused for good: when the link recovers, the held
    backlog meets a PrfaaS queue instead of finished prefills (burst + link-drop study, seed 7, ``pace_max_s``
    60 s: held requests then queued 30-45 s at PrfaaS after the drop, P90 TTFT 56.0 s; with this rule 49.5 s).
    """

    def _decide(self, inp: RouteInput) -> Decision:
        d = super()._decide(inp)
        room = self.params.pace_max_s - inp.waited_s
        if room <= 0 or d.reason != "long":
            return d
        r_cands = healthy(inp, "prfaas")
        if not r_cands:
            return d
        remote, _ = pick_prefill(r_cands, inp.prompt_len, self.params.overload_tokens)
        if remote.inflight == 0 and remote.queued_tokens == 0:  # idle PrfaaS: holding would waste its compute
            return d
        dec = next(i for i in inp.instances if i.name == d.decode)
        own = self.cost.kv_bytes(inp.prompt_len - dec.cached_prefix)
        compute_s, _, ahead_s = self.remote_parts(inp, remote, own)
        hold = min(ahead_s - compute_s, self.params.pace_step_s, room)
        if hold < PACE_MIN_S:
            return d
        return Decision("prfaas", remote.name, d.decode, inp.prompt_len - remote.cached_prefix, "paced", hold)


POLICIES = MappingProxyType({
    "local_only": LocalOnlyPolicy,
    "all_remote": AllRemotePolicy,
    "threshold": ThresholdPolicy,
    "bandwidth_aware": BandwidthAwarePolicy,
    "paced": PacedPolicy,
})


def make_policy(name: str, params: PolicyParams = PolicyParams(), cost: ModelCost | None = None) -> RoutingPolicy:
    """Build a policy by registry name (see ``POLICIES``)."""
    if name not in POLICIES:
        raise ValueError(f"unknown policy {name!r}; choose one of {sorted(POLICIES)}")
    return POLICIES[name](params, cost)
