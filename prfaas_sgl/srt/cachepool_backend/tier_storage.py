"""The storage tiers prfaas_hybrid can put below its host tier: SGLang's HiCache `file` backend (the
embedded default) and Mooncake Store (cluster-shared, over TCP; prfaas_sgl.cachepool.tiers).

`HiCacheFileBackend` adapts SGLang's `HiCacheFile` (sglang/srt/mem_cache/hicache_storage.py) to the
tier's bytes interface: it already writes atomically (temp file + rename), bounds the directory with an
LRU evictor (`max_size`), and reads into a preallocated buffer, so a short file is a failed read.
What it lacks (its own TODO: "raw file payloads do not describe their format") our entry header adds.
"""
from __future__ import annotations

import os
import socket
from typing import Optional

import torch
from sglang.srt.mem_cache.hicache_storage import HiCacheFile, HiCacheStorageConfig

from prfaas_sgl.cachepool.tiers import MooncakeStoreBackend, StorageBackend


class HiCacheFileBackend:
    def __init__(self, path: str, max_bytes: int = 0, tp_rank: int = 0, tp_size: int = 1) -> None:
        extra = {"file_storage_path": path}
        if max_bytes > 0:
            extra["max_size"] = max_bytes
        os.makedirs(path, exist_ok=True)
        cfg = HiCacheStorageConfig(tp_rank=tp_rank, tp_size=tp_size, pp_rank=0, pp_size=1, attn_cp_rank=0,
                                   attn_cp_size=1, is_mla_model=False, enable_storage_metrics=False,
                                   is_page_first_layout=False, model_name="prfaas_hybrid", extra_config=extra)
        self.path = path
        self._file = HiCacheFile(cfg, file_path=path)

    def put(self, key: str, blob: bytes) -> bool:
        return bool(self._file.set(key, torch.frombuffer(bytearray(blob), dtype=torch.uint8)))

    def get(self, key: str, size: int) -> Optional[bytes]:
        target = torch.empty(size, dtype=torch.uint8)
        got = self._file.get(key, target)  # None if absent; raises IOError on a short file
        return None if got is None else target.numpy().tobytes()

    def exists(self, key: str) -> bool:
        return self._file.exists(key)

    def batch_exists(self, keys: list[str]) -> list[bool]:
        # a stat per key on a local directory (HiCacheFile.batch_exists counts leading hits only)
        return [self._file.exists(k) for k in keys]

    def remove(self, key: str) -> None:
        # HiCacheFile has no single-key delete; its file name is the key plus its config suffix. Its LRU
        # evictor counts the file's bytes against max_size until told: abort() (the call that refunds a
        # failed write) drops the entry and its bytes, so the bound is not eaten by removed files
        suffixed = self._file._get_suffixed_key(key)
        try:
            os.remove(os.path.join(self.path, f"{suffixed}.bin"))
        except FileNotFoundError:
            pass
        self._file._evictor.abort(suffixed)
        if self._file.metadata_cache is not None:
            self._file.metadata_cache.remove(suffixed)

    def clear(self) -> None:
        self._file.clear()


def build_storage(kind: str, path: str, max_bytes: int, master: str, metadata: str,
                  tp_rank: int = 0, tp_size: int = 1) -> Optional[StorageBackend]:
    """The storage tier a server's flags name ("none", "file", "mooncake")."""
    if kind == "none":
        return None
    if kind == "file":
        return HiCacheFileBackend(path, max_bytes, tp_rank, tp_size)
    if kind == "mooncake":
        return MooncakeStoreBackend(master, metadata, local_host=_address_towards(master))
    raise ValueError(f"unknown storage tier {kind!r}; use none, file or mooncake")


def _address_towards(master: str) -> str:
    """The local address Mooncake's transfer engine advertises: loopback for a master on this machine,
    else the address this host routes to the master from (peers read entries from our segment there;
    left to itself Mooncake takes the first NIC, which may not be the routed one)."""
    from prfaas_sgl.cachepool.tiers.auth import host_of
    from prfaas_sgl.config import is_loopback

    host, port = host_of(master), int(master.rsplit(":", 1)[-1])
    if is_loopback(host):
        return "127.0.0.1"
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((host, port))  # UDP: no packet is sent; the kernel only picks the route
        return s.getsockname()[0]
