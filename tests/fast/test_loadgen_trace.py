"""Mooncake-style traces: parsing, errors with line numbers, round trips, make_trace.py."""

import importlib.util
import json
from pathlib import Path

import pytest

from prfaas_sgl.tools.loadgen.workload import from_trace
from prfaas_sgl.workload.traces import TraceError, TraceRecord, read_trace, write_trace

ROOT = Path(__file__).resolve().parents[2]
GOOD = [
    {"timestamp": 0, "input_length": 6955, "output_length": 52, "hash_ids": list(range(46, 60))},
    {"timestamp": 2500, "input_length": 1024, "output_length": 8, "hash_ids": [46, 47]},
    {"timestamp": 1000.5, "input_length": 10, "output_length": 1, "hash_ids": []},
]


def _write(tmp_path, lines):
    p = tmp_path / "t.jsonl"
    p.write_text("\n".join(lines) + "\n")
    return p


def test_parse_sorts_by_timestamp_and_skips_blank_lines(tmp_path):
    p = _write(tmp_path, [json.dumps(GOOD[0]), "", json.dumps(GOOD[1]), "   ", json.dumps(GOOD[2])])
    recs = read_trace(p)
    assert [r.timestamp_ms for r in recs] == [0.0, 1000.5, 2500.0]
    assert recs[0] == TraceRecord(0.0, 6955, 52, tuple(range(46, 60)))


@pytest.mark.parametrize("bad, why", [
    ("{not json", "not valid JSON"),
    ("[1, 2]", "JSON object"),
    ('{"timestamp": 0, "input_length": 5, "output_length": 1}', "missing field"),
    ('{"timestamp": -1, "input_length": 5, "output_length": 1, "hash_ids": []}', "timestamp"),
    ('{"timestamp": 0, "input_length": 0, "output_length": 1, "hash_ids": []}', "input_length"),
    ('{"timestamp": 0, "input_length": 5, "output_length": 2.5, "hash_ids": []}', "output_length"),
    ('{"timestamp": 0, "input_length": 5, "output_length": 1, "hash_ids": [1, "a"]}', "hash_ids"),
    ('{"timestamp": 0, "input_length": true, "output_length": 1, "hash_ids": []}', "input_length"),
])
def test_bad_line_error_names_the_line(tmp_path, bad, why):
    p = _write(tmp_path, [json.dumps(GOOD[0]), "", bad, json.dumps(GOOD[1])])
    with pytest.raises(TraceError, match=why) as e:
        read_trace(p)
    assert e.value.line == 3
    assert f"{p}:3:" in str(e.value)


def test_write_read_round_trip(tmp_path):
    recs = [TraceRecord(0.0, 100, 10, (1, 2)), TraceRecord(12.5, 300, 20, (1, 2, 3))]
    p = tmp_path / "rt.jsonl"
    assert write_trace(p, recs) == 2
    assert read_trace(p) == recs
    assert json.loads(p.read_text().splitlines()[0])["timestamp"] == 0  # whole ms written as ints


def test_from_trace_scales_lengths_block_size_and_time():
    recs = [TraceRecord(1000.0, 1024, 64, (1, 2)), TraceRecord(3000.0, 2048, 128, (1, 2, 3, 4))]
    w = from_trace(recs, block_size=512, scale=1 / 64, speedup=2.0)
    assert w.block_size == 8
    assert [s.start_s for s in w.sessions] == [0.0, 1.0]
    assert [(s.turns[0].input_len, s.turns[0].output_len) for s in w.sessions] == [(16, 1), (32, 2)]
    assert w.sessions[1].turns[0].hash_ids == (1, 2, 3, 4)


def _make_trace():
    spec = importlib.util.spec_from_file_location("make_trace", ROOT / "scripts" / "make_trace.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_make_trace_is_seeded_and_well_formed(tmp_path):
    mt = _make_trace()
    args = ["--num-sessions", "30", "--turns", "3", "--think-time", "2", "--shared-prefix", "1024",
            "--prefix-groups", "3", "--rate", "4", "--seed", "9"]
    a, b, c = tmp_path / "a.jsonl", tmp_path / "b.jsonl", tmp_path / "c.jsonl"
    assert mt.main(["--out", str(a), *args]) == 0
    assert mt.main(["--out", str(b), *args]) == 0
    assert mt.main(["--out", str(c), *args[:-1], "10"]) == 0
    assert a.read_bytes() == b.read_bytes() != c.read_bytes()
    recs = read_trace(a)
    assert 30 <= len(recs) <= 90
    assert all(len(r.hash_ids) == -(-r.input_length // 512) for r in recs)
    assert len({r.hash_ids[:2] for r in recs}) == 3  # 1024 tokens = 2 blocks, 3 prefix groups
    assert mt.main(["--out", str(a), "--input-len", "bogus"]) == 2
