"""Typed, versioned wire messages of the data plane.

A ZeroMQ message is `[header, *data]`: `header` is one msgpack-encoded struct below (tagged by type),
`data` are the chunk's payload frames (only `Chunk` has any; `Chunk.nframes` says how many). Nothing is
read by frame position beyond "first frame = header".

Sender → receiver: Open, Chunk, Close, Abort.   Receiver → sender: OpenAck, Ack, Done, Failed, Abort.
Every struct carries `v`; a peer speaking another version gets a `Failed` naming both versions.
"""

from __future__ import annotations

import msgspec

from prfaas_sgl.transfer.layout import MemoryLayout

PROTOCOL_VERSION = 1


class _Msg(msgspec.Struct, tag=True, frozen=True, kw_only=True):
    transfer_id: int
    v: int = PROTOCOL_VERSION


class Open(_Msg, frozen=True, kw_only=True):
    """First message of a transfer; the receiver checks version, layout, chunk size and that it expects
    the id. `chunk_bytes`: the sender's largest chunk payload; a receiver whose frame limit is smaller
    refuses the Open by name (else libzmq would drop the connection at the first chunk, silently).
    0 = not declared (a v1 sender from before the field: unchecked); msgspec ignores the field on such
    a receiver, so the protocol version stays 1.
    """

    layout: MemoryLayout
    chunk_bytes: int = 0


class OpenAck(_Msg, frozen=True, kw_only=True):
    pass


class Chunk(_Msg, frozen=True, kw_only=True):
    """Bytes [offset, offset + length) of buffer `buffer_id`'s stream, in `nframes` data frames."""

    seq: int
    buffer_id: int
    offset: int
    length: int
    nframes: int
    checksum: int


class Ack(_Msg, frozen=True, kw_only=True):
    """Chunk `seq` is written and verified; its `length` bytes return to the sender's window."""

    seq: int
    length: int


class Close(_Msg, frozen=True, kw_only=True):
    """No more chunks: `nchunks` in all, `totals[buffer_id]` bytes per buffer stream."""

    nchunks: int
    totals: dict[int, int]


class Done(_Msg, frozen=True, kw_only=True):
    nbytes: int


class Failed(_Msg, frozen=True, kw_only=True):
    reason: str


class Abort(_Msg, frozen=True, kw_only=True):
    reason: str


Message = Open | OpenAck | Chunk | Ack | Close | Done | Failed | Abort


class _Envelope(msgspec.Struct):
    """The least a header must have; used only to name what went wrong when full decoding fails."""

    transfer_id: int = -1
    v: int = -1
    type: str = "?"


class DecodeError(ValueError):
    def __init__(self, transfer_id: int, reason: str) -> None:
        super().__init__(reason)
        self.transfer_id = transfer_id
        self.reason = reason


class Codec:
    """msgpack encoder/decoder pair, created once per socket-owning thread (not thread-safe)."""

    def __init__(self) -> None:
        self._enc = msgspec.msgpack.Encoder()
        self._dec = msgspec.msgpack.Decoder(Message)
        self._env = msgspec.msgpack.Decoder(_Envelope)

    def encode(self, msg: Message) -> bytes:
        return self._enc.encode(msg)

    def decode(self, raw: bytes | memoryview) -> Message:
        """Decode a header; raise DecodeError (with the transfer id when readable) naming the problem."""
        try:
            msg = self._dec.decode(raw)
        except (msgspec.DecodeError, msgspec.ValidationError) as e:
            raise self._explain(raw, e) from e
        if msg.v != PROTOCOL_VERSION:
            raise DecodeError(msg.transfer_id, _version_reason(msg.v))
        return msg

    def _explain(self, raw: bytes | memoryview, err: Exception) -> DecodeError:
        try:
            env = self._env.decode(raw)
        except (msgspec.DecodeError, msgspec.ValidationError):
            return DecodeError(-1, f"undecodable message header: {err}")
        if env.v != PROTOCOL_VERSION:
            return DecodeError(env.transfer_id, _version_reason(env.v))
        return DecodeError(env.transfer_id, f"bad {env.type} message: {err}")


def _version_reason(v: int) -> str:
    return f"protocol version mismatch: peer speaks v{v}, this side speaks v{PROTOCOL_VERSION}"
