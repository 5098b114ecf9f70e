"""Layer-group streaming through real prfaas_zmq managers and the real transport on loopback
(backend_fake_pd.py with fake=False): pages a forward's groups queued go once, SGLang's own send of the chunk
after the forward carries only the rest, and a room may switch paths between chunks. Guards
PrefillManager.stream_groups and the trim in add_transfer_request (without it SGLang's send repeats the
streamed pages and the decode refuses the overflow)."""
from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("sglang", reason="the backend subclasses SGLang's KV manager")

from prfaas_sgl.srt.backend.layerwise import LayerwiseStreamer  # noqa: E402
from prfaas_sgl.transfer.config import LayerwiseConfig  # noqa: E402

from .backend_fake_pd import PAGE, KVPoll, make_pd, until  # noqa: E402,F401 - make_pd is a fixture

ROOM = 902
DST, SRC = np.array([9, 3, 12, 5], np.int32), np.array([1, 2, 7, 8], np.int32)


def _streaming(pd) -> LayerwiseStreamer:
    """One layer (K and V buffers 0, 1, positional), one group; every prompt streams."""
    s = LayerwiseStreamer(LayerwiseConfig(1, 1), pd.p.memory.kv_ids, (0, 0), True, 5.0, pd.p.sender.stats.count)
    assert s.bind((0,), (0,)) is None
    pd.p.layerwise = s
    return s


def _bootstrapped(pd):
    tx, rx = pd.sender(ROOM, len(SRC)), pd.receiver(ROOM)
    rx.send_metadata(DST, aux_index=3)
    assert until(tx.poll, KVPoll.WaitingForInput) == KVPoll.WaitingForInput
    return tx, rx


def _forward(pd, s: LayerwiseStreamer, pages: np.ndarray, page_from: int) -> None:
    """What layerwise_hooks does around one forward: queue its pages behind the gates, run the layer."""
    gates = s.begin()
    pd.p.stream_groups(ROOM, pages, page_from, s.splitter(gates))
    s.on_layer(0)
    s.end(gates)


def _landed(pd) -> bool:
    pages = all(np.array_equal(pd.dst[b].reshape(-1, PAGE)[DST], pd.src[b].reshape(-1, PAGE)[SRC]) for b in (0, 1))
    return pages and np.array_equal(pd.dst[2].reshape(8, -1)[3], pd.src[2].reshape(8, -1)[1])


def test_streamed_pages_go_once_and_the_last_send_carries_only_the_rest(make_pd):
    pd = make_pd(fake=False)
    s = _streaming(pd)
    tx, rx = _bootstrapped(pd)
    _forward(pd, s, SRC[:3], 0)  # a middle chunk: pages 0-2
    tx.send(SRC[:3])  # SGLang's send of that chunk after its forward: all queued already
    _forward(pd, s, SRC[3:], 3)  # the last chunk's page
    tx.send(SRC[3:])  # the tail: aux row only
    assert until(tx.poll, KVPoll.Success) == KVPoll.Success
    assert until(rx.poll, KVPoll.Success) == KVPoll.Success
    assert _landed(pd)
    assert pd.p.sender.stats.layerwise()["pages_streamed"] == 4


def test_a_room_switches_paths_between_chunks_without_repeating_a_page(make_pd):
    pd = make_pd(fake=False)
    s = _streaming(pd)
    tx, rx = _bootstrapped(pd)
    tx.send(SRC[:1])  # chunk 1 on the chunk path (its batch held a short prompt)
    _forward(pd, s, SRC[1:2], s.queued(ROOM, tx.curr_idx))  # chunk 2 streams from page 1
    tx.send(SRC[1:3])  # SGLang sends chunk 2 and chunk 3's page together (say): page 2 is new
    tx.send(SRC[3:])  # the last chunk on the chunk path
    assert until(tx.poll, KVPoll.Success) == KVPoll.Success
    assert until(rx.poll, KVPoll.Success) == KVPoll.Success
    assert _landed(pd)
    assert s.queued(ROOM, 0) in (0, 4)  # forgotten with the room once it concluded, or all 4 queued
