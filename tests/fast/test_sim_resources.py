"""Simulator building blocks: LRU cache, processor-sharing link, batched decode, trace parsing."""

import json

import pytest

from prfaas_sgl.router.planner import Curve, ProfileError
from prfaas_sgl.router.sim.resources import BlockLRU, DecodeServer, PSLink
from prfaas_sgl.router.sim.workload import SimRequest, read_trace


def req(rid, out=10):
    return SimRequest(rid, 0.0, 100, out, ())


def test_lru_prefix_match_and_eviction():
    c = BlockLRU(3)
    c.insert((1, 2, 3))
    assert c.match((1, 2, 9)) == 2
    c.insert((1, 4))  # 2 is now least recently used
    assert list(c.blocks) == [3, 1, 4] and c.match((1, 2)) == 1
    assert BlockLRU(0).match((1,)) == 0


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
    d = DecodeServer("d", max_batch=2, step_s=Curve((1, 2), (0.01, 0.02)), cache=BlockLRU(0))
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
    with pytest.raises(ProfileError, match=r"t.jsonl:2: field 'input_length' must be a number >= 0"):
        read_trace(p)
