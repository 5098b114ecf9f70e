"""Mooncake-style trace files: JSON Lines, one request per line (the load generator replays them, the
simulator and the planner read them).

    {"timestamp": 0, "input_length": 6955, "output_length": 52, "hash_ids": [46, 47, 48, ...]}

``timestamp`` is milliseconds from the trace start. Each hash id stands for one block of ``block_size``
prompt tokens (512 by default, the Mooncake convention); requests whose ``hash_ids`` start with the same
ids share that many blocks of prompt prefix. Only the last block may be partial:
``len(hash_ids) == ceil(input_length / block_size)`` in a well-formed trace (not enforced: extra ids are
ignored and missing ones are filled with request-private blocks when prompts are built).
Blank lines are skipped; any other malformed line raises :class:`TraceError` naming the line.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

REQUIRED = ("timestamp", "input_length", "output_length", "hash_ids")


class TraceError(ValueError):
    """A trace line is malformed; ``line`` is 1-based."""

    def __init__(self, path: str, line: int, why: str) -> None:
        super().__init__(f"{path}:{line}: {why}")
        self.path = path
        self.line = line


@dataclass(frozen=True, slots=True)
class TraceRecord:
    timestamp_ms: float
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]

    def to_json(self) -> str:
        ts = int(self.timestamp_ms) if float(self.timestamp_ms).is_integer() else self.timestamp_ms
        return json.dumps(
            {
                "timestamp": ts,
                "input_length": self.input_length,
                "output_length": self.output_length,
                "hash_ids": list(self.hash_ids),
            }
        )


def _int_field(obj: dict, key: str, minimum: int) -> int:
    v = obj[key]
    if isinstance(v, bool) or not isinstance(v, int) or v < minimum:
        raise ValueError(f"{key} must be an integer >= {minimum}, got {v!r}")
    return v


def parse_line(text: str) -> TraceRecord:
    """Parse one non-blank line; ValueError says which field is wrong."""
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"not valid JSON ({e.msg})") from e
    if not isinstance(obj, dict):
        raise ValueError("expected a JSON object")
    missing = [k for k in REQUIRED if k not in obj]
    if missing:
        raise ValueError(f"missing field(s) {missing}")
    ts = obj["timestamp"]
    if isinstance(ts, bool) or not isinstance(ts, (int, float)) or ts < 0:
        raise ValueError(f"timestamp must be a number of ms >= 0, got {ts!r}")
    ids = obj["hash_ids"]
    if not isinstance(ids, list) or not all(isinstance(h, int) and not isinstance(h, bool) for h in ids):
        raise ValueError("hash_ids must be a list of integers")
    return TraceRecord(float(ts), _int_field(obj, "input_length", 1), _int_field(obj, "output_length", 1),
                       tuple(ids))


def read_trace(path: str | Path, limit: int | None = None) -> list[TraceRecord]:
    """The first ``limit`` records (all if None) of a trace file, sorted by timestamp (stable, so equal
    timestamps keep file order)."""
    records: list[TraceRecord] = []
    with open(path, encoding="utf-8") as f:
        for lineno, text in enumerate(f, start=1):
            if limit is not None and len(records) >= limit:
                break
            if not text.strip():
                continue
            try:
                records.append(parse_line(text))
            except ValueError as e:
                raise TraceError(str(path), lineno, str(e)) from e
    records.sort(key=lambda r: r.timestamp_ms)
    return records


def write_trace(path: str | Path, records: Iterable[TraceRecord]) -> int:
    """Write records as JSONL; returns the number written."""
    n = 0
    with open(path, "w", encoding="utf-8") as f:
        for r in records:
            f.write(r.to_json() + "\n")
            n += 1
    return n
