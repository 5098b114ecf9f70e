"""Configuration of the ZeroMQ KV data plane: one frozen record per process, validated on creation."""

from __future__ import annotations

import dataclasses
import ipaddress
import os
from dataclasses import dataclass

MIB = 1 << 20


@dataclass(frozen=True, slots=True)
class TransferConfig:
    """Knobs shared by `ZmqSender` and `ZmqReceiver`.

    connections: TCP connections per sender→receiver pair; chunks are striped across them.
    chunk_bytes: largest payload of one chunk message (bytes); one checksum and one ack per chunk.
    window_bytes: un-acknowledged chunk bytes allowed per peer; bounds the memory both ends hold in
        ZeroMQ queues (the sender's frames are zero-copy views, the receiver's are real copies).
    Defaults from scripts/bench_transfer.py (helper-notes/transfer.md): 4 connections reach 0.95 of a
    1 Gbit/s tbf link at any chunk size; 1 MiB chunks cost ~0.3 s/GB less CPU than 256 KiB and keep CURVE
    fast; a 128 MiB window rode out scheduling stalls at 5 Gbit/s better than 32 MiB (median 0.95 vs 0.91).
    timeout_s: default deadline of a transfer, from `expect()` / the first `send()`.
    keys_dir: directory with CurveZMQ keys (see `security.py`); None = plaintext, no authentication.
    io_threads: ZeroMQ I/O threads per context.
    """

    connections: int = 4
    chunk_bytes: int = 1 * MIB
    window_bytes: int = 128 * MIB
    timeout_s: float = 60.0
    keys_dir: str | None = None
    io_threads: int = 1
    send_timeout_ms: int = 1000
    reconnect_ivl_ms: int = 100
    hwm_messages: int = 1000

    def __post_init__(self) -> None:
        if not 1 <= self.connections <= 64:
            raise ValueError(f"connections={self.connections}: use 1..64 TCP connections per peer")
        if not 4096 <= self.chunk_bytes <= 256 * MIB:
            raise ValueError(f"chunk_bytes={self.chunk_bytes}: use 4 KiB..256 MiB (1 MiB is a good start)")
        if self.window_bytes < self.chunk_bytes:
            raise ValueError(
                f"window_bytes={self.window_bytes} < chunk_bytes={self.chunk_bytes}: raise window_bytes "
                "to at least one chunk, better connections × chunk_bytes × 2"
            )
        if self.timeout_s <= 0:
            raise ValueError(f"timeout_s={self.timeout_s}: must be > 0 seconds")
        if self.keys_dir is not None and not os.path.isdir(self.keys_dir):
            raise ValueError(f"keys_dir={self.keys_dir!r} is not a directory: create it with "
                             "`python -m prfaas_sgl.transfer.security KEYS_DIR`")
        if not 1 <= self.io_threads <= 16:
            raise ValueError(f"io_threads={self.io_threads}: use 1..16")

    def replace(self, **changes: object) -> "TransferConfig":
        return dataclasses.replace(self, **changes)


@dataclass(frozen=True, slots=True)
class PeerInfo:
    """Where a receiver listens. `server_key` is its CURVE public key (z85 text) when CURVE is on."""

    host: str
    port: int
    server_key: str | None = None

    @property
    def endpoint(self) -> str:
        return f"tcp://{self.host}:{self.port}"

    def problem(self) -> str | None:
        """A reason this address cannot be used, or None. Checked without touching the network."""
        if not isinstance(self.port, int) or not 1 <= self.port <= 65535:
            return f"bad peer port {self.port!r} (need 1..65535)"
        try:
            ipaddress.ip_address(self.host)
        except ValueError:
            return f"bad peer host {self.host!r} (need a numeric IP address)"
        return None

    def key(self) -> str:
        return f"{self.host}:{self.port}"
