"""The routing core: policy + cluster state + metrics + long-term controller, and the admin knobs.

Synchronous and cheap: it runs on the event loop for every request.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from dataclasses import dataclass
from typing import Any, Sequence

from .cluster import Cluster
from .config import RouterConfig
from .controller_api import Controller, ControllerUpdate, checked
from .metrics import RouterMetrics
from .forward import LinkShare
from .policy import Decision, RoutingPolicy, local_fallback, make_policy

log = logging.getLogger(__name__)


ADMIN_KEYS = ("policy", "threshold", "high_watermark", "low_watermark", "cache_rule", "overload_tokens", "hold_s",
              "slack", "target_s", "pace_max_s", "pace_step_s", "fetch_gbps", "fetch_rtt_s", "fetch_grid_tokens")


@dataclass(frozen=True, slots=True)
class Routed:
    """A committed decision and the KV its attempt puts on the inter-DC link (none for a local prefill)."""

    decision: Decision
    link: LinkShare


class RoutingCore:
    def __init__(self, cfg: RouterConfig, cluster: Cluster, metrics: RouterMetrics,
                 controller: Controller | None = None) -> None:
        self.cfg, self.cluster, self.metrics, self.controller = cfg, cluster, metrics, controller
        self.params = cfg.policy_params
        self.cost = cfg.model_cost
        self.policy_name = cfg.policy
        self.policy: RoutingPolicy = make_policy(cfg.policy, self.params, self.cost)
        self.recommended_split: dict[str, int] = {}
        self.last_update_reason = ""

    def route(self, prompt_len: int, hashes: Sequence[int], now: float) -> Routed:
        """Pick prefill + decode; records the decision and the routed prefix. Raises NoInstanceError."""
        d = self.policy.decide(self.cluster.route_input(prompt_len, hashes, now))
        return self._commit(d, prompt_len, hashes, now)

    async def route_paced(self, prompt_len: int, hashes: Sequence[int]) -> Routed:
        """``route`` for a caller that can wait: the paced policy may hold a remote-bound request while the
        link binds (``Decision.pace_s``); each hold is counted as ``decisions{route="held"}``, then the request
        is decided again on fresh state. Other policies never hold, so this is ``route`` for them."""
        t0 = time.monotonic()
        while True:
            now = time.monotonic()
            inp = dataclasses.replace(self.cluster.route_input(prompt_len, hashes, now), waited_s=now - t0)
            d = self.policy.decide(inp)
            if d.pace_s <= 0:
                return self._commit(d, prompt_len, hashes, now)
            self.metrics.decisions.labels("held", d.reason).inc()
            await asyncio.sleep(d.pace_s)

    def retry_route(self, prompt_len: int, hashes: Sequence[int], exclude: frozenset[str], now: float) -> Routed:
        inp = self.cluster.route_input(prompt_len, hashes, now)
        d = local_fallback(inp, exclude, self.params.overload_tokens)
        return self._commit(d, prompt_len, hashes, now)

    def link_share(self, d: Decision, prompt_len: int, hashes: Sequence[int]) -> LinkShare:
        """KV crossing the link (only what decode does not hold) and when it starts: after the PrfaaS queue.

        Reads decode's prefix index, so it must run before ``_commit`` records this prompt there."""
        if d.route != "prfaas":
            return LinkShare()
        dec_cached = self.cluster.instances[d.decode].index.match(hashes) * self.cfg.block_size
        pre = self.cluster.instances[d.prefill].view(0)  # this attempt is not counted there yet
        wait_s = self.cost.wait_s_remote(pre.inflight, pre.queued_tokens)
        return LinkShare(self.cost.kv_bytes(prompt_len - dec_cached), time.monotonic() + wait_s)

    def _commit(self, d: Decision, prompt_len: int, hashes: Sequence[int], now: float) -> Routed:
        # The link's share first: with decode affinity on, the insert below makes decode's index hold the whole
        # prompt, and a share counted after it would leave the prompt's KV off the link's book.
        routed = Routed(d, self.link_share(d, prompt_len, hashes))
        self.cluster.instances[d.prefill].index.insert(hashes)
        self.cluster.store.published(d.prefill, hashes)
        if self.cfg.decode_affinity_slack >= 0:  # decode caches what it served (approximate index)
            self.cluster.instances[d.decode].index.insert(hashes)
        self.metrics.record(d)
        if self.controller is not None:
            self.controller.observe(d.incremental_len, now)
        return routed

    # ------------------------------------------------------------ long timescale

    def controller_tick(self, now: float) -> None:
        """Called on a timer; applies a controller update to the policy and logs why."""
        if self.controller is None:
            return
        if self.cluster.link.stats_ok:  # the drain rate, not an idle link's goodput
            self.controller.observe_link(self.cluster.link.view(time.monotonic()).drain_bps(), now)
        upd = self.controller.maybe_update(now)
        if upd is not None:
            self._apply_update(checked(upd))

    def _apply_update(self, upd: ControllerUpdate) -> None:
        self.recommended_split = upd.by_role()
        for role, n in self.recommended_split.items():
            self.metrics.split.labels(role).set(n)
        detail: dict[str, int | float | str] = {}
        if upd.optimum is not None:
            self.metrics.planner_offload.set(upd.optimum.offload_fraction)
            detail = upd.optimum.detail()
        self.last_update_reason = f"{upd.reason} {detail} split={self.recommended_split}"
        self.set_routing({"threshold": upd.threshold}, why=f"controller: {self.last_update_reason}")

    # ------------------------------------------------------------ admin

    def routing_state(self) -> dict[str, Any]:
        state = {k: getattr(self.params, k) for k in ADMIN_KEYS if k != "policy"}
        state.update(policy=self.policy_name, threshold=self.policy.threshold,
                     recommended_split=self.recommended_split, controller=self.controller is not None,
                     last_controller_reason=self.last_update_reason)
        return state

    def set_routing(self, changes: dict[str, Any], why: str) -> dict[str, Any]:
        """Apply admin/controller changes atomically. Raises ValueError naming the bad key."""
        unknown = set(changes) - set(ADMIN_KEYS)
        if unknown:
            raise ValueError(f"unknown routing keys {sorted(unknown)}; settable: {list(ADMIN_KEYS)}")
        fields = {k: v for k, v in changes.items() if k != "policy"}
        fields.setdefault("threshold", self.policy.threshold)
        params = dataclasses.replace(self.params, **fields)  # validates
        name = changes.get("policy", self.policy_name)
        before = self.routing_state()
        if name != self.policy_name or params != self.params:
            policy = make_policy(name, params, self.cost)
            if name == self.policy_name and hasattr(self.policy, "congested"):
                policy.congested = self.policy.congested  # keep the hysteresis latch across knob changes
                policy.congested_since = self.policy.congested_since
            self.policy, self.params, self.policy_name = policy, params, name
        after = self.routing_state()
        diff = {k: (before[k], after[k]) for k in after if before.get(k) != after[k]}
        if diff:
            log.info("routing changed %s because %s", diff, why)
        return after
