"""Optimistic prefill on a prfaas_zmq prefill, counted and capped (`srt/backend/optimistic.py`): the book of
requests held ahead of their decode, the cap on their prompt tokens at SGLang's start decision, and the
/stats section (a real StatsBook). SGLang's queue and scheduler are stand-ins with the attributes the hooks
read; tests/sglang/test_prfaas_zmq_optimistic.py runs the hooks in real servers."""
from __future__ import annotations

from types import SimpleNamespace

from prfaas_sgl.config import PrfaasConfig
from prfaas_sgl.srt.backend.optimistic import HeldBook, around_can_start, around_inflight, book_of, held_requests
from prfaas_sgl.transfer.config import OptimisticConfig
from prfaas_sgl.transfer.stats import StatsBook


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def req(rid: str, tokens: int, pending: bool = True):
    return SimpleNamespace(rid=rid, origin_input_ids=[0] * tokens, pending_bootstrap=pending)


def manager(cap: int):
    cfg = PrfaasConfig(optimistic=OptimisticConfig(max_held_tokens=cap))
    return SimpleNamespace(prfaas_config=cfg, sender=SimpleNamespace(stats=StatsBook()))


def test_the_book_counts_held_requests_their_tokens_and_the_oldest_age():
    clock = Clock()
    book = HeldBook(clock=clock)
    book.observe({"a": 100, "b": 50})
    clock.t += 3.0
    book.observe({"b": 50, "c": 10})  # a left; b keeps its first-seen time
    clock.t += 1.0
    assert book.snapshot() == {"held_requests": 2, "held_tokens": 60, "oldest_held_s": 4.0, "max_held_tokens": 0,
                               "refused_requests": 0}
    book.observe({})
    assert book.snapshot()["oldest_held_s"] == 0.0


def test_the_cap_counts_requests_started_in_the_same_pass():
    book = HeldBook(max_held_tokens=1000)
    assert book.admits("a", 600)
    assert not book.admits("b", 600)  # a is not in any queue yet, but it holds its 600 tokens already
    assert book.admits("c", 400)
    assert HeldBook().admits("huge", 10**9)  # 0 = no cap


def test_a_start_past_the_cap_waits_for_its_decode_and_is_counted_once():
    mgr = manager(cap=1000)
    sched = SimpleNamespace(disagg_prefill_inflight_queue=[req("held", 800)], waiting_queue=[req("done", 5, False)],
                            chunked_req=None)
    queue = SimpleNamespace(kv_manager=mgr, scheduler=sched)
    sched.disagg_prefill_bootstrap_queue = queue
    around_inflight(lambda s: None, sched)  # the scheduler pass that refreshes the book
    yes = lambda q, r: True  # noqa: E731 - SGLang's own answer
    late = req("late", 300)
    assert not around_can_start(yes, queue, late) and not around_can_start(yes, queue, late)
    assert around_can_start(yes, queue, req("small", 200))
    assert not around_can_start(lambda q, r: False, queue, req("sglang-says-no", 1))
    snap = mgr.sender.stats.snapshot()["optimistic"]
    assert (snap["held_requests"], snap["held_tokens"], snap["refused_requests"]) == (2, 1000, 1)
    assert mgr.sender.stats.aggregate_snapshot()["optimistic"]["max_held_tokens"] == 1000


def test_held_requests_are_the_pending_ones_in_every_queue():
    sched = SimpleNamespace(disagg_prefill_inflight_queue=[req("i", 3), req("sent", 4, False)],
                            waiting_queue=[req("w", 5)], chunked_req=req("c", 7))
    assert held_requests(sched) == {"i": 3, "w": 5, "c": 7}


def test_other_managers_get_no_book():
    assert book_of(None) is None and book_of(SimpleNamespace(sender=None)) is None
    assert around_can_start(lambda q, r: True, SimpleNamespace(kv_manager=object()), req("x", 10**9))
