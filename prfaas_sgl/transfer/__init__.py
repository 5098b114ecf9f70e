"""ZeroMQ KV-cache data plane (no sglang): moves a request's pages and state slots from prefill memory
into decode memory over N TCP connections, checksummed, windowed, optionally CURVE.

    from prfaas_sgl.transfer.items import ItemBatch, Items   # what moves: item ids per buffer group
    layout = kv_layout(num_layers=4, page_bytes=65536, num_pages=1024, state_bytes=[...], num_slots=8)
    kv = tuple(layout.ids_of("kv"))
    rx = ZmqReceiver(layout, dst_buffers, cfg); rx.expect(tid, ItemBatch((Items(kv, dst_pages),)))
    tx = ZmqSender(layout, src_buffers, cfg);   tx.send(tid, rx.address, ItemBatch((Items(kv, src_pages),)),
                                                        last=True)
    rx.wait(tid, 10).ok
"""
from prfaas_sgl.transfer.config import PeerInfo, TransferConfig
from prfaas_sgl.transfer.layout import BufferSpec, MemoryLayout, kv_layout
from prfaas_sgl.transfer.states import TransferState, TransferStatus

__all__ = [
    "BufferSpec", "MemoryLayout", "PeerInfo", "TransferConfig", "TransferState", "TransferStatus", "kv_layout",
    "ZmqReceiver", "ZmqSender",
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
