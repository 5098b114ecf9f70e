"""A PD scheduler that has nothing to run but waits on prfaas_zmq transfers parks instead of spinning.

SGLang 0.5.23's `Scheduler.on_idle` sleeps (with `--sleep-on-idle`) only when the server is *fully* idle.
A decode whose requests wait for their KV, or a prefill whose requests wait for their decode or for their
transfer to finish, is not: `on_idle` returns after `time.sleep(0)` and the loop spins at a whole core for
the whole wait. A decode waits through its prefill's whole forward, so where the two share cores (every
CPU run of this project, the demo) that spin takes a core from the very forward it waits for: a 7,936-token
prompt's PD TTFT was ~3.7 s over the colocated one, the prefill's chunks running 3-7x slower than the
colocated server's.

With `--sleep-on-idle` (SGLang's own "reduce CPU usage when idle") and our manager, such a scheduler
waits instead until the first of:

    a request or RPC on the scheduler's own sockets   (the sockets SGLang's IdleSleeper polls)
    a room status change in our manager               (`Waker`: Bootstrapping -> WaitingForInput, Success,
                                                       Failed; written by the control/watch threads)
    PARK_S                                            (anything else: SGLang's timeouts, a receiver that
                                                       verifies after the prefill's Success, memory freed)

so a status change costs no latency and anything unsignalled at most PARK_S.
"""
from __future__ import annotations

import os

import zmq

ON_IDLE = "sglang.srt.managers.scheduler.Scheduler.on_idle"
PARK_S = 0.01
_PARK = "_prfaas_idle_park"  # the scheduler's cached Park (or False: this scheduler never parks)


class Waker:
    """A self-pipe: `wake()` from any thread makes `fileno()` readable until `drain()`. At most one byte is
    pending, so a flood of status changes never fills the pipe."""

    def __init__(self) -> None:
        self._r, self._w = os.pipe()
        os.set_blocking(self._r, False)
        os.set_blocking(self._w, False)
        self._pending = False

    def fileno(self) -> int:
        return self._r

    def wake(self) -> None:
        if self._pending:
            return
        self._pending = True
        try:
            os.write(self._w, b"\0")
        except BlockingIOError:
            pass

    def drain(self) -> None:
        # clear the flag first: a wake between the two reads leaves its byte for the next park (which then
        # returns at once) or has it read here; either way the scheduler's next poll sees the new status
        self._pending = False
        try:
            while os.read(self._r, 64):
                pass
        except BlockingIOError:
            pass


class Park:
    """One scheduler's wait: its request sockets and its manager's waker, polled together."""

    def __init__(self, sockets: list[zmq.Socket], waker: Waker) -> None:
        self.poller = zmq.Poller()
        for s in sockets:
            self.poller.register(s, zmq.POLLIN)
        self.poller.register(waker.fileno(), zmq.POLLIN)
        self.waker = waker

    def wait(self, timeout_s: float = PARK_S) -> bool:
        """Block until a socket or the waker is readable, or `timeout_s`; True when woken."""
        woken = bool(self.poller.poll(int(timeout_s * 1000)))
        self.waker.drain()
        return woken


def register(HookRegistry, HookType) -> None:
    HookRegistry.register(ON_IDLE, around_on_idle, HookType.AROUND)


def around_on_idle(original, scheduler, *args, **kwargs):
    out = original(scheduler, *args, **kwargs)
    park = _park_of(scheduler)
    if park is not None and _waits_on_transfers_only(scheduler):
        park.wait()
    return out


def _park_of(scheduler) -> Park | None:
    park = getattr(scheduler, _PARK, None)
    if park is None:
        park = _make_park(scheduler) or False
        setattr(scheduler, _PARK, park)
    return park or None


def _make_park(scheduler) -> Park | None:
    """A Park for a PD scheduler of ours that SGLang lets sleep (`--sleep-on-idle`, the rank that holds the
    request sockets); None for every other scheduler, which keeps SGLang's loop as it is."""
    sleeper = getattr(scheduler, "idle_sleeper", None)
    waker = getattr(_manager_of(scheduler), "idle_waker", None)
    poller = getattr(sleeper, "poller", None)
    if waker is None or poller is None:
        return None
    return Park([s for s, _ in poller.sockets], waker)


def _manager_of(scheduler):
    for queue in ("disagg_decode_prealloc_queue", "disagg_prefill_bootstrap_queue"):
        mgr = getattr(getattr(scheduler, queue, None), "kv_manager", None)
        if mgr is not None:
            return mgr
    return None


def _waits_on_transfers_only(scheduler) -> bool:
    """Nothing runnable: no running batch, no chunked request, an empty waiting queue (what remains is
    in the disaggregation queues, which only a transfer, a handshake or a timeout moves on)."""
    running = getattr(scheduler, "running_batch", None)
    return (running is None or running.is_empty()) and getattr(scheduler, "chunked_req", None) is None \
        and not getattr(scheduler, "waiting_queue", None)
