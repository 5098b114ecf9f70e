"""Simulator building blocks: prefix cache, processor-sharing link, batched decode, trace parsing."""

import json

import pytest

from prfaas_sgl.router.planner import Curve, ProfileError
from prfaas_sgl.router.prefix_index import ApproxIndex
from prfaas_sgl.router.sim.resources import DecodeServer, PSLink
from prfaas_sgl.router.sim.workload import SimRequest, read_trace


def req(rid, out=10):
    return SimRequest(rid, 0.0, 100, out, ())


def test_prefix_cache_evicts_leaves_first_like_the_router():
    """The simulator's caches are the router's ApproxIndex. Pins the drift it replaced: the old BlockLRU
    touched parents first, so it evicted from the middle of a chain (here 2), stranding 3 behind it."""
    c = ApproxIndex(3)
    c.insert((1, 2, 3))
    assert c.match((1, 2, 9)) == 2
    c.insert((1, 4))  # one block must go: the oldest leaf (3), never the shared root 1
    assert list(c.lru) == [2, 4, 1] and c.match((1, 2, 3)) == 2 and c.match((1, 4)) == 2
    zero = ApproxIndex(0)
    zero.insert((1,))
    assert zero.match((1,)) == 0 and len(zero) == 0


def test_ps_link_shares_and_reacts_to_rate_change():
    link = PSLink(100.0)  # bytes/s
    a, b = req(0), req(1)
    link.add(a, 100.0, 0.0)
    link.add(b, 300.0, 0.0)
    assert link.next_done() == pytest.approx(2.0)  # 50 B/s each
    assert link.pop_done(2.0) == [a]
    assert link.in_flight(2.0) == pytest.approx(200.0)
    link.set_rate(50.0, 2.0)  # drop to half: b alone at 50 B/s
    assert link.next_done() == pytest.approx(6.0)
    assert link.pop_done(6.0) == [b] and link.in_flight(6.0) == 0.0


def test_decode_batches_and_queues():
    d = DecodeServer("d", max_batch=2, step_s=Curve((1, 2), (0.01, 0.02)), cache=ApproxIndex(0))
    r = [req(i, out=10) for i in range(3)]
    for x in r:
        d.arrive(x, 0.0)
    assert d.inflight() == 3 and len(d.waiting) == 1
    assert d.next_done() == pytest.approx(0.2)  # batch 2: 10 tokens x 20 ms
    assert d.pop_done(0.2) == r[:2]
    assert r[2].decode_start == pytest.approx(0.2)
    assert d.next_done() == pytest.approx(0.3)  # alone: 10 x 10 ms


def test_trace_parsing_and_line_numbers(tmp_path):
    p = tmp_path / "t.jsonl"
    rows = [{"timestamp": 2000, "input_length": 600, "output_length": 5, "hash_ids": [1, 2]},
            {"timestamp": 1000, "input_length": 700, "output_length": 6, "hash_ids": [1, 3]}]
    p.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    reqs = read_trace(p)
    assert [(r.rid, r.arrival, r.input_len, r.hashes) for r in reqs] == [(0, 1.0, 700, (1, 3)), (1, 2.0, 600, (1, 2))]
    p.write_text(json.dumps(rows[0]) + "\n{not json\n")
    with pytest.raises(ProfileError, match=r"t.jsonl:2: not valid JSON"):
        read_trace(p)
    p.write_text(json.dumps(rows[0]) + "\n" + json.dumps({**rows[1], "input_length": -3}) + "\n")
    with pytest.raises(ProfileError, match=r"t.jsonl:2: input_length must be an integer >= 1"):
        read_trace(p)
