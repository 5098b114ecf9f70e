"""SGLang's two allocators over ONE slab's blocks (`cachepool.slab_blocks.SlabBlocks`), for
--prfaas-unified-pool.

    KV token slot t  lies in block t // bs     SlabTokenAllocator hands out tokens of KV-owned blocks
    Mamba slot s     IS block s                SlabStateAllocator hands out whole blocks
    SlabMambaPool    a MambaPool whose size is the state side's current capacity

SGLang keeps page size 1: the token allocator takes a whole block from the shared list when its own
blocks have no free token left, fills blocks in the order they were taken, and gives a block back the
moment its last live token is freed, so memory flows to states as KV drains. The price is
fragmentation: one live token keeps its whole block on the KV side.

Admission, two ways (`price_states`, set by unified.py): a colocated or PD prefill server charges a new
request's state when SGLang admits it (`slab_admission.py`: request_slot_reserve + its prefill budget),
so KV may use every block but SlabBlocks' small reserve; a PD decode server, which pre-allocates
transfers outside that budget, keeps one block per free request row instead.

`size` of both sides is a live number (see SlabBlocks): SGLang's idle leak check compares available +
cached with it, and both come from the same counts. Bookkeeping runs on CPU tensors; ids are moved to
the pool's device on the way out.
"""
from __future__ import annotations

import torch
from sglang.srt.mem_cache.allocator.mamba import MambaSlotAllocator
from sglang.srt.mem_cache.allocator.token import TokenToKVPoolAllocator
from sglang.srt.mem_cache.memory_pool import MambaPool

from prfaas_sgl.cachepool.slab_blocks import FREE, KV, STATE, SlabBlocks
from prfaas_sgl.srt.buf_infos import strided_infos

from .slab_admission import SlabPrefillBudget

_EMPTY = torch.empty((0,), dtype=torch.int64)


def _ids(blocks: list[int]) -> torch.Tensor:
    return torch.tensor(blocks, dtype=torch.int64)


class SlabTokenAllocator(TokenToKVPoolAllocator):
    """Page-size-1 KV allocator whose tokens live in KV-owned slab blocks. free_pages: free token
    slots of owned blocks (CPU int64), oldest-taken block first."""

    def __init__(self, blocks: SlabBlocks, tokens_per_block: int, dtype: torch.dtype, device: str,
                 kvcache, price_states: bool = False) -> None:
        self.slab_blocks, self.bs, self.price_states = blocks, tokens_per_block, price_states
        self._used = torch.zeros(blocks.num_blocks, dtype=torch.int64)  # live tokens per block
        # per slot, so a double free cannot hand back a block that still holds a live token
        self._live = torch.zeros(blocks.num_blocks * tokens_per_block, dtype=torch.bool)
        super().__init__(blocks.num_blocks * tokens_per_block - 1, dtype, device, kvcache, need_sort=False)

    @property
    def size(self) -> int:
        return self.slab_blocks.kv_capacity() * self.bs

    @size.setter
    def size(self, _value: int) -> None:
        pass  # SGLang's constructor and resize() set it; here it is derived (see the module docstring)

    def clear(self) -> None:
        if hasattr(self, "slab_blocks"):  # the base constructor calls clear() before sizes exist
            self.slab_blocks.clear(KV)
            self._used.zero_()
            self._live.zero_()
        self.free_pages = _EMPTY
        self.release_pages = _EMPTY
        self.free_group = None

    def available_size(self) -> int:
        return len(self.free_pages) + self.slab_blocks.kv_usable() * self.bs

    def loose_tokens(self) -> int:
        """Free token slots inside KV-owned blocks (usable by KV only: a state needs a whole block)."""
        return len(self.free_pages)

    # -- SGLang's admission hooks (PrefillAdder) ----------------------------------------------------
    def request_slot_reserve(self, *, has_req_pool_slot: bool, prefill_tokens: int = 0) -> int:
        """A request without a row is charged one block's tokens for the state it will take."""
        return 0 if has_req_pool_slot or not self.price_states else self.bs

    def create_prefill_budget(self, tree_cache, *, num_mixed_decode_tokens: int = 0):
        if not self.price_states:
            return super().create_prefill_budget(tree_cache, num_mixed_decode_tokens=num_mixed_decode_tokens)
        return SlabPrefillBudget(self, tree_cache, num_mixed_decode_tokens=num_mixed_decode_tokens)

    def alloc(self, need_size: int):
        short = need_size - len(self.free_pages)
        if short > 0:
            fresh = self.slab_blocks.take_kv(-(-short // self.bs))
            if fresh is None:
                return None
            slots = (_ids(fresh)[:, None] * self.bs + torch.arange(self.bs)).reshape(-1)
            self.free_pages = torch.cat((self.free_pages, slots))
        out, self.free_pages = self.free_pages[:need_size], self.free_pages[need_size:]
        self._used += torch.bincount(out // self.bs, minlength=len(self._used))
        self._live[out] = True
        return out.to(self.device)

    def free(self, free_index: torch.Tensor) -> None:
        if free_index.numel() == 0:
            return
        if self.free_group is not None:
            self.free_group.append(self._copy_for_free_group(free_index))
            return
        idx = free_index.reshape(-1).to("cpu", torch.int64)
        if not bool(self._live[idx].all()) or len(torch.unique(idx)) != len(idx):
            raise RuntimeError(f"SlabTokenAllocator: KV slots freed twice or never allocated: "
                               f"{idx[~self._live[idx]].tolist()[:8]}")
        self._live[idx] = False
        blocks = idx // self.bs
        self._used -= torch.bincount(blocks, minlength=len(self._used))
        touched = torch.unique(blocks)
        self.free_pages = torch.cat((self.free_pages, idx))
        empty = touched[self._used[touched] == 0]
        if len(empty):  # the block's last live token: the block goes back to the shared list
            self.free_pages = self.free_pages[~torch.isin(self.free_pages // self.bs, empty)]
            self.slab_blocks.give(empty.tolist(), KV)


class SlabStateAllocator(MambaSlotAllocator):
    """Mamba slot allocator: one slot is one slab block."""

    def __init__(self, blocks: SlabBlocks, device: str) -> None:
        self.slab_blocks = blocks
        super().__init__(blocks.num_blocks - 1, device)

    @property
    def free_slots(self) -> torch.Tensor:
        """Free blocks (SGLang's leak census reads it); not all of them may be states' to take."""
        return _ids([b for b, k in enumerate(self.slab_blocks.kind) if k == FREE])

    def clear(self) -> None:
        if hasattr(self, "slab_blocks"):
            self.slab_blocks.clear(STATE)

    def available_size(self) -> int:
        return self.slab_blocks.state_available()

    def _do_alloc(self, need_size: int):
        got = self.slab_blocks.take_state(need_size)
        return None if got is None else _ids(got).to(self.device)

    def free(self, free_index: torch.Tensor) -> None:
        if free_index.numel():
            self.slab_blocks.give(free_index.reshape(-1).tolist(), STATE)


class SlabMambaPool(MambaPool):
    """MambaPool (build it with size = num_blocks - 1, then bind_mamba_pool) whose `size` is the
    state side's live capacity once `slab_blocks` is set."""

    slab_blocks: SlabBlocks | None = None

    @property
    def size(self) -> int:
        return self._static_size if self.slab_blocks is None else self.slab_blocks.state_capacity()

    @size.setter
    def size(self, value: int) -> None:
        self._static_size = value

    def get_contiguous_buf_infos(self):
        """PD registration (prfaas_zmq): per state tensor and layer, its slot rows one block apart.
        The count is the slab's blocks, not the live `size` (a state may sit in any block)."""
        return strided_infos(t for _, t, _, _ in self._iter_transfer_state_entries())
