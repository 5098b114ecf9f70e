"""ZeroMQ KV-cache data plane (no sglang, no torch): moves a request's pages and state slots from
prefill memory into decode memory over N TCP connections, checksummed, windowed, optionally CURVE.

    layout = kv_layout(num_layers=4, page_bytes=65536, num_pages=1024, state_bytes=[...], num_slots=8)
    rx = ZmqReceiver(layout, dst_buffers, cfg); rx.expect(tid, page_regions(layout, dst_pages))
    tx = ZmqSender(layout, src_buffers, cfg);   tx.send(tid, rx.address, page_regions(layout, src_pages),
                                                        last=True)
    rx.wait(tid, 10).ok
"""

from prfaas_sgl.transfer.config import PeerInfo, TransferConfig
from prfaas_sgl.transfer.layout import (BufferSpec, MemoryLayout, Region, coalesce, item_regions, kv_layout,
                                        page_regions, tail_regions)
from prfaas_sgl.transfer.states import TransferState, TransferStatus

__all__ = [
    "BufferSpec", "MemoryLayout", "PeerInfo", "Region", "TransferConfig", "TransferState", "TransferStatus",
    "coalesce", "item_regions", "kv_layout", "page_regions", "tail_regions", "ZmqReceiver", "ZmqSender",
]


def __getattr__(name: str):
    # zmq-using classes load lazily so that importing layout/config stays cheap
    if name == "ZmqReceiver":
        from prfaas_sgl.transfer.receiver import ZmqReceiver
        return ZmqReceiver
    if name == "ZmqSender":
        from prfaas_sgl.transfer.sender import ZmqSender
        return ZmqSender
    raise AttributeError(name)
