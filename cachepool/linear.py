"""Linear-attention (Gated DeltaNet, KDA, Lightning, Mamba) manager: a fixed-size state per request.

A state summarises ALL tokens before it, so a cached state is reusable only at exactly its own
length. States are checkpointed every `checkpoint_interval` tokens (a multiple of block_size; 0: no
grid) and, where the caller holds the request's state at the end of a grow (a chunk end, the end of a
prompt or of a finished request), there too (`mark_state`). One state is split over `state_blocks`
whole pool blocks (the last one padded).
"""
from __future__ import annotations

from typing import Iterator

from .allocation import StateAllocation
from .manager_base import GroupManager
from .specs import GroupSpec, PoolLayoutError, PoolShape


class LinearRequestState:
    __slots__ = ("working", "restore", "pending", "planned", "committed", "asked")

    def __init__(self) -> None:
        self.working: list[int] = []  # the request's own state, updated in place by the model
        self.restore: list[int] = []  # referenced checkpoint copied into `working` (a hit)
        self.pending: dict[int, list[int]] = {}  # boundary (blocks) -> blocks awaiting the state
        self.planned = 0  # checkpoints for boundaries <= planned (blocks) are allocated or cached
        self.committed = 0  # boundaries <= committed (blocks) were offered to the index
        self.asked = 0  # a boundary (blocks) off the grid the next grow checkpoints too; 0: none


class LinearStateManager(GroupManager):
    kind = "linear"

    def __init__(self, spec: GroupSpec, cfg: PoolShape, *args) -> None:
        super().__init__(spec, cfg, *args)
        self.state_blocks = state_blocks(spec, cfg.block_bytes)
        self.interval_blocks = spec.checkpoint_interval // cfg.block_size
        self.index: dict[int, list[int]] = {}  # chain hash at a boundary -> the state's blocks

    @classmethod
    def page_bytes(cls, spec: GroupSpec, block_size: int) -> int:
        return 0

    @classmethod
    def validate(cls, spec: GroupSpec, cfg: PoolShape) -> None:
        if spec.state_bytes <= 0:
            raise PoolLayoutError(f"group {spec.name!r} (linear): set state_bytes > 0")
        c, bs = spec.checkpoint_interval, cfg.block_size
        if c < 0 or c % bs:
            raise PoolLayoutError(
                f"group {spec.name!r} (linear): checkpoint_interval={c} tokens is not a multiple of "
                f"block_size={bs}; a state is only reusable at a block boundary, so use a multiple of "
                f"{bs} (or 0: states only where the caller marks one)")

    def peak_blocks(self, num_tokens: int) -> int:
        step = self.interval_blocks
        # working state + the grid's checkpoints; without a grid, one marked checkpoint at a time
        # (the backend commits each before it marks the next)
        checkpoints = num_tokens // self.block_size // step if step else 1
        return self.state_blocks * (1 + checkpoints)

    def longest_hit(self, hashes: list[int], max_blocks: int) -> int:
        """Largest boundary k <= max_blocks whose state is cached; 0 = the initial (zero) state,
        always available. Marked states lie anywhere, so every block boundary is a candidate: the
        scan runs from the full-attention hit down to the nearest state (a dict lookup per block)."""
        index = self.index
        for k in range(max_blocks, 0, -1):
            if hashes[k - 1] in index:
                return k
        return 0

    def new_state(self) -> LinearRequestState:
        return LinearRequestState()

    def hit_blocks(self, hashes: list[int], k: int) -> list[int]:
        return list(self.index[hashes[k - 1]]) if k else []

    def acquire_hit(self, st: LinearRequestState, hashes: list[int], k: int) -> None:
        st.planned = st.committed = k
        if k:
            st.restore = self.index[hashes[k - 1]]
            self.pool.incref(st.restore)

    def mark_state(self, st: LinearRequestState, num_tokens: int) -> None:
        """The caller will hold the request's state at exactly num_tokens (a multiple of block_size)
        when the next grow's tokens are computed: checkpoint it there too. 0 clears the mark."""
        st.asked = num_tokens // self.block_size

    def _boundaries(self, st: LinearRequestState, num_tokens: int) -> list[int]:
        """Checkpoint boundaries (blocks) in (planned, num_tokens // bs]: on the grid, and the marked
        one.

            grid     |-------c-------|-------c-------|
            grow     planned ............ asked = n          -> [c, n] (n off the grid)
        """
        step, n = self.interval_blocks, num_tokens // self.block_size
        out = list(range((st.planned // step + 1) * step, n + 1, step)) if step else []
        if st.planned < st.asked <= n and not (step and st.asked % step == 0):
            out.append(st.asked)
            out.sort()
        return out

    def blocks_to_grow(self, st: LinearRequestState, num_tokens: int) -> int:
        working = 0 if st.working else self.state_blocks
        return working + self.state_blocks * len(self._boundaries(st, num_tokens))

    def grow(self, st: LinearRequestState, num_tokens: int, blocks: list[int]) -> StateAllocation:
        s, pos, writes = self.state_blocks, 0, []
        if not st.working:
            st.working, pos = blocks[:s], s
        for b in self._boundaries(st, num_tokens):
            st.pending[b] = blocks[pos:pos + s]
            writes.append((b * self.block_size, tuple(blocks[pos:pos + s])))
            pos += s
            st.planned = b
        st.asked = 0
        return StateAllocation(self.name, tuple(st.working), tuple(st.restore), tuple(writes))

    def commit(self, st: LinearRequestState, hashes: list[int], token_ids: list[int],
               num_computed: int) -> None:
        """Cache every pending checkpoint at a boundary <= num_computed, then drop the request's
        reference: the request never reads a checkpoint it wrote."""
        upto = min(num_computed // self.block_size, len(hashes))
        for b in [b for b in st.pending if b <= upto]:
            blocks = st.pending.pop(b)
            h = hashes[b - 1]
            if h not in self.index:
                self._store(h, blocks, hashes, token_ids, b)
            else:
                self.pool.touch(self.index[h])  # the cached copy counts as used now (see attention.py)
            self.pool.decref(blocks)  # cached -> idle LRU; a duplicate -> free
        st.committed = max(st.committed, upto)

    def _store(self, h: int, blocks: list[int], hashes: list[int], token_ids: list[int], b: int) -> None:
        self.index[h] = blocks
        for x in blocks:
            self.pool.set_owner(x, self, h)
        if self.events.enabled:
            bs = self.block_size
            parent = hashes[b - 2] if b >= 2 else None
            self.events.stored(self.name, [h], parent, token_ids, ((b - 1) * bs, b * bs), bs)

    def release(self, st: LinearRequestState) -> None:
        for b in sorted(st.pending, reverse=True):
            self.pool.decref(st.pending[b])
        self.pool.decref(st.working)
        self.pool.decref(st.restore)
        st.pending, st.working, st.restore = {}, [], []

    def held_blocks(self, st: LinearRequestState) -> list[int]:
        out = st.working + st.restore
        for blocks in st.pending.values():
            out += blocks
        return out

    def drop_entry(self, block_hash: int) -> list[int]:
        blocks = self.index.pop(block_hash)
        if self.events.enabled:
            self.events.removed(self.name, [block_hash])
        return blocks

    def index_entries(self) -> Iterator[tuple[int, list[int]]]:
        return iter(self.index.items())

    def clear_index(self) -> None:
        self.index.clear()


def state_blocks(spec: GroupSpec, block_bytes: int) -> int:
    """Whole blocks one state of the group (all its layers) needs; the last block is padded."""
    return -(-(spec.state_bytes * spec.num_layers) // block_bytes)
