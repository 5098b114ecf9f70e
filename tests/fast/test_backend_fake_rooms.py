"""The prfaas_zmq backend's room/status logic end to end over the fake transport (backend_fake_pd.py):
SGLang's per-request sender and receiver on real managers, as the schedulers call them. Each test names the
code it guards."""
from __future__ import annotations

import threading

import numpy as np
import pytest

pytest.importorskip("sglang", reason="the backend subclasses SGLang's KV manager")

from sglang.srt.disaggregation.common.conn import KVTransferError  # noqa: E402

from prfaas_sgl.transfer.api import ZmqTransport  # noqa: E402
from prfaas_sgl.transfer.states import TransferState as S  # noqa: E402

from .backend_fake_pd import PAGE, KVPoll, make_pd, until  # noqa: E402,F401 - make_pd is a fixture

ROOM = 901
DST, SRC = np.array([9, 3, 12, 5], np.int32), np.array([1, 2, 7, 8], np.int32)  # pages, request order


def _bootstrapped(pd, room=ROOM, npages=4):
    """Both sides of one request, the decode's Metadata delivered: the prefill may start sending."""
    tx, rx = pd.sender(room, npages), pd.receiver(room)
    assert tx.poll() == KVPoll.Bootstrapping and rx.poll() == KVPoll.WaitingForInput
    rx.send_metadata(DST, aux_index=3)
    assert until(tx.poll, KVPoll.WaitingForInput) == KVPoll.WaitingForInput  # via the control thread
    return tx, rx


def test_request_goes_bootstrapping_waiting_transferring_success(make_pd):
    """prefill.add_transfer_request / _watch_step and decode.check_status: Success on both sides once
    every byte landed, pages in request order and the aux row."""
    pd = make_pd()
    tx, rx = _bootstrapped(pd)
    tx.send(SRC[:2])
    assert tx.poll() == KVPoll.Transferring and rx.poll() == KVPoll.WaitingForInput
    tx.send(SRC[2:])
    assert until(tx.poll, KVPoll.Success) == KVPoll.Success  # the sender's on_terminal wakes the watch thread
    assert until(rx.poll, KVPoll.Success) == KVPoll.Success  # the prefill's status message
    for b in (0, 1):
        assert np.array_equal(pd.dst[b].reshape(-1, PAGE)[DST], pd.src[b].reshape(-1, PAGE)[SRC])
    assert np.array_equal(pd.dst[2].reshape(8, -1)[3], pd.src[2].reshape(8, -1)[1])
    tx.clear()
    rx.clear()
    # the watch thread releases its transfer after it reports Success: under load that comes a moment later
    assert until(lambda: pd.p.sender.poll(pd.tid(ROOM)).state, S.UNKNOWN) is S.UNKNOWN
    assert pd.d.receiver.poll(pd.tid(ROOM)).state is S.UNKNOWN  # clear() → forget(): pages may be reused


def test_decode_waits_for_its_own_verification(make_pd):
    """decode.check_status: the prefill's Success alone does not make the request Success."""
    pd = make_pd()
    tx, rx = _bootstrapped(pd)
    pd.net.hold(pd.tid(ROOM))  # the bytes never arrive
    tx.send(SRC)
    pd.d.apply_prefill_status(bootstrap_room=ROOM, status=KVPoll.Success, prefill_rank=0)
    assert rx.poll() == KVPoll.Transferring
    assert rx.poll() == KVPoll.Transferring  # still: SGLang must not read the pages yet


def test_transport_failure_fails_both_sides_with_its_reason(make_pd):
    """states.first_failure on both managers, reasons through failure() (failure_exception)."""
    pd = make_pd()
    tx, rx = _bootstrapped(pd)
    pd.net.fail(pd.tid(ROOM), "link down")
    tx.send(SRC)
    assert until(tx.poll, KVPoll.Failed) == KVPoll.Failed
    with pytest.raises(KVTransferError, match="prfaas_zmq transfer failed: link down"):
        tx.failure_exception()
    assert until(rx.poll, KVPoll.Failed) == KVPoll.Failed
    with pytest.raises(KVTransferError, match="link down"):
        rx.failure_exception()
    assert pd.d.receiver.poll(pd.tid(ROOM)).state is S.UNKNOWN  # released by the clear in failure()


def test_decode_abort_recycles_the_room_on_both_sides(make_pd):
    """PrfaasKVReceiver.abort → forget, prefill._on_control's abort → watch drops the room and releases
    its transfer; the same room id then serves a new request."""
    pd = make_pd()
    tx, rx = _bootstrapped(pd)
    tx.send(SRC[:2])
    rx.abort()
    assert rx.poll() == KVPoll.Failed
    assert pd.d.receiver.poll(pd.tid(ROOM)).state is S.UNKNOWN  # no transfer left writing into its pages
    assert until(tx.poll, KVPoll.Failed) == KVPoll.Failed
    with pytest.raises(KVTransferError, match="aborted by decode"):
        tx.failure_exception()
    assert until(lambda: pd.p.sender.poll(pd.tid(ROOM)).state, S.UNKNOWN) is S.UNKNOWN
    assert ROOM not in pd.p._open
    rx.clear()
    tx, rx = _bootstrapped(pd)
    tx.send(SRC)
    assert until(rx.poll, KVPoll.Success) == KVPoll.Success


def test_decode_whose_prefill_never_answers_fails_within_its_timeout(make_pd):
    """decode.expect's deadline covers the waiting timeout; SGLang's waiting timeout fails the request
    first, with its reason, and clear() releases the destination."""
    pd = make_pd(waiting_timeout_s=1, zmq_timeout_s=0.5)
    rx = pd.receiver(ROOM)
    rx.send_metadata(DST, aux_index=3)
    assert pd.d.receiver.entry(pd.tid(ROOM)).timeout_s == 1.5  # waiting + transfer timeout
    assert until(rx.poll, KVPoll.Failed, timeout=3.0) == KVPoll.Failed
    with pytest.raises(KVTransferError, match="timed out"):
        rx.failure_exception()
    assert pd.d.receiver.poll(pd.tid(ROOM)).state is S.UNKNOWN


def test_prefill_sending_more_pages_than_the_decode_allocated_fails_with_why(make_pd):
    """prefill._overflow: the room fails before a byte moves, and the decode learns why."""
    pd = make_pd()
    tx, rx = _bootstrapped(pd, npages=6)
    tx.send(np.arange(6, dtype=np.int32))
    assert tx.poll() == KVPoll.Failed
    assert until(rx.poll, KVPoll.Failed) == KVPoll.Failed
    with pytest.raises(KVTransferError, match="allocated 4 pages"):
        rx.failure_exception()


def test_the_managers_default_to_the_zeromq_transport(make_pd):
    pd = make_pd(fake=False)
    assert isinstance(pd.p.transport, ZmqTransport) and isinstance(pd.d.transport, ZmqTransport)
    assert type(pd.p.sender).__name__ == "ZmqSender" and type(pd.d.receiver).__name__ == "ZmqReceiver"


def test_a_dead_sender_helper_thread_makes_the_prefill_fatal(make_pd):
    """The stager and stats threads live in the sender, not in the manager's own threads: without the sender's
    `worker_fatal` among the manager's fatal sources, a dead stager failed every send after its timeout while
    the server's /health stayed 200."""
    pd = make_pd()
    stopped = threading.Event()
    pd.p.stop_server = stopped.set  # the watchdog's SIGQUIT to the launcher (here: pytest's parent)
    assert pd.p.fatal() is None
    pd.p.sender.worker_fatal = "transfer-stage thread died: RuntimeError: boom"
    assert "transfer-stage thread died" in pd.p.fatal()
    assert stopped.wait(5)  # the watchdog (every 0.05 s here) takes the server down
