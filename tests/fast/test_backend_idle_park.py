"""A PD scheduler of ours with nothing to run parks instead of spinning (`idle_park`): SGLang's `on_idle`
returns at once (after `time.sleep(0)`) while requests wait in its disaggregation queues, so the loop ran
at a whole core through a decode's wait for its prefill, taking that core from the prefill's forward on
shared CPUs. Here: real ZeroMQ sockets and pipes, real managers for the status wake-up; the scheduler is a
stand-in with the attributes the hook reads (the real-server proof is the CPU time a waiting decode and a
holding prefill use, tests/sglang/test_prfaas_zmq_optimistic.py)."""
from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import pytest
import zmq

from prfaas_sgl.srt.backend.idle_park import PARK_S, Park, Waker, around_on_idle

from .backend_fake_pd import make_pd  # noqa: F401 - a fixture


@pytest.fixture()
def sockets():
    ctx = zmq.Context()
    pull, push = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
    port = pull.bind_to_random_port("tcp://127.0.0.1")
    push.connect(f"tcp://127.0.0.1:{port}")
    yield pull, push
    pull.close(linger=0)
    push.close(linger=0)
    ctx.term()


def scheduler(pull, *, sleeps: bool = True, waiting=(), running_empty: bool = True):
    poller = zmq.Poller()
    poller.register(pull, zmq.POLLIN)
    mgr = SimpleNamespace(idle_waker=Waker())
    return SimpleNamespace(idle_sleeper=SimpleNamespace(poller=poller) if sleeps else None,
                           disagg_decode_prealloc_queue=SimpleNamespace(kv_manager=mgr),
                           running_batch=SimpleNamespace(is_empty=lambda: running_empty),
                           chunked_req=None, waiting_queue=list(waiting))


def loop_passes(sched, seconds: float = 0.3) -> int:
    """How many times SGLang's loop would call on_idle in `seconds` (its own on_idle does nothing here)."""
    n, end = 0, time.monotonic() + seconds
    while time.monotonic() < end:
        around_on_idle(lambda s: None, sched)
        n += 1
    return n


def test_a_scheduler_waiting_on_transfers_parks_between_passes(sockets):
    # a spinning loop makes ~10^5 passes in 0.3 s; parked, one per PARK_S at most
    assert loop_passes(scheduler(sockets[0])) <= 0.3 / PARK_S + 2


def test_runnable_work_or_no_sleep_on_idle_keeps_sglangs_loop(sockets):
    pull = sockets[0]
    assert loop_passes(scheduler(pull, waiting=["req"]), 0.1) > 1000
    assert loop_passes(scheduler(pull, running_empty=False), 0.1) > 1000
    assert loop_passes(scheduler(pull, sleeps=False), 0.1) > 1000  # SGLang without --sleep-on-idle


def test_a_request_or_a_status_change_ends_the_park_at_once(sockets):
    pull, push = sockets
    waker = Waker()
    park = Park([pull], waker)
    push.send(b"req")
    assert park.wait(timeout_s=5.0)
    pull.recv()
    threading.Timer(0.05, waker.wake).start()
    started = time.monotonic()
    assert park.wait(timeout_s=5.0) and time.monotonic() - started < 2.0
    assert not park.wait(timeout_s=0.02)  # drained: no stale wake-up


def test_many_wakes_leave_one_pending_byte():
    waker = Waker()
    for _ in range(100_000):  # more than a pipe holds: a byte per wake would block or fail
        waker.wake()
    park = Park([], waker)
    assert park.wait(timeout_s=1.0)
    assert not park.wait(timeout_s=0.01)


def test_a_managers_status_change_wakes_its_park(make_pd):
    pd = make_pd()
    park = Park([], pd.d.idle_waker)
    park.wait(timeout_s=0.0)  # whatever the construction woke
    pd.receiver(room=7)  # registers with the prefill: the room's status is set on the decode's manager
    assert park.wait(timeout_s=5.0)
