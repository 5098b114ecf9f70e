"""What the receiver hardening tests share: the layout and config, a hand-driven wire peer (an attacker
or a minimal sender) and the check that a receiver still serves after an attack."""

import itertools

import numpy as np
import xxhash
import zmq

from prfaas_sgl.transfer.config import TransferConfig
from prfaas_sgl.transfer.items import ItemBatch, Items
from prfaas_sgl.transfer.messages import Chunk, Close, Codec, Open
from prfaas_sgl.transfer.sender import ZmqSender
from prfaas_sgl.transfer.states import TransferState as S
from tests.support.transport import batch, read_items, small_layout

LAYOUT = small_layout()  # kv buffers 0..3 of 64 pages × 4 KiB
PAGE = 4096
CFG = TransferConfig(connections=2, chunk_bytes=8192, window_bytes=65536, timeout_s=10)
SRC_SEED = 11
IDS = itertools.count(1)  # one counter for every module: transfer ids never repeat on a shared receiver
CODEC = Codec()


def assert_serving(rx, src, pages=(40, 41, 42)):
    """The receiver is alive and a legitimate transfer after the attack lands exactly."""
    tid, items = next(IDS), batch(LAYOUT, list(pages))
    rx.call("expect", tid, items)
    tx = ZmqSender(LAYOUT, src, CFG)
    try:
        tx.send(tid, rx.address, items, last=True)
        assert tx.wait(tid, 10).state is S.DONE
    finally:
        tx.close()
    assert rx.call("wait", tid, 10).state is S.DONE
    assert rx.call("read", items) == read_items(src, LAYOUT, items)


class RawPeer:
    """A hand-driven DEALER speaking the wire protocol, as an attacker (or a minimal sender) would."""

    def __init__(self, rx, routing_id: bytes | None = None, source_ip: str | None = None) -> None:
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        if routing_id is not None:
            self.sock.setsockopt(zmq.ROUTING_ID, routing_id)
        source = f"{source_ip}:0;" if source_ip else ""
        self.sock.connect(f"tcp://{source}{rx.address.host}:{rx.address.port}")

    def open(self, tid: int) -> None:
        self.sock.send(CODEC.encode(Open(transfer_id=tid, layout=LAYOUT)))

    def chunk(self, tid: int, seq: int, offset: int, payload: bytes, buffer_id: int = 0) -> None:
        header = Chunk(transfer_id=tid, seq=seq, buffer_id=buffer_id, offset=offset, length=len(payload),
                       nframes=1, checksum=xxhash.xxh3_64_intdigest(payload))
        self.sock.send_multipart([CODEC.encode(header), payload])

    def close_transfer(self, tid: int, nchunks: int, total: int) -> None:
        self.sock.send(CODEC.encode(Close(transfer_id=tid, nchunks=nchunks, totals={0: total})))

    def replies(self, n: int, timeout: float = 10.0) -> list:
        out = []
        for _ in range(n):
            assert self.sock.poll(int(timeout * 1000)), f"no reply after {out}"
            out.append(CODEC.decode(self.sock.recv()))
        return out

    def stop(self) -> None:
        self.sock.close(0)
        self.ctx.term()


def buffer0(pages) -> ItemBatch:
    """Pages of K buffer 0 only: one stream a hand-driven peer can fill chunk by chunk."""
    return ItemBatch((Items((0,), np.asarray(list(pages))),))


def payload(seed: int, n: int = PAGE) -> bytes:
    return np.random.default_rng(seed).integers(1, 256, n, dtype=np.uint8).tobytes()
