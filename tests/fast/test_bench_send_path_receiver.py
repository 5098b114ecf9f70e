"""scripts/bench_send_path.py's receiver process keeps a case's `ZmqReceiver` open until the parent moves
on. It used to close it right after its last request read DONE; the receiver is DONE as soon as it has
queued its Done reply, and close() (LINGER 0) discarded that reply, so the parent's last request of a case
timed out now and then (all bytes acknowledged, no Done: the first run of the benchmark died that way)."""
from __future__ import annotations

import importlib.util
import json
import os
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import prfaas_sgl.transfer.receiver as receiver_mod
from prfaas_sgl.transfer.config import TransferConfig

_BENCH = Path(__file__).resolve().parents[2] / "scripts" / "bench_send_path.py"


def _bench():
    spec = importlib.util.spec_from_file_location("bench_send_path", _BENCH)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # its dataclasses resolve their annotations through sys.modules
    spec.loader.exec_module(mod)
    return mod


class _Receiver:
    """Stands in for ZmqReceiver: every expected transfer is DONE at once; records close()."""

    instances: list["_Receiver"] = []

    def __init__(self, *_a, **_kw) -> None:
        self.address = SimpleNamespace(port=4242)
        self.closed_at: float | None = None
        _Receiver.instances.append(self)

    def expect(self, *_a, **_kw) -> None:
        pass

    def wait(self, _tid, _timeout):
        return SimpleNamespace(state=SimpleNamespace(value="done"), reason="")

    def close(self) -> None:
        self.closed_at = time.monotonic()


def test_receiver_outlives_its_last_request_until_the_parent_moves_on(monkeypatch):
    bench = _bench()
    monkeypatch.setattr(receiver_mod, "ZmqReceiver", _Receiver)
    _Receiver.instances = []
    r_in, w_in = os.pipe()
    r_out, w_out = os.pipe()
    stdin, to_child = os.fdopen(r_in, "r"), os.fdopen(w_in, "w")
    from_child, stdout = os.fdopen(r_out, "r"), os.fdopen(w_out, "w")
    monkeypatch.setattr(sys, "stdin", stdin)
    monkeypatch.setattr(sys, "stdout", stdout)
    child = threading.Thread(target=bench.serve_receiver, args=("127.0.0.1",), daemon=True)
    child.start()
    try:
        for case in ([64, 64, False, 2], [64, 64, True, 1]):
            to_child.write(json.dumps(case) + "\n")
            to_child.flush()
            assert json.loads(from_child.readline()) == {"port": 4242}
            results = [json.loads(from_child.readline()) for _ in range(case[3])]
            assert {r["state"] for r in results} == {"done"}
            time.sleep(0.3)  # the old code closed right after printing the last result
            assert _Receiver.instances[-1].closed_at is None, "receiver closed before the parent moved on"
        first, second = _Receiver.instances
        assert first.closed_at is not None  # the next case line closed the first case's receiver
        to_child.close()  # end of input: the last receiver closes
        child.join(10)
        assert not child.is_alive()
        assert second.closed_at is not None
    finally:
        for f in (to_child, from_child, stdout, stdin):
            try:
                f.close()
            except (OSError, ValueError):
                pass


def test_a_decode_behind_the_tbf_link_registers_from_its_own_address():
    """The link runs put the receiver in a network namespace (10.77.x.2): its Register must name and come
    from that address, as a prefill admits a decode only from the host it names. The harness registered it
    as 127.0.0.1 with a 10.77 data host: refused, and every link request waited out its 300 s."""
    bench = _bench()
    case = bench.Case(64, 64, False)
    args, arrays = bench.kv_args(case)
    m = bench.prefill_manager(args, TransferConfig(timeout_s=5))
    try:
        bench._register(m, "10.77.0.2", 4242, m.memory.layout)
        assert "10.77.0.2:5555" in m.peers
    finally:
        m.sender.close()
        del arrays
