"""A receiver's replies count only for what was sent to it: looked up by (link, transfer id), an Ack only
for a chunk in flight on that link with its length, Done only after Close. And a transfer whose bytes a
whole window of later ones overtook stops counting the link's progress as its own. The sender is real;
the receivers are hand-driven ROUTER sockets on 127.0.0.1 (what a hostile or broken decode can send)."""

import threading
import time

import pytest
import zmq

from prfaas_sgl.transfer.config import PeerInfo, TransferConfig
from prfaas_sgl.transfer.messages import Ack, Chunk, Close, Codec, Done, Failed, Open, OpenAck
from prfaas_sgl.transfer.sender import ZmqSender
from prfaas_sgl.transfer.states import TransferState as S
from tests.support.transport import batch, fill_random, small_layout

LAYOUT = small_layout()  # 4 KV buffers of 64 pages × 4 KiB: one chunk per page and buffer
CFG = TransferConfig(connections=1, chunk_bytes=4096, window_bytes=8 * 4096, timeout_s=5.0)
SRC = fill_random(LAYOUT, seed=13)
PAGE = batch(LAYOUT, [1])  # 4 chunks
CODEC = Codec()


class StubReceiver:
    """A ROUTER that answers like a receiver only when told to; `run(policy)` answers on a thread."""

    def __init__(self) -> None:
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.linger = 0
        self.peer = PeerInfo("127.0.0.1", self.sock.bind_to_random_port("tcp://127.0.0.1"))
        self.ident = b""
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def recv(self, timeout: float = 5.0):
        assert self.sock.poll(int(timeout * 1000)), "nothing arrived"
        ident, header, *_ = self.sock.recv_multipart()
        self.ident = ident
        return CODEC.decode(header)

    def send(self, msg) -> None:
        self.sock.send_multipart([self.ident, CODEC.encode(msg)])

    def until(self, kind, timeout: float = 5.0):
        while True:
            msg = self.recv(timeout)
            if isinstance(msg, kind):
                return msg

    def run(self, ignore: set[int], ack_delay_s: float, answer_open: bool) -> None:
        """Answer like a correct receiver, except for transfers in `ignore`: never acknowledged (their
        Open answered only if `answer_open`)."""
        args = (ignore, ack_delay_s, answer_open)
        self._thread = threading.Thread(target=self._serve, args=args, daemon=True)
        self._thread.start()

    def _serve(self, ignore: set[int], delay: float, answer_open: bool) -> None:
        while not self._stop.is_set():
            if not self.sock.poll(50):
                continue
            msg = self.recv()
            if msg.transfer_id in ignore and not (answer_open and isinstance(msg, Open)):
                continue
            if isinstance(msg, Open):
                self.send(OpenAck(transfer_id=msg.transfer_id))
            elif isinstance(msg, Chunk):
                time.sleep(delay)
                self.send(Ack(transfer_id=msg.transfer_id, seq=msg.seq, length=msg.length))
            elif isinstance(msg, Close):
                self.send(Done(transfer_id=msg.transfer_id, nbytes=sum(msg.totals.values())))

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5)
        self.sock.close(0)
        self.ctx.term()


@pytest.fixture
def stubs():
    made: list[StubReceiver] = []
    yield lambda: made.append(StubReceiver()) or made[-1]
    for s in made:
        s.close()


@pytest.fixture
def tx():
    sender = ZmqSender(LAYOUT, SRC, CFG)
    yield sender
    sender.close()


def opened(tx, stub, tid, items=PAGE):
    """Send `tid` to `stub`, answer its Open, return its first chunk."""
    tx.send(tid, stub.peer, items, last=True)
    stub.until(Open)
    stub.send(OpenAck(transfer_id=tid))
    return stub.until(Chunk)


def in_flight(tx, stub) -> int:
    return tx.stats.snapshot()["links"][stub.peer.key()]["bytes_in_flight"]


def test_an_ack_of_bytes_never_sent_fails_its_transfer_and_returns_no_window(tx, stubs):
    """Before, Ack(length=10**9) made the link's bytes in flight negative (the window then never
    applied again) and the transfer went on."""
    stub = stubs()
    chunk = opened(tx, stub, 1)
    stub.send(Ack(transfer_id=1, seq=chunk.seq, length=10**9))
    s = tx.wait(1, 5)
    assert s.state is S.FAILED
    assert s.reason == (f"receiver acknowledged chunk {chunk.seq} with 1000000000 B, which is sent with 4096 B: "
                        "protocol violation")
    assert in_flight(tx, stub) == 0


def test_an_ack_of_a_chunk_not_in_flight_fails_its_transfer(tx, stubs):
    stub = stubs()
    opened(tx, stub, 2)
    stub.send(Ack(transfer_id=2, seq=99, length=4096))
    s = tx.wait(2, 5)
    assert (s.state, s.reason) == (S.FAILED, "receiver acknowledged chunk 99 with 4096 B, which is not in "
                                             "flight: protocol violation")


def test_done_before_close_fails_its_transfer(tx, stubs):
    stub = stubs()
    tx.send(3, stub.peer, PAGE)  # not the last piece: no Close yet
    stub.until(Open)
    stub.send(OpenAck(transfer_id=3))
    stub.send(Done(transfer_id=3, nbytes=0))
    s = tx.wait(3, 5)
    assert (s.state, s.reason) == (S.FAILED, "receiver reported Done before the sender sent Close: "
                                             "protocol violation")


def test_another_links_receiver_cannot_end_or_acknowledge_a_transfer(tx, stubs):
    """Receiver B (its own link, its own transfer 5) sends Done, Failed and an Ack for A's transfer 4;
    before, its Done made 4 DONE with nothing delivered. 4 must go on and end DONE by A's replies only."""
    a, b = stubs(), stubs()
    first = opened(tx, a, 4)
    opened(tx, b, 5)
    b.send(Ack(transfer_id=4, seq=first.seq, length=first.length))
    b.send(Failed(transfer_id=4, reason="not yours"))
    b.send(Done(transfer_id=4, nbytes=1))
    time.sleep(0.3)  # the sender's loop has read B's replies
    assert tx.poll(4).state is S.TRANSFERRING
    a.send(Ack(transfer_id=4, seq=first.seq, length=first.length))
    for _ in range(3):
        c = a.until(Chunk)
        a.send(Ack(transfer_id=4, seq=c.seq, length=c.length))
    close = a.until(Close)
    a.send(Done(transfer_id=4, nbytes=sum(close.totals.values())))
    s = tx.wait(4, 5)
    assert (s.state, s.nbytes) == (S.DONE, 4 * 4096)


@pytest.mark.parametrize("answer_open", [True, False], ids=["chunks_lost", "open_lost"])
def test_bytes_overtaken_by_a_window_of_later_ones_time_out_while_the_link_moves(stubs, answer_open):
    """The receiver answers transfers 6 and 8 but never 7's chunks (as when a dropped connection
    discarded them), or not even its Open. 8 keeps the link moving for ~2 s; once a window of bytes sent
    after 7's last message has been acknowledged, 7's own 0.5 s timeout runs again, so 7 ends TIMED_OUT
    while 8 is still transferring (counting the link's progress for 7 forever would end it at the cap)."""
    stub = stubs()
    tx = ZmqSender(LAYOUT, SRC, CFG.replace(timeout_s=0.5))
    try:
        stub.run(ignore={7}, ack_delay_s=0.05, answer_open=answer_open)
        tx.send(6, stub.peer, PAGE, last=True)
        tx.send(7, stub.peer, batch(LAYOUT, [2]), last=True)
        tx.send(8, stub.peer, batch(LAYOUT, list(range(10, 20))), last=True)  # 40 chunks, ~2 s
        s7 = tx.wait(7, 10)
        s8_then = tx.poll(8).state
        assert s7.state is S.TIMED_OUT, s7.reason
        assert s8_then is S.TRANSFERRING
        assert tx.wait(8, 10).state is S.DONE
        assert tx.poll(6).state is S.DONE
    finally:
        tx.close()
