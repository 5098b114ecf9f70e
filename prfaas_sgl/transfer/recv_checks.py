"""What a receiver may write, as pure functions: whether a message's bytes fit the transfer they claim.
No sockets, no state changes: `ZmqReceiver` asks, then acts. (Who may speak: `recv_gate.py`.)"""

from __future__ import annotations

import xxhash

from prfaas_sgl.transfer.config import MIN_CHUNK_BYTES, TransferConfig
from prfaas_sgl.transfer.items import ItemStream
from prfaas_sgl.transfer.layout import MemoryLayout
from prfaas_sgl.transfer.messages import Chunk, Close, Codec, Open
from prfaas_sgl.transfer.recv_book import InTransfer

# Above the largest legitimate frame (see max_frame_bytes): msgpack header fields and a peer whose layout
# differs a little from ours still fit, so that such a peer gets a named layout mismatch, not a drop.
_FRAME_SLACK = 64 << 10


def max_frame_bytes(layout: MemoryLayout, cfg: TransferConfig) -> int:
    """ZMQ_MAXMSGSIZE of the data listener (per frame): a sender's largest frame is a chunk's data frame
    (<= chunk_bytes) or the Open header, which carries the layout. libzmq drops the connection of a peer
    announcing a bigger frame before buffering any of it, so no peer can make us hold a 4 GiB frame.
    Prefill and decode must therefore run with the same chunk_bytes: a sender's Open announces its own,
    and a larger one is refused by name there (`chunk_size_problem`) instead of dropped at its first chunk.
    """
    largest_open = Open(transfer_id=(1 << 64) - 1, layout=layout, chunk_bytes=cfg.chunk_bytes)
    return max(cfg.chunk_bytes, len(Codec().encode(largest_open))) + _FRAME_SLACK


def chunk_size_problem(chunk_bytes: int, frame_limit: int, own_chunk_bytes: int) -> str | None:
    """An Open whose sender's chunk data frames could exceed our MAXMSGSIZE (0: an older sender, unknown)."""
    if chunk_bytes <= frame_limit:
        return None
    return (f"sender chunk_bytes={chunk_bytes} exceeds this receiver's frame limit of {frame_limit} B "
            f"(chunk_bytes={own_chunk_bytes} + slack): run prefill and decode with the same chunk_bytes "
            "(--prfaas-zmq-chunk-bytes)")


def max_ranges(cfg: TransferConfig) -> int:
    """Most separate byte ranges one stream may hold while its chunks arrive. A sender sends each stream
    in order, so every gap below the highest byte received is a chunk still in flight: at most
    window_bytes / chunk_bytes of full chunks (doubled for the short ones that end each send()). Each
    range costs every later out-of-order chunk a list insert, so tiny scattered chunks are refused
    beyond this instead of costing quadratic CPU."""
    return max(4096, 2 * cfg.window_bytes // cfg.chunk_bytes)


def chunk_problem(t: InTransfer, msg: Chunk, views: list[memoryview], ranges: int) -> str | None:
    """Why chunk `msg` (payload `views`) must not be written into `t`, or None. `ranges`: `max_ranges`."""
    stream = t.streams.get(msg.buffer_id)
    if stream is None:
        return f"chunk {msg.seq} for buffer {msg.buffer_id}, which this transfer has no pages in"
    end = msg.offset + msg.length
    if msg.offset < 0 or msg.length <= 0 or end > stream.total:
        return (f"chunk {msg.seq} bytes [{msg.offset}, {end}) of buffer "
                f"{msg.buffer_id} exceed the {stream.total} bytes expected (page count/size mismatch)")
    if len(views) != msg.nframes or sum(v.nbytes for v in views) != msg.length:
        return f"chunk {msg.seq} frames do not add up to its declared {msg.length} bytes"
    if msg.seq in t.seqs:
        return f"chunk {msg.seq} received twice"
    problem = _placement_problem(stream, msg, end, ranges)
    if problem:
        return problem
    h = xxhash.xxh3_64()
    for v in views:
        h.update(v)
    if h.intdigest() != msg.checksum:
        return f"checksum mismatch in chunk {msg.seq} (buffer {msg.buffer_id}, offset {msg.offset})"
    return None


def _placement_problem(stream: ItemStream, msg: Chunk, end: int, ranges: int) -> str | None:
    where = f"chunk {msg.seq} bytes [{msg.offset}, {end}) of buffer {msg.buffer_id}"
    if stream.covered.overlaps(msg.offset, end):
        return f"{where} overlap bytes already received"
    if _short(stream, msg.length, end):
        return (f"{where}: {msg.length} B is shorter than a chunk may be unless it ends an item "
                f"(minimum {_floor(stream)} B)")
    if len(stream.covered) >= ranges and stream.covered.isolated(msg.offset, end):
        return f"{where} would leave more than {ranges} separate ranges received: chunks far out of order"
    return None


def _short(stream: ItemStream, length: int, end: int) -> bool:
    """Shorter than any sender cuts an item stream: its chunks are whole stream items or chunk_bytes
    (>= MIN_CHUNK_BYTES) pieces of one, so only a chunk that ends an item may be shorter than
    min(MIN_CHUNK_BYTES, item)."""
    return length < _floor(stream) and end % stream.stream_len != 0


def _floor(stream: ItemStream) -> int:
    return min(MIN_CHUNK_BYTES, stream.stream_len)


def close_problem(t: InTransfer, msg: Close) -> str | None:
    """A Close whose per-buffer stream lengths differ from what `t` expects."""
    for b in sorted(set(t.streams) | set(msg.totals)):
        sent, want = msg.totals.get(b, 0), t.streams[b].total if b in t.streams else 0
        if sent != want:
            return (f"buffer {b} stream length mismatch: sender sends {sent} B, "
                    f"receiver expects {want} B (different page count or page size)")
    return None


def gap_problem(t: InTransfer) -> str | None:
    """All of `t`'s chunks arrived: name the first stream bytes none of them wrote, if any."""
    for b, s in t.streams.items():
        gap = s.covered.gap(s.total)
        if gap is not None:
            return (f"all {t.close.nchunks} chunks arrived but bytes [{gap[0]}, {gap[1]}) of buffer {b} "
                    "were never written")
    return None
