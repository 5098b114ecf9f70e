"""Typed decode → prefill control messages of `prfaas_zmq`, carried on SGLang's control sockets.

A message is `[TAG, msgpack(struct)]`, plus `mac` = HMAC-SHA256(register.secret, TAG + body) as a third
frame when keys are configured; the struct is tagged by type, so nothing is read by position. SGLang's
own frames on the same socket (ABORT) start with other tags. Register and Metadata both carry the MAC:
a Register chooses where KV goes and which key encrypts it, and every Metadata creates room state on
the prefill for the waiting timeout (`admission.PeerBook.admit_metadata` checks both). libzmq buffers a
whole frame before any of this runs, so the managers rebind SGLang's control socket with MAXMSGSIZE =
MAX_FRAME (`manager.bounded_pull`): a peer declaring a 4 GiB frame is disconnected at its header.

With keys, the prefill's status frames carry a MAC too (`sign_status` / `status_frames`): a forged
"Failed" for a room would otherwise fail it from any host that reaches the decode's control port.
Field names `endpoint`, `dst_port`, `is_dummy` are the ones SGLang's common manager reads from a
room's transfer infos (`_room_notify_targets`), so a `Metadata` can be stored there as is.
"""
from __future__ import annotations

import msgspec

from prfaas_sgl.transfer import security
from prfaas_sgl.transfer.layout import MemoryLayout

TAG = b"PRFAAS_ZMQ"
STATUS_TAG = b"PRFAAS_ZMQ_STATUS"  # prefill → decode status frames (SGLang's format, tagged)
# Largest control frame either side accepts. The largest legitimate one is a Metadata with MAX_STATE_ITEMS
# 64-bit state indices (~590 kB of msgpack) or a Register with a few thousand buffers (~100 kB).
MAX_FRAME = 1 << 20
# Starts the failure reason of a room whose decode session the prefill does not know (evicted, or the
# prefill restarted): the decode then drops its cached registration and registers again.
REREGISTER = "prfaas_zmq: register again"


class Register(msgspec.Struct, tag=True, frozen=True, kw_only=True):
    """A decode rank announces its data-plane address and memory layout (once per prefill server)."""

    endpoint: str  # decode control address (its PULL socket)
    dst_port: int
    data_host: str  # decode ZmqReceiver address
    data_port: int
    server_key: str | None  # CURVE public key of the receiver (z85), None = plaintext
    layout: MemoryLayout
    page_size: int
    attn_tp_size: int
    tp_rank: int

    @property
    def session(self) -> str:
        return f"{self.endpoint}:{self.dst_port}"


class Metadata(msgspec.Struct, tag=True, frozen=True, kw_only=True):
    """Where one request's KV goes on a decode rank. `npages`: how many pages the decode allocated past
    its cached prefix (their ids stay on the decode: its receiver scatters the stream into them);
    `state_indices`: per state component, None where nothing is sent."""

    room: int
    endpoint: str
    dst_port: int
    npages: int
    aux_index: int | None
    state_indices: list[list[int] | None]
    decode_prefix_len: int
    required_dst_info_num: int
    is_dummy: bool

    @property
    def session(self) -> str:
        return f"{self.endpoint}:{self.dst_port}"


_ENCODER = msgspec.msgpack.Encoder()
_DECODER = msgspec.msgpack.Decoder(Register | Metadata)


def encode(msg: Register | Metadata, secret: bytes | None = None) -> list[bytes]:
    """Frames of `msg`; with `secret`, a third frame authenticates them (`authentic`)."""
    body = _ENCODER.encode(msg)
    return [TAG, body] if secret is None else [TAG, body, security.mac(secret, TAG + body)]


def decode(frames: list[bytes]) -> Register | Metadata | None:
    """The message, or None when `frames` are not ours (another tag). Raises msgspec.DecodeError if a
    frame tagged as ours does not decode (a peer of another version)."""
    if len(frames) not in (2, 3) or frames[0] != TAG:
        return None
    return _DECODER.decode(frames[1])


def authentic(frames: list[bytes], secret: bytes) -> bool:
    """True when `frames` carry a MAC of their body under `secret` (constant-time comparison)."""
    return len(frames) == 3 and security.mac_ok(secret, frames[0] + frames[1], frames[2])


def sign_status(frames: list[bytes], secret: bytes | None) -> list[bytes]:
    """SGLang's tagged status frames [STATUS_TAG, room, status, rank, reason], plus a MAC of all of them
    under `secret` when keys are configured (SGLang's parser reads four frames after the tag and ignores
    the rest)."""
    if secret is None:
        return frames
    return frames + [security.mac(secret, _ENCODER.encode(frames))]


def status_frames(frames: list[bytes], secret: bytes | None) -> list[bytes] | None:
    """The status frames without their MAC, or None when keys are configured and the MAC does not verify
    (a forgery: no MAC, a wrong one, or frames altered)."""
    if secret is None:
        return frames
    if len(frames) < 2 or frames[0] != STATUS_TAG:
        return frames  # not a status frame: SGLang's parser decides
    body, tag = frames[:-1], frames[-1]
    return body if security.mac_ok(secret, _ENCODER.encode(body), tag) else None
