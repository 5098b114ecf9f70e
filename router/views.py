"""What a routing policy reads and returns: typed views of the servers, the link and one request, and the
decision. Built by the router (router/cluster.py) and the simulator; read by router/policy.py and
router/crossfetch.py. Units: lengths in tokens, sizes in bytes, rates in bits/s, times in seconds.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

Pool = Literal["prfaas", "local_prefill", "decode"]
Route = Literal["prfaas", "local"]


@dataclass(frozen=True, slots=True)
class InstanceView:
    """What the router (or simulator) knows about one server right now."""

    name: str
    pool: Pool
    healthy: bool
    queued_tokens: int  # uncached prompt tokens waiting/running there (/v1/loads + router in-flight)
    inflight: int  # requests in flight from this router
    cached_prefix: int  # tokens of THIS request's prompt already cached there (block-aligned)
    fetch_s: float = 0.0  # seconds it first spends loading the part of cached_prefix credited from the store


@dataclass(frozen=True, slots=True)
class LinkView:
    """The inter-datacenter link PrfaaS -> local decode.

    KV of a remote request is *queued* from routing until its prefill starts, then *in flight* (KV streams
    layer by layer while the prefill runs) until decode has it. Only in-flight bytes load the link.
    """

    capacity_bps: float  # configured bits/s
    goodput_bps: float = 0.0  # measured recent goodput, 0 if unknown
    bytes_in_flight: float = 0.0  # KV bytes being transferred now, not yet delivered
    queue_delay_s: float = 0.0  # measured transport queue delay
    bytes_queued: float = 0.0  # KV bytes of remote requests routed but still waiting for their prefill
    busy: float = 1.0  # share of goodput's measurement window the link had bytes to move (the simulator's 1.0)

    def drain_bps(self) -> float:
        """Rate at which the backlog drains: what the link moved while it had bytes to move, at most capacity.

        Goodput is bytes over the whole window: a link busy 5% of it measures 5% of what it can carry, and
        taken as the drain rate that made the router see a backlog 20x too long and hold or move requests an
        idle link would have taken. Goodput / busy is the rate while busy; unknown goodput or a link that was
        idle throughout (busy 0) tells nothing below capacity."""
        if self.goodput_bps <= 0 or self.busy <= 0:
            return self.capacity_bps
        return min(self.capacity_bps, self.goodput_bps / min(self.busy, 1.0))

    def transfer_s(self, nbytes: float) -> float:
        """Seconds to move ``nbytes`` at the drain rate (inf on a dead link)."""
        rate = self.drain_bps()
        return nbytes * 8 / rate if rate > 0 else float("inf")

    def pressure(self, budget_s: float) -> float:
        """Link pressure in units of ``budget_s``: drain time of the bytes on the wire, or the measured queue
        delay (what the bandwidth-aware latch compares with its watermarks, and the router exports)."""
        return max(self.transfer_s(self.bytes_in_flight), self.queue_delay_s) / budget_s


@dataclass(frozen=True, slots=True)
class RouteInput:
    prompt_len: int
    instances: tuple[InstanceView, ...]
    link: LinkView
    now: float
    # decode cache affinity (RouterConfig.decode_affinity_slack): -1 off; else the decode holding the
    # longest prefix wins unless it runs more than this many requests beyond the least-loaded decode
    decode_slack: int = -1
    waited_s: float = float("inf")  # seconds this request was already held by pacing; inf = caller cannot hold
    # the shared store (router/crossfetch.py): tokens of this prompt it holds (published by the servers that
    # write what they compute through to it), and the prefill servers that can load from it
    store_prefix: int = 0
    store_readers: frozenset[str] = frozenset()


@dataclass(frozen=True, slots=True)
class Decision:
    route: Route
    prefill: str  # instance name
    decode: str  # instance name
    incremental_len: int  # prompt_len - cached prefix on the chosen prefill instance
    reason: str  # short machine-readable reason, used as a metrics label
    pace_s: float = 0.0  # > 0: not yet; hold the request this long, then decide again (PacedPolicy)
    # the prefix the chosen prefill is credited with loading from the shared store (in incremental_len already):
    # "fetch" with its tokens and predicted bytes, "recompute" when the store held more but moving did not pay
    fetch: str = ""
    fetched_len: int = 0
    fetch_bytes: float = 0.0
    fetch_s: float = 0.0  # the load's predicted seconds (the simulator charges them to the prefill)
