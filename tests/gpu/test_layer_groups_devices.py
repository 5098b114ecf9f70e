"""Layer-group streaming on every device at hand: a chunk's K/V is queued as one ItemBatch per layer group
before the "forward" writes it; each group's bytes are written, then its gate opens, and the decode must
receive the written bytes, not the ones the pool held when the sends were queued. Real ZmqSender/ZmqReceiver
threads over 127.0.0.1.

On CPU (every CI run) the writes are done when the gate opens. With CUDA the writes run on a "forward"
stream behind a ~30 ms device sleep and the gate records its `torch.cuda.Event` there: only the gather
stream waiting for that event on the device (`ItemBatch.events`) gets the new bytes. Imports no SGLang.
"""
from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch

from prfaas_sgl.srt.backend.layer_groups import kv_buffer_layers, layer_groups
from prfaas_sgl.transfer.config import TransferConfig
from prfaas_sgl.transfer.gates import LayerGate, layer_batches
from prfaas_sgl.transfer.items import ItemBatch, Items
from prfaas_sgl.transfer.layout import kv_layout
from prfaas_sgl.transfer.receiver import ZmqReceiver
from prfaas_sgl.transfer.sender import ZmqSender
from prfaas_sgl.transfer.states import TransferState as S

CFG = TransferConfig(connections=2, chunk_bytes=64 << 10, window_bytes=1 << 20, timeout_s=30, stage_slots=8)
PAGE, PAGES, LAYERS = 64 * 512, 64, 4  # page size 64 x 2 heads x 128 dims of bf16
LAYOUT = kv_layout(LAYERS, PAGE, PAGES, aux_bytes=64, num_aux=4)
KV, AUX = tuple(LAYOUT.ids_of("kv")), LAYOUT.ids_of("aux")[0]
GROUPS = layer_groups(KV, kv_buffer_layers((), len(KV), is_mla=False), 2)
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
PAIRS = list(itertools.product(DEVICES, DEVICES))
IDS = itertools.count(1)
SLEEP_CYCLES = 50_000_000  # ~30 ms of device time before a group's write


class Pool:
    """K/V buffers on `device` (numpy views on the host, (address, nbytes) on CUDA) and one host aux buffer,
    as a server registers them."""

    def __init__(self, device: str, fill: int):
        self.tensors = [torch.full((b.nbytes,), fill, dtype=torch.uint8, device=device if b.kind == "kv" else "cpu")
                        for b in LAYOUT.buffers]
        self.buffers = [t.numpy() if t.device.type == "cpu" else (t.data_ptr(), t.numel()) for t in self.tensors]
        self.devices = [f"{t.device.type}:0" if t.is_cuda else "cpu" for t in self.tensors]

    def pages(self, b: int, pages) -> np.ndarray:
        return self.tensors[b].cpu().numpy().reshape(-1, LAYOUT.buffers[b].item_len)[list(pages)]


def forward_writes(src: Pool, group, pages, value: int, gate: LayerGate) -> None:
    """The group's layers write its pages, then the hook opens its gate (on the writing stream)."""
    cuda = src.tensors[group.buffer_ids[0]].is_cuda
    stream = torch.cuda.Stream() if cuda else None
    with torch.cuda.stream(stream) if cuda else _nothing():
        if cuda:
            torch.cuda._sleep(SLEEP_CYCLES)  # the layers are still computing when the sends are queued
        for b in group.buffer_ids:
            rows = src.tensors[b].view(PAGES, PAGE)
            rows[torch.tensor(pages, device=rows.device)] = value
        gate.open()


class _nothing:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


@pytest.mark.parametrize(("src_dev", "dst_dev"), PAIRS, ids=[f"{a}-{b}" for a, b in PAIRS])
def test_each_group_carries_the_bytes_its_layers_wrote_before_its_gate(src_dev, dst_dev):
    src, dst = Pool(src_dev, fill=1), Pool(dst_dev, fill=0)
    sp, dp = [5, 9, 2, 40, 41, 63], [0, 1, 2, 3, 10, 11]
    rx = ZmqReceiver(LAYOUT, dst.buffers, CFG, devices=dst.devices)
    tx = ZmqSender(LAYOUT, src.buffers, CFG, devices=src.devices)
    try:
        tid = next(IDS)
        rx.expect(tid, ItemBatch((Items(KV, np.array(dp)), Items((AUX,), np.array([2])))))
        cuda = src_dev == "cuda"
        gates = [LayerGate(f"g{g.index}", 30.0, event=torch.cuda.Event() if cuda else None) for g in GROUPS]
        chunk = ItemBatch((Items(KV, np.array(sp)), Items((AUX,), np.array([1]))))
        pieces = layer_batches(chunk, [g.buffer_ids for g in GROUPS], gates)
        for i, piece in enumerate(pieces):
            tx.send(tid, rx.address, piece, last=i == len(pieces) - 1)
        for g, gate in zip(GROUPS, gates):
            forward_writes(src, g, sp, 100 + g.index, gate)
        status = rx.wait(tid, 60)
        assert status.state is S.DONE, status
        for g in GROUPS:
            for b in g.buffer_ids:
                assert (dst.pages(b, dp) == 100 + g.index).all(), (b, src_dev, dst_dev)
        assert (dst.pages(AUX, [2]) == 1).all()
    finally:
        tx.close()
        rx.close()
