"""Configuration of the ZeroMQ KV data plane: one frozen record per process, validated on creation."""

from __future__ import annotations

import dataclasses
import ipaddress
import os
from dataclasses import dataclass

from prfaas_sgl.cliargs import FieldError, knob

MIB = 1 << 20
MIN_CHUNK_BYTES = 4096  # smallest chunk_bytes a sender may use: receivers refuse shorter chunks mid-stream
# CurveZMQ public keys in text form: 32 bytes as 40 Z85 characters
_Z85 = frozenset("0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ.-:+=^!/*?&<>()[]{}@%$#")


@dataclass(frozen=True, slots=True)
class TransferConfig:
    """Knobs shared by `ZmqSender` and `ZmqReceiver`.

    connections: TCP connections per sender→receiver pair; chunks are striped across them.
    chunk_bytes: largest payload of one chunk message (bytes); one checksum and one ack per chunk.
    window_bytes: un-acknowledged chunk bytes allowed per peer; bounds the memory both ends hold in
        ZeroMQ queues (the sender's frames are zero-copy views, the receiver's are real copies).
    Defaults from scripts/bench_transfer.py (docs/benchmarks.md): 4 connections reach 0.95 of a
    1 Gbit/s tbf link at any chunk size; 1 MiB chunks cost ~0.3 s/GB less CPU than 256 KiB and keep CURVE
    fast; a 128 MiB window rode out scheduling stalls at 5 Gbit/s better than 32 MiB (median 0.95 vs 0.91).
    timeout_s: no-progress deadline of a transfer (seconds). The sender's is refreshed by every send(),
        OpenAck and Ack of the transfer, and by Acks of others on its link while its own messages still
        wait there, queued or sent behind others' bytes, until its last byte is acknowledged (a queue
        that moves must not time out; `send_book` says when waiting bytes count as lost). The receiver's (`expect()`'s
        timeout_s, which the decode sets to its waiting timeout + this) by every accepted Open, Chunk
        and Close: it is longer, since Open comes at the sender's first send() but the chunks may queue
        behind other transfers on the link, so the sender, which sees the queue, decides first.
    min_rate_bytes_s, cap_slack_s: both sides' absolute cap (`cap_s`), so a peer that trickles cannot
        hold a transfer forever: it fails once it has lived cap_slack_s + bytes / min_rate_bytes_s
        seconds, on the sender since its first send() over the bytes queued so far (the cap grows
        with the transfer), on the receiver since the Open over all bytes expected (never before the
        sender's own cap, when both use the same values). The slack covers the chunked prefill's
        compute between sends and queueing behind other transfers (a 128K-token prompt computes for
        ~22 s on an H20); 1 MiB/s is far below any link PrfaaS targets. Together they end only
        pathological trickles. min_rate_bytes_s=None: no cap.
    keys_dir: directory with CurveZMQ keys (see `security.py`); None = plaintext, no authentication.
    io_threads: ZeroMQ I/O threads per context.
    max_links: sender links (sockets to one receiver) kept open while unused; creating one more closes
        the least recently used idle link. Links with transfers in flight are never closed.
    link_idle_s: a sender link unused for this long is closed (decodes come and go; each link holds
        3 sockets per connection and redials a dead peer forever).
    max_sockets: ZeroMQ socket limit per context (libzmq's default is 1023), capped by the fd limit.
    stage_slots: ring slots of chunk_bytes each of the staged path (ItemBatch sends; pinned host memory
        on GPUs), per sender and per receiver with a device pool: 64 × 1 MiB keeps the link busy while
        libzmq holds sent frames, and a full ring pushes back on the stager thread, never the scheduler.
    reconnect_ivl_max_ms: ZeroMQ's reconnect back-off ceiling towards an unreachable peer.
    stats_token: bearer token the sender's stats endpoint requires of every request (None: clients on
        this machine see everything, others only sums over destinations; see `stats.StatsServer`).
        At least 16 characters; kept out of repr.
    """

    # the first four are also the --prfaas-zmq-* flags (prfaas_sgl/config.py nests this class)
    connections: int = knob(4, "TCP connections per prefill->decode pair for prfaas_zmq.")
    chunk_bytes: int = knob(1 * MIB, "Bytes per striped chunk on the prfaas_zmq data plane.")
    window_bytes: int = knob(128 * MIB, "Max bytes in flight per transfer before the sender waits for "
                                        "acknowledgements (backpressure).")
    timeout_s: float = knob(30.0, "A transfer that makes no progress for this long fails.")
    min_rate_bytes_s: float | None = 1 * MIB
    cap_slack_s: float = 600.0
    keys_dir: str | None = None
    io_threads: int = 1
    send_timeout_ms: int = 1000
    reconnect_ivl_ms: int = 100
    reconnect_ivl_max_ms: int = 1000
    hwm_messages: int = 1000
    max_links: int = 64
    link_idle_s: float = 300.0
    max_sockets: int = 16384
    stage_slots: int = 64
    stats_token: str | None = dataclasses.field(default=None, repr=False)

    def __post_init__(self) -> None:
        if not 1 <= self.connections <= 64:
            raise FieldError("connections", f"connections={self.connections}: use 1..64 TCP connections per peer")
        if not MIN_CHUNK_BYTES <= self.chunk_bytes <= 256 * MIB:
            raise FieldError("chunk_bytes",
                             f"chunk_bytes={self.chunk_bytes}: use 4 KiB..256 MiB (1 MiB is a good start)")
        if self.window_bytes < self.chunk_bytes:
            raise FieldError(
                "window_bytes", f"window_bytes={self.window_bytes} < chunk_bytes={self.chunk_bytes}: raise "
                "window_bytes to at least one chunk, better connections × chunk_bytes × 2"
            )
        if self.timeout_s <= 0:
            raise FieldError("timeout_s", f"timeout_s={self.timeout_s}: must be > 0 seconds")
        if self.min_rate_bytes_s is not None and self.min_rate_bytes_s <= 0:
            raise ValueError(f"min_rate_bytes_s={self.min_rate_bytes_s}: must be > 0 bytes/s, or None for no cap")
        if self.cap_slack_s <= 0:
            raise ValueError(f"cap_slack_s={self.cap_slack_s}: must be > 0 seconds")
        if self.keys_dir is not None and not os.path.isdir(self.keys_dir):
            raise ValueError(f"keys_dir={self.keys_dir!r} is not a directory: create it with "
                             "`python -m prfaas_sgl.transfer.security KEYS_DIR`")
        if not 1 <= self.io_threads <= 16:
            raise ValueError(f"io_threads={self.io_threads}: use 1..16")
        self._check_links()

    def _check_links(self) -> None:
        if self.max_links < 1:
            raise ValueError(f"max_links={self.max_links}: keep at least 1 link")
        if self.link_idle_s <= 0:
            raise ValueError(f"link_idle_s={self.link_idle_s}: must be > 0 seconds")
        if not 2 <= self.stage_slots <= 4096:
            raise ValueError(f"stage_slots={self.stage_slots}: use 2..4096 ring slots of chunk_bytes")
        if not 64 <= self.max_sockets <= 1 << 20:
            raise ValueError(f"max_sockets={self.max_sockets}: use 64..1048576")
        token = self.stats_token
        if token is not None and (not isinstance(token, str) or len(token) < 16 or not token.isprintable()
                                  or not token.isascii() or " " in token):
            raise ValueError("stats_token: use at least 16 printable ASCII characters without spaces "
                             "(e.g. `python -c 'import secrets; print(secrets.token_urlsafe(32))'`)")
        if self.reconnect_ivl_max_ms < self.reconnect_ivl_ms:
            raise ValueError(f"reconnect_ivl_max_ms={self.reconnect_ivl_max_ms} < reconnect_ivl_ms="
                             f"{self.reconnect_ivl_ms}: the back-off ceiling must be at least the first interval")

    def cap_s(self, nbytes: int) -> float | None:
        """Longest life (seconds) of a transfer of `nbytes`; None = uncapped. The one formula both sides use."""
        rate = self.min_rate_bytes_s
        return None if rate is None else self.cap_slack_s + nbytes / rate

    def cap_text(self, nbytes: int) -> str:
        """`cap_s(nbytes)` spelled out, for timeout reasons (operators tune these two knobs from it)."""
        return (f"cap of {self.cap_s(nbytes):.3g} s (cap_slack_s={self.cap_slack_s:g} + {nbytes} B at "
                f"min_rate_bytes_s={self.min_rate_bytes_s:g})")

    def replace(self, **changes: object) -> "TransferConfig":
        return dataclasses.replace(self, **changes)


@dataclass(frozen=True, slots=True)
class LayerwiseConfig:
    """Layer-group streaming of a prefill chunk's K/V (`transfer/gates.py`, `srt/backend/layerwise.py`).

    layers_per_group: full-attention layers whose K/V leave together as soon as the last of them ran;
        0 = off: every chunk leaves after its forward (the chunk path).
    min_tokens: prompts shorter than this keep the chunk path, and so does every batch holding one
        (a short prompt's forward is too short for its groups to overlap with anything).
    Off by default: scripts/bench_layerwise.py (docs/benchmarks.md) measured no consistent TTFT gain on CPU
    servers with a 2-layer model, whose chunk forward (~0.2 s) is the most its groups can overlap.
    """

    layers_per_group: int = knob(0, "Layer-wise KV streaming on a prfaas_zmq prefill: full-attention layers "
                                    "per group that leaves while later layers compute (0 = off: each chunk "
                                    "leaves after its forward).")
    min_tokens: int = knob(4096, "Layer-wise streaming only for prompts of at least this many tokens; batches "
                                 "with a shorter prompt keep the chunk path.")

    def __post_init__(self) -> None:
        if not 0 <= self.layers_per_group <= 1024:
            raise FieldError("layers_per_group", f"layers_per_group={self.layers_per_group}: use 0 (off) or "
                             "1..1024 layers per group")
        if self.min_tokens < 1:
            raise FieldError("min_tokens", f"min_tokens={self.min_tokens}: use >= 1 token")

    @property
    def on(self) -> bool:
        return self.layers_per_group > 0


@dataclass(frozen=True, slots=True)
class OptimisticConfig:
    """SGLang's optimistic prefill (`--optimistic-prefill-attempts`) on a prfaas_zmq prefill: a request is
    computed before its decode's handshake arrived and its KV is held in the prefill's pool until then
    (`srt/backend/optimistic.py`, counted in /stats under `optimistic`).

    max_held_tokens: prompt tokens that requests computed or computing ahead of their decode may hold;
        a request that would pass it is not started ahead and waits for its decode, as without optimistic
        prefill. 0 = no cap (SGLang's own behaviour: only its pool bounds them).
    """

    max_held_tokens: int = knob(0, "Optimistic prefill on a prfaas_zmq prefill: prompt tokens that requests "
                                   "computed ahead of their decode's handshake may hold; past it a request "
                                   "waits for its decode (0 = no cap).")

    def __post_init__(self) -> None:
        if self.max_held_tokens < 0:
            raise FieldError("max_held_tokens", f"max_held_tokens={self.max_held_tokens}: use 0 (no cap) or a "
                             "number of tokens")


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
        key = self.server_key
        if key is not None and (not isinstance(key, str) or len(key) != 40 or not set(key) <= _Z85):
            return f"bad peer server_key {str(key)[:48]!r} (need a 40-character Z85 CURVE public key)"
        return None

    def key(self) -> str:
        """host:port, the name of this peer in stats and messages (a sender's links also key on server_key)."""
        return f"{self.host}:{self.port}"
