"""Prefixes across clusters through the shared store: the paper's cache rules in the real router.

Prefill servers of both clusters can share one store tier (a Mooncake Store under `prfaas_hybrid`'s tiers,
docs/cachepool-tiers.md). Those that write what they compute through to it are its members here
(``--store-instances``): a prefix one of them computed is in the store, and another member that misses it
in its own cache loads it from there instead of recomputing it. The router keeps what was published
(``SharedStore``) apart from each server's own cache (its prefix index), and before a policy decides,
credits each member with what it would load::

    published in the store   |================ store_prefix ================|
    a member's own cache     |=== own ===|
    credited (rule allows)               |-------- fetched --------| (grid)  |--- computed: incremental ---|
                                                                                                  prompt_len

``PolicyParams.cache_rule``:
    scarce    nothing is credited: each cluster computes what its own cache lacks (the default)
    abundant  bandwidth is plentiful by configuration: every member is credited the store's prefix
    auto      a member is credited when loading is cheaper than recomputing on its pool
              (cost.price_fetch at --fetch-gbps, or the inter-DC link's measured drain rate)

The credit only changes what the policy sees (``InstanceView.cached_prefix``): the threshold rule then
judges the incremental length a cluster would really compute, which is the abundant rule
``l_total - max(l_prfaas, l_pd) <= t`` once the longer prefix can move. A store that lost the prefix
costs only time: the server misses and recomputes (tokens do not depend on the credit).
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Sequence

from .cost import ModelCost, PrefixFetch, price_fetch
from .prefix_index import ApproxIndex
from .views import Decision, InstanceView, RouteInput

if TYPE_CHECKING:
    from .policy import PolicyParams


class SharedStore:
    """What the store holds, as the router saw it published: every prompt a member prefilled, LRU over a
    modelled capacity (the store's own eviction is not reported; a stale entry is a miss, never wrong)."""

    def __init__(self, members: frozenset[str], capacity_blocks: int) -> None:
        self.members = members
        self.index = ApproxIndex(capacity_blocks if members else 0)

    def prefix_blocks(self, hashes: Sequence[int]) -> int:
        return self.index.match(hashes) if self.members else 0

    def published(self, prefill: str, hashes: Sequence[int]) -> None:
        """``prefill`` was sent this prompt: a member writes its blocks through to the store."""
        if prefill in self.members:
            self.index.insert(hashes)


def parse_members(text: str) -> frozenset[str]:
    """``--store-instances``: prefill server names, comma-separated."""
    return frozenset(n.strip() for n in text.split(",") if n.strip())


def fetch_rate_bps(inp: RouteInput, params: "PolicyParams") -> float:
    """Store -> prefill rate: configured, or the inter-DC link's (fetches cross it like KV handoffs do)."""
    return params.fetch_gbps * 1e9 if params.fetch_gbps > 0 else inp.link.drain_bps()


def loadable(inp: RouteInput, grid: int) -> int:
    """Tokens of the store's prefix a prefill can resume from: on the checkpoint grid, and short of the
    whole prompt (SGLang computes at least its last token)."""
    upto = min(inp.store_prefix, inp.prompt_len - 1)
    return upto - upto % grid if grid > 0 else upto


def fetches(inp: RouteInput, params: "PolicyParams", cost: ModelCost) -> dict[str, PrefixFetch]:
    """Each store member (a prefill) that holds less of the prompt than the store can load: its fetch, priced."""
    upto = loadable(inp, params.fetch_grid_tokens)
    if upto <= 0 or not inp.store_readers:
        return {}
    rate = fetch_rate_bps(inp, params)
    return {v.name: price_fetch(cost, v.pool == "prfaas", inp.prompt_len, v.cached_prefix, upto,
                                params.fetch_grid_tokens, params.fetch_rtt_s, rate)
            for v in inp.instances
            if v.name in inp.store_readers and v.pool != "decode" and v.cached_prefix < upto}


def credited(rule: str, fetch: PrefixFetch) -> bool:
    return rule == "abundant" or (rule == "auto" and fetch.pays)


def credit(inp: RouteInput, params: "PolicyParams", cost: ModelCost) -> tuple[RouteInput, dict[str, PrefixFetch]]:
    """``inp`` with each member credited what the rule lets it load, and every member's priced fetch."""
    priced = fetches(inp, params, cost)  # priced under "scarce" too: /metrics counts what it recomputes
    if not priced or params.cache_rule == "scarce":
        return inp, priced

    def view(v: InstanceView) -> InstanceView:
        f = priced.get(v.name)
        if f is None or not credited(params.cache_rule, f):
            return v
        return dataclasses.replace(v, cached_prefix=v.cached_prefix + f.tokens, fetch_s=f.fetch_s)

    return dataclasses.replace(inp, instances=tuple(view(v) for v in inp.instances)), priced


def annotate(d: Decision, priced: dict[str, PrefixFetch], rule: str) -> Decision:
    """``d`` with what its prefill loads from the store ("fetch"), or "recompute" when the store held more of
    the prompt than that prefill but the rule did not credit it."""
    f = priced.get(d.prefill)
    if f is None or d.pace_s > 0:
        return d
    if credited(rule, f):
        return dataclasses.replace(d, fetch="fetch", fetched_len=f.tokens, fetch_bytes=f.nbytes, fetch_s=f.fetch_s)
    return dataclasses.replace(d, fetch="recompute")
