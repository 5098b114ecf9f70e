"""Full-attention and sliding-window managers: one block per block_size tokens per group."""
from __future__ import annotations

from typing import Iterator

from .allocation import NULL_BLOCK, PagedAllocation
from .manager_base import GroupManager
from .specs import GroupSpec, PoolLayoutError, PoolShape


class PagedState:
    __slots__ = ("table", "committed", "trimmed")

    def __init__(self) -> None:
        self.table: list[int] = []  # table[i]: block of tokens [i*bs, (i+1)*bs), or NULL_BLOCK
        self.committed = 0  # blocks [0, committed) were offered to the index
        self.trimmed = 0  # blocks [0, trimmed) are NULL_BLOCK (sliding window only)


class FullAttentionManager(GroupManager):
    """KV for every token; any prefix of cached full blocks is a hit."""

    kind = "full"

    def __init__(self, *args) -> None:
        super().__init__(*args)
        self.index: dict[int, int] = {}  # chain hash -> block

    @classmethod
    def page_bytes(cls, spec: GroupSpec, block_size: int) -> int:
        return block_size * spec.kv_bytes_per_token * spec.num_layers

    @classmethod
    def validate(cls, spec: GroupSpec, cfg: PoolShape) -> None:
        if spec.kv_bytes_per_token <= 0:
            raise PoolLayoutError(f"group {spec.name!r} ({spec.kind}): set kv_bytes_per_token > 0")

    def peak_blocks(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def longest_hit(self, hashes: list[int], max_blocks: int) -> int:
        index = self.index
        for k in range(max_blocks):
            if hashes[k] not in index:
                return k
        return max_blocks

    def new_state(self) -> PagedState:
        return PagedState()

    def hit_blocks(self, hashes: list[int], k: int) -> list[int]:
        index = self.index
        return [index[hashes[i]] for i in range(k - 1, -1, -1)]

    def acquire_hit(self, st: PagedState, hashes: list[int], k: int) -> None:
        index = self.index
        st.table = [index[h] for h in hashes[:k]]
        self.pool.incref(st.table)
        st.committed = k

    def blocks_to_grow(self, st: PagedState, num_tokens: int) -> int:
        return max(0, -(-num_tokens // self.block_size) - len(st.table))

    def grow(self, st: PagedState, num_tokens: int, blocks: list[int]) -> PagedAllocation:
        st.table += blocks
        return PagedAllocation(self.name, tuple(st.table), tuple(blocks))

    def commit(self, st: PagedState, hashes: list[int], token_ids: list[int], num_computed: int) -> None:
        self._cache_full_blocks(st, hashes, token_ids, min(num_computed // self.block_size, len(hashes)))

    def _cache_full_blocks(self, st: PagedState, hashes: list[int], token_ids: list[int], upto: int) -> None:
        """Index table[committed:upto]. A hash already cached by another request keeps the other
        copy (ours stays private and is freed with the request), and that copy counts as used now:
        otherwise a prompt re-sent after its chain lost a block keeps its surviving entries at their
        old LRU place, they are evicted next, and the prompt ends up with no usable prefix at all."""
        index, start, table = self.index, st.committed, st.table
        owner, owner_hash = self.pool.owner, self.pool.owner_hash
        stored: list[int] = []
        kept: list[int] = []
        for i in range(start, upto):
            h = hashes[i]
            if h not in index:
                b = table[i]
                index[h] = b
                owner[b] = self
                owner_hash[b] = h
                stored.append(i)
            else:
                kept.append(index[h])
        if kept:
            self.pool.touch(kept[::-1])  # tails first, as a release would order them
        st.committed = max(start, upto)
        if stored and self.events.enabled:
            self._emit_stored(stored, hashes, token_ids)

    def _emit_stored(self, positions: list[int], hashes: list[int], token_ids: list[int]) -> None:
        """One BlockStored per run of consecutive block positions (parent = hash before the run)."""
        bs, run = self.block_size, [positions[0]]
        for i in positions[1:] + [-2]:
            if i == run[-1] + 1:
                run.append(i)
                continue
            first, last = run[0], run[-1]
            parent = hashes[first - 1] if first else None
            self.events.stored(self.name, hashes[first:last + 1], parent, token_ids,
                               (first * bs, (last + 1) * bs), bs)
            run = [i]

    def release(self, st: PagedState) -> None:
        self.pool.decref([b for b in reversed(st.table) if b != NULL_BLOCK])
        st.table = []

    def held_blocks(self, st: PagedState) -> list[int]:
        return [b for b in st.table if b != NULL_BLOCK]

    def drop_entry(self, block_hash: int) -> list[int]:
        b = self.index.pop(block_hash)
        if self.events.enabled:
            self.events.removed(self.name, [block_hash])
        return [b]

    def index_entries(self) -> Iterator[tuple[int, list[int]]]:
        return ((h, [b]) for h, b in self.index.items())

    def clear_index(self) -> None:
        self.index.clear()


class SlidingWindowManager(FullAttentionManager):
    """Attention over the last `window` tokens (the current one included): resuming after k blocks
    needs only the blocks holding tokens [k*bs - (window-1), k*bs)."""

    kind = "swa"

    def __init__(self, *args) -> None:
        super().__init__(*args)
        # blocks before a boundary that the next token reads: ceil((window-1) / bs)
        self.window_blocks = -(-(self.spec.window - 1) // self.block_size)

    @classmethod
    def validate(cls, spec: GroupSpec, cfg: PoolShape) -> None:
        super().validate(spec, cfg)
        if spec.window < 1:
            raise PoolLayoutError(f"group {spec.name!r} (swa): window={spec.window}; set it >= 1")

    def longest_hit(self, hashes: list[int], max_blocks: int) -> int:
        """Rightmost k <= max_blocks with blocks [k-w, k) all cached (w = window_blocks); near the
        start, blocks [0, k) for k < w.

        blocks:  ... [k-w] [k-w+1] ... [k-1] | k*bs = first token to compute
                      \\_____ must be cached ____/
        """
        need, index, run = self.window_blocks, self.index, 0
        if need == 0:
            return max_blocks
        for i in range(max_blocks - 1, -1, -1):
            if hashes[i] in index:
                run += 1
                if run == need:
                    return i + need
            else:
                run = 0
        return run  # the run that starts at block 0 is shorter than the window: all of it is needed

    def hit_blocks(self, hashes: list[int], k: int) -> list[int]:
        index = self.index
        return [index[hashes[i]] for i in range(k - 1, max(0, k - self.window_blocks) - 1, -1)]

    def acquire_hit(self, st: PagedState, hashes: list[int], k: int) -> None:
        skip = max(0, k - self.window_blocks)
        window = [self.index[h] for h in hashes[skip:k]]
        self.pool.incref(window)
        st.table = [NULL_BLOCK] * skip + window
        st.committed = k
        st.trimmed = skip

    def commit(self, st: PagedState, hashes: list[int], token_ids: list[int], num_computed: int) -> None:
        super().commit(st, hashes, token_ids, num_computed)
        self._trim(st, num_computed)

    def _trim(self, st: PagedState, num_computed: int) -> None:
        """Release blocks the next token cannot read: all of [0, first_needed).

        tokens:  [0 ....... p-(window-1)) [p-(window-1) ..... p)  p = num_computed
                  not read any more         read by token p
        """
        first_needed = max(0, num_computed - (self.spec.window - 1)) // self.block_size
        first_needed = min(first_needed, len(st.table))
        if first_needed <= st.trimmed:
            return
        gone = st.table[st.trimmed:first_needed]
        st.table[st.trimmed:first_needed] = [NULL_BLOCK] * len(gone)
        st.trimmed = first_needed
        # oldest first: a later hit needs the newest window, so the oldest blocks go first
        self.pool.decref([b for b in gone if b != NULL_BLOCK])
