"""SlabBlocks: one free list for KV blocks and state blocks (the unified slab). Plain Python, exact ids."""
from __future__ import annotations

import random
import subprocess
import sys

import pytest

from prfaas_sgl.cachepool.slab_blocks import FREE, KV, PAD, STATE, SlabBlocks


def test_block_zero_is_never_handed_out():
    b = SlabBlocks(4)
    assert b.kind[0] == PAD and b.num_free() == 3
    assert b.take_kv(1) == [1] and b.take_state(2) == [2, 3]
    assert b.take_state(1) is None and b.take_kv(1) is None
    b.check()


def test_block_zero_is_reserved_under_python_O():
    """`python -O` strips asserts with their side effects: block 0 (SGLang's padding) must stay reserved."""
    code = ("from prfaas_sgl.cachepool.slab_blocks import SlabBlocks, PAD\n"
            "b = SlabBlocks(4)\n"
            "print(b.kind[0] == PAD, b.take_kv(3))")
    out = subprocess.run([sys.executable, "-O", "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "True [1, 2, 3]"  # block 0 padding, KV gets 1..3


def test_freed_blocks_serve_the_other_kind():
    b = SlabBlocks(5)
    kv = b.take_kv(4)
    assert kv == [1, 2, 3, 4] and b.take_state(1) is None
    b.give([2, 3], KV)
    assert b.take_state(2) == [2, 3]
    b.give([2], STATE)
    assert b.take_kv(1) == [2]
    b.check()


def test_kv_never_takes_the_reserved_blocks_states_may():
    rows = [2]  # free request rows: each may still ask for a working state
    b = SlabBlocks(6, reserve=lambda: rows[0])
    assert (b.kv_usable(), b.kv_capacity()) == (3, 3)
    assert b.take_kv(4) is None and b.take_kv(3) == [1, 2, 3]
    assert b.take_kv(1) is None
    assert b.take_state(2) == [4, 5]  # the two reserved blocks, for the two rows
    assert (b.num_free(), b.kv_capacity()) == (0, 3)


def test_states_never_leave_kv_without_capacity():
    """With no KV block owned, states keep reserve + 1 blocks free: SGLang divides by the KV size."""
    b = SlabBlocks(6, reserve=lambda: 1)
    assert b.state_available() == 3 and b.take_state(4) is None
    assert b.take_state(3) == [1, 2, 3] and b.kv_capacity() == 1
    assert b.take_kv(1) == [4]
    assert b.state_available() == 1  # KV owns a block now: every free block is the states'


def test_wrong_side_or_double_free_changes_nothing():
    b = SlabBlocks(4)
    kv, st = b.take_kv(1), b.take_state(1)
    with pytest.raises(ValueError, match="state"):
        b.give(st, KV)
    b.give(kv, KV)
    with pytest.raises(ValueError):
        b.give(kv, KV)
    assert b.count(KV) == 0 and b.count(STATE) == 1
    b.check()


def test_randomized_capacities_add_up():
    """Each side's capacity == held + may take; the kinds partition the blocks after every step."""
    rng, rows = random.Random(3), [2]
    b = SlabBlocks(12, reserve=lambda: rows[0])
    held = {KV: [], STATE: []}
    for _ in range(400):
        kind = rng.choice((KV, STATE))
        if rng.random() < 0.55:
            got = (b.take_kv if kind == KV else b.take_state)(rng.randint(1, 3))
            held[kind] += got or []
        elif held[kind]:
            rng.shuffle(held[kind])
            n = rng.randint(1, len(held[kind]))
            b.give(held[kind][:n], kind)
            del held[kind][:n]
        rows[0] = rng.randint(0, 2)
        b.check()
        assert b.kv_capacity() == len(held[KV]) + b.kv_usable()
        assert b.state_capacity() == len(held[STATE]) + b.state_available()
        assert set(held[KV]).isdisjoint(held[STATE]) and b.count(FREE) == b.num_free()
