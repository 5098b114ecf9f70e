"""Optimistic prefill (SGLang's `--optimistic-prefill-attempts`) on a prfaas_zmq prefill: counted and capped.

SGLang 0.5.23 computes a request whose decode has not finished its handshake (`req.pending_bootstrap`) and
parks it in its inflight queue with its KV in the pool, until the decode's Metadata arrives or the bootstrap
timeout frees it; it counts such requests only in its batch log line (`#optimistic-req`). Here:

    HeldBook     requests computed or computing ahead of their decode: how many, their prompt tokens, the
                 oldest one's age, starts the cap refused (/stats key `optimistic`, the sender's stats server)
    AROUND PrefillBootstrapQueue.can_prefill_before_bootstrap
                 SGLang's answer, then no when held tokens + this prompt > max_held_tokens: the request
                 stays in the bootstrap queue and starts once its decode is known, as without optimistic
                 prefill
    AROUND process_disagg_prefill_inflight_queue
                 the book is refreshed from the queues once per scheduler pass (held requests leave
                 through that queue; a started one is counted from its start)
"""
from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable

_PREFILL = "sglang.srt.disaggregation.prefill"
CAN_START = f"{_PREFILL}.PrefillBootstrapQueue.can_prefill_before_bootstrap"
INFLIGHT = f"{_PREFILL}.SchedulerDisaggregationPrefillMixin.process_disagg_prefill_inflight_queue"
_BOOK = "optimistic_book"  # the manager's HeldBook, made at the first look
_REFUSED = "_prfaas_optimistic_refused"  # set on a Req the cap refused once (counted once)


class HeldBook:
    """Requests held ahead of their decode, by request id. The scheduler thread writes (`observe`,
    `admits`); the stats thread reads (`snapshot`)."""

    def __init__(self, max_held_tokens: int = 0, clock: Callable[[], float] = time.monotonic) -> None:
        self.max_held_tokens = max_held_tokens
        self._clock = clock
        self._lock = threading.Lock()
        self._tokens: dict[str, int] = {}
        self._since: dict[str, float] = {}
        self.refused = 0

    def observe(self, held: dict[str, int]) -> None:
        """The requests held now (id -> prompt tokens); a request keeps the time it was first seen."""
        now = self._clock()
        with self._lock:
            self._since = {rid: self._since.get(rid, now) for rid in held}
            self._tokens = dict(held)

    def admits(self, rid: str, tokens: int) -> bool:
        """Whether request `rid` of `tokens` prompt tokens may start ahead of its decode; if so it counts as
        held from now (SGLang may start several in one pass, before any of them is in a queue)."""
        with self._lock:
            if 0 < self.max_held_tokens < sum(self._tokens.values()) + tokens:
                return False
            self._tokens[rid] = tokens
            self._since.setdefault(rid, self._clock())
            return True

    def snapshot(self) -> dict:
        now = self._clock()
        with self._lock:
            oldest = min(self._since.values(), default=None)
            return {"held_requests": len(self._tokens), "held_tokens": sum(self._tokens.values()),
                    "oldest_held_s": 0.0 if oldest is None else now - oldest,
                    "max_held_tokens": self.max_held_tokens, "refused_requests": self.refused}


def register(HookRegistry, HookType) -> None:
    HookRegistry.register(CAN_START, around_can_start, HookType.AROUND)
    HookRegistry.register(INFLIGHT, around_inflight, HookType.AROUND)


def around_can_start(original, queue, req, *args, **kwargs) -> bool:
    ok = original(queue, req, *args, **kwargs)
    book = book_of(getattr(queue, "kv_manager", None))
    if not ok or book is None:
        return ok
    if book.admits(req.rid, len(req.origin_input_ids)):
        return True
    if not getattr(req, _REFUSED, False):
        setattr(req, _REFUSED, True)
        book.refused += 1
    return False


def around_inflight(original, scheduler, *args, **kwargs):
    out = original(scheduler, *args, **kwargs)
    queue = getattr(scheduler, "disagg_prefill_bootstrap_queue", None)
    book = book_of(getattr(queue, "kv_manager", None))
    if book is not None:
        book.observe(held_requests(scheduler))
    return out


def book_of(mgr) -> HeldBook | None:
    """The HeldBook of a prfaas_zmq prefill manager (made and served in /stats at the first call); None for
    any other manager."""
    book = getattr(mgr, _BOOK, None)
    if book is not None or getattr(mgr, "sender", None) is None or not hasattr(mgr, "prfaas_config"):
        return book
    book = HeldBook(mgr.prfaas_config.optimistic.max_held_tokens)
    setattr(mgr, _BOOK, book)
    stats = getattr(mgr.sender, "stats", None)
    if stats is not None:
        stats.add_section("optimistic", book.snapshot)
    return book


def held_requests(scheduler) -> dict[str, int]:
    """Requests of `scheduler` computed or computing ahead of their decode: id -> prompt tokens."""
    return {r.rid: len(r.origin_input_ids) for r in _requests(scheduler) if getattr(r, "pending_bootstrap", False)}


def _requests(scheduler) -> Iterable:
    yield from getattr(scheduler, "disagg_prefill_inflight_queue", None) or ()
    yield from getattr(scheduler, "waiting_queue", None) or ()
    chunked = getattr(scheduler, "chunked_req", None)
    if chunked is not None:
        yield chunked
