"""Bytes in and out of SGLang's pools for the lower tiers: the full-attention KV of one index block
(bs slots, every full-attention layer, K then V), one Mamba-pool state slot (every conv tensor, then
the recurrent one), and for a sliding-window model the window pages of one block (the SWA layers' KV at
the SWA peers of its bs full slots). Payload order (what an entry's bytes are):

    KV     for each tensor t of [k_buffer[0..L), v_buffer[0..L)] (MLA: kv_buffer): t[slots] as bytes
    state  for each tensor t of [conv[0..C), temporal]:                          t[:, slot] as bytes
    window for each tensor t of the SWA pool's [k_buffer[0..S), v_buffer[0..S)]: t[peers(slots)] as bytes

The layout string names every tensor's per-slot shape and dtype: it is part of an entry's fingerprint,
so bytes never load into a pool shaped otherwise. Synchronous copies (a device->host->device round trip
per entry): the first slice; layer-wise loads overlapped with the forward are later work.
"""
from __future__ import annotations

import torch


def _kv_tensors(kvcache) -> list[torch.Tensor]:
    full = getattr(kvcache, "full_kv_pool", kvcache)  # HybridLinearKVPool keeps the full layers there
    if hasattr(full, "k_buffer"):
        return list(full.k_buffer) + list(full.v_buffer)
    return list(full.kv_buffer)  # MLA: one latent buffer per layer


class PoolBytes:
    def __init__(self, kvcache, mamba_pool, block_size: int, to_window=None) -> None:
        """mamba_pool: None for a sliding-window model; to_window(full slots) -> their SWA peers (int64,
        same shape): given for a sliding-window model, whose kvcache has a swa_kv_pool."""
        if getattr(mamba_pool, "_slot_siblings", None):
            raise ValueError("prfaas_hybrid tiers: this model's Mamba pool keeps sibling state per slot "
                             "(not saved by the tiers yet); run without --prfaas-tier-* flags")
        self.bs, self.to_window = block_size, to_window
        self.kv = _kv_tensors(kvcache)
        cache = mamba_pool.mamba_cache if mamba_pool is not None else None
        self.state = [t for t in [*cache.conv, cache.temporal] if t.numel() > 0] if cache is not None else []
        self.window = _kv_tensors(kvcache.swa_kv_pool) if to_window is not None else []
        self.kv_bytes = block_size * sum(_row_bytes(t[0]) for t in self.kv)
        self.state_bytes = sum(_row_bytes(t[:, 0]) for t in self.state)
        self.window_bytes = block_size * sum(_row_bytes(t[0]) for t in self.window)

    def layout(self) -> str:
        kv = ",".join(f"{tuple(t.shape[1:])}{t.dtype}" for t in self.kv)
        st = ",".join(f"{tuple(t[:, 0].shape)}{t.dtype}" for t in self.state)
        win = ",".join(f"{tuple(t.shape[1:])}{t.dtype}" for t in self.window)
        return f"bs={self.bs};kv=[{kv}];state=[{st}]" + (f";window=[{win}]" if self.window else "")

    def read_kv(self, slots: torch.Tensor) -> bytes:
        """slots: int [bs] KV slot ids of one block."""
        return _to_bytes([t[slots] for t in self.kv])

    def write_kv(self, slots: torch.Tensor, payload: bytes) -> None:
        parts = _split(payload, [(len(slots), *t.shape[1:]) for t in self.kv], [t.dtype for t in self.kv])
        for t, part in zip(self.kv, parts):
            t[slots] = part.to(t.device)

    def read_window(self, slots: torch.Tensor) -> bytes:
        """slots: int [bs] full slot ids of one block whose SWA peers are live."""
        peers = self.to_window(slots)
        return _to_bytes([t[peers] for t in self.window])

    def write_window(self, slots: torch.Tensor, payload: bytes) -> None:
        """Into the SWA peers of full slots `slots` (the mapping must be set)."""
        peers = self.to_window(slots)
        parts = _split(payload, [(len(slots), *t.shape[1:]) for t in self.window], [t.dtype for t in self.window])
        for t, part in zip(self.window, parts):
            t[peers] = part.to(t.device)

    def read_state(self, slot: torch.Tensor) -> bytes:
        """slot: int64 [1], a physical Mamba-pool slot (translated)."""
        return _to_bytes([t[:, slot] for t in self.state])

    def write_state(self, slot: torch.Tensor, payload: bytes) -> None:
        parts = _split(payload, [tuple(t[:, slot].shape) for t in self.state], [t.dtype for t in self.state])
        for t, part in zip(self.state, parts):
            t[:, slot] = part.to(t.device)


def _row_bytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _to_bytes(parts: list[torch.Tensor]) -> bytes:
    flat = torch.cat([p.contiguous().view(torch.uint8).reshape(-1) for p in parts])
    return flat.cpu().numpy().tobytes()


def _split(payload: bytes, shapes: list[tuple], dtypes: list[torch.dtype]) -> list[torch.Tensor]:
    flat = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
    out, off = [], 0
    for shape, dtype in zip(shapes, dtypes):
        n = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
        # clone: a view(dtype) needs its byte offset aligned to the element size
        out.append(flat[off:off + n].clone().view(dtype).view(shape))
        off += n
    if off != len(payload):
        raise ValueError(f"payload of {len(payload)} bytes, layout needs {off}")
    return out
