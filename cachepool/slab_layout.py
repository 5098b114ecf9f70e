"""SlabLayout: block sizes aligned so ONE block id holds either a KV page or one linear-attention state.

Plain Python (no torch): the bytes of a block, where each K/V row and each state part sits in it, and the
PoolConfig whose groups allocate from that one pool. `slab.Slab` lays tensors over it.

The rule (vLLM v1's hybrid alignment): raise the attention block until one KV page holds a state.

    E  = sum over full layers of (K row + V row)         bytes of one token, all full layers
    S  = sum over state parts of (layers x part bytes)   bytes of one state, all linear layers
    bs = smallest multiple of `granularity` with bs * E >= S     tokens per block
    B  = bs * E                                           bytes per block (the state is padded to B)

    KV page (block b):  token b*bs+i at byte (b*bs + i) * E of the slab, layer l's K at + k_off[l],
                        V at + v_off[l]:  [ L0.K L0.V L1.K L1.V ... ][ next token ] ... (bs tokens)
    state   (block b):  [ part0: layer0 layer1 ... | part1: layer0 ... | pad ]  at byte b * B

B being exactly bs * E makes token slot t sit at t * E whatever its block, so each layer's K and V is
one strided tensor over the whole slab, and a state is always one block (never a run of blocks).
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from .config import PoolConfig
from .specs import GroupSpec, PoolLayoutError

ALIGN = 16  # state parts start on 16-byte boundaries, so any dtype view of them is aligned


@dataclass(frozen=True, slots=True)
class StatePart:
    """One state tensor of every linear layer (e.g. the conv state, the recurrent state).
    layer_bytes: one layer's bytes for one sequence. offset: where the part starts in a block."""

    name: str
    layer_bytes: int
    num_layers: int
    offset: int

    @property
    def nbytes(self) -> int:
        return self.layer_bytes * self.num_layers


@dataclass(frozen=True, slots=True)
class SlabLayout:
    """kv_rows[l] = (K row bytes, V row bytes) of full layer l for one token; kv_offsets[l] = their
    byte offsets in a token's envelope. state_bytes: S (unpadded). See the module docstring."""

    tokens_per_block: int
    token_bytes: int
    block_bytes: int
    kv_rows: tuple[tuple[int, int], ...]
    kv_offsets: tuple[tuple[int, int], ...]
    state_parts: tuple[StatePart, ...]
    state_bytes: int

    @classmethod
    def plan(cls, kv_rows: Sequence[tuple[int, int]], state_parts: Sequence[tuple[str, int, int]],
             granularity: int) -> "SlabLayout":
        """kv_rows: (K bytes, V bytes) per full layer and token. state_parts: (name, bytes per layer,
        linear layers) per state tensor. granularity: tokens_per_block is a multiple of it (the prefix
        hash block; a checkpoint interval must be a multiple of tokens_per_block)."""
        _check_inputs(kv_rows, state_parts, granularity)
        offsets, pos = [], 0
        for k, v in kv_rows:
            offsets.append((pos, pos + k))
            pos += k + v
        parts, s = [], 0
        for name, layer_bytes, layers in state_parts:
            parts.append(StatePart(name, layer_bytes, layers, s))
            s = _round_up(s + layer_bytes * layers, ALIGN)
        state_bytes = parts[-1].offset + parts[-1].nbytes
        bs = _round_up(-(-state_bytes // pos), granularity)
        return cls(bs, pos, bs * pos, tuple(map(tuple, kv_rows)), tuple(offsets), tuple(parts),
                   state_bytes)

    def part(self, name: str) -> StatePart:
        for p in self.state_parts:
            if p.name == name:
                return p
        raise KeyError(f"no state part {name!r}; parts are {[p.name for p in self.state_parts]}")

    @property
    def state_padding(self) -> float:
        """Fraction of a state block that is padding (the price of one block size for both kinds)."""
        return 1 - self.state_bytes / self.block_bytes

    def groups(self, checkpoint_interval: int, full: str = "full", linear: str = "linear") -> tuple[GroupSpec, ...]:
        """GroupSpecs whose full page is exactly one block and whose state is exactly one block.
        Both are declared as one layer of E (resp. S) bytes: the pool only needs the sizes."""
        return (GroupSpec(full, "full", 1, kv_bytes_per_token=self.token_bytes),
                GroupSpec(linear, "linear", 1, state_bytes=self.state_bytes,
                          checkpoint_interval=checkpoint_interval))

    def pool_config(self, num_blocks: int, checkpoint_interval: int, **kwargs) -> PoolConfig:
        cfg = PoolConfig(num_blocks, self.tokens_per_block, self.groups(checkpoint_interval), **kwargs)
        assert cfg.block_bytes == self.block_bytes, (cfg.block_bytes, self.block_bytes)
        return cfg


def _check_inputs(kv_rows: Sequence[tuple[int, int]], state_parts: Sequence[tuple[str, int, int]],
                  granularity: int) -> None:
    if granularity < 1:
        raise PoolLayoutError(f"granularity={granularity}; use >= 1 tokens")
    if not kv_rows or any(k <= 0 or v <= 0 for k, v in kv_rows):
        raise PoolLayoutError(f"kv_rows={list(kv_rows)}: pass (K bytes, V bytes) > 0 for each full layer")
    if not state_parts or any(b <= 0 or n < 1 for _, b, n in state_parts):
        raise PoolLayoutError(f"state_parts={list(state_parts)}: pass (name, bytes > 0, layers >= 1) per "
                              f"state tensor; a model without linear layers needs no slab")
    names = [n for n, _, _ in state_parts]
    if len(set(names)) != len(names):
        raise PoolLayoutError(f"state part names {names} repeat")


def _round_up(x: int, m: int) -> int:
    return -(-x // m) * m
