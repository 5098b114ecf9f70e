"""The interface higher layers (the SGLang backend, the router's tests) program against.

`ZmqSender`/`ZmqReceiver` implement it over the network; tests/support/fake_transport.py in process (a test
double, so it lives with the tests). A `Transport` builds one side of either kind: the SGLang backend takes
one (default `ZmqTransport`), so its room/status logic runs in fast tests over the fake.
Contract, both sides: calls are thread-safe and never block on the network; `poll()` is cheap and
returns the latest `TransferStatus`; a terminal status never changes; `release()` forgets a transfer.
`fatal` is None while the side works and the reason once its loop thread died (then every pending
transfer reads FAILED and no new one can succeed): a health check reports it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

from prfaas_sgl.transfer.config import PeerInfo, TransferConfig
from prfaas_sgl.transfer.items import ItemBatch
from prfaas_sgl.transfer.layout import MemoryLayout
from prfaas_sgl.transfer.states import TransferStatus


class KVReceiver(Protocol):
    layout: MemoryLayout
    address: PeerInfo

    @property
    def fatal(self) -> str | None: ...

    def expect(self, transfer_id: int, batch: ItemBatch, timeout_s: float | None = None) -> None:
        """Pre-register the destination items; bytes land there in per-buffer stream order."""

    def poll(self, transfer_id: int) -> TransferStatus: ...

    def wait(self, transfer_id: int, timeout: float) -> TransferStatus: ...

    def abort(self, transfer_id: int, reason: str = ...) -> None: ...

    def release(self, transfer_id: int) -> None: ...

    def close(self) -> None: ...


class KVSender(Protocol):
    layout: MemoryLayout

    @property
    def fatal(self) -> str | None: ...

    @property
    def worker_fatal(self) -> str | None:
        """Why a helper thread of the sender (stager, stats server) died, or None; `fatal` is the loop's."""

    def send(self, transfer_id: int, peer: PeerInfo, batch: ItemBatch, last: bool = False,
             timeout_s: float | None = None) -> None:
        """Queue source items; call once per finished prefill chunk, `last=True` with states + aux."""

    def poll(self, transfer_id: int) -> TransferStatus: ...

    def wait(self, transfer_id: int, timeout: float) -> TransferStatus: ...

    def abort(self, transfer_id: int, reason: str = ...) -> None: ...

    def release(self, transfer_id: int) -> None: ...

    def close(self) -> None: ...


class Transport(Protocol):
    """Builds a server's data-plane side over its pool `buffers`. `opts` are the real transport's keyword
    arguments (sender: faults, stats_port, stats_host, devices, on_terminal; receiver: host, port, faults,
    devices)."""

    def sender(self, layout: MemoryLayout, buffers: Sequence[Any], cfg: TransferConfig, **opts: Any) -> KVSender: ...

    def receiver(self, layout: MemoryLayout, buffers: Sequence[Any], cfg: TransferConfig,
                 **opts: Any) -> KVReceiver: ...


class ZmqTransport:
    """The real data plane: `ZmqSender` / `ZmqReceiver` (imported on use: zmq, threads)."""

    def sender(self, layout: MemoryLayout, buffers: Sequence[Any], cfg: TransferConfig, **opts: Any) -> KVSender:
        from prfaas_sgl.transfer.sender import ZmqSender

        return ZmqSender(layout, buffers, cfg, **opts)

    def receiver(self, layout: MemoryLayout, buffers: Sequence[Any], cfg: TransferConfig,
                 **opts: Any) -> KVReceiver:
        from prfaas_sgl.transfer.receiver import ZmqReceiver

        return ZmqReceiver(layout, buffers, cfg, **opts)
