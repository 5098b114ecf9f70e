"""The storage tier on a real Mooncake Store: `mooncake_master` (from the Mooncake wheel in the venv)
on 127.0.0.1 over TCP, Mooncake's own client, every address pinned to loopback. Round trip, a corrupt
entry, the master killed (misses within one RPC timeout, never an exception) and restarted empty."""
from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from prfaas_sgl.cachepool.tiers import KV, STATE, Fingerprint, HostTier, MooncakeStoreBackend, TierStack, encode
from prfaas_sgl.cachepool.tiers.entry import HEADER_BYTES
from prfaas_sgl.cachepool.tiers.master import MooncakeMaster

FP = Fingerprint("tiny|mooncake-tier-test")
PAYLOAD = bytes(range(256)) * 64  # 16 KiB


@pytest.fixture
def master():
    m = MooncakeMaster().start()
    yield m
    m.stop()


@pytest.fixture
def connect(master):
    """Clients of `master`, closed before it stops: an unclosed Mooncake client pings its stopped master
    from background threads for the rest of the pytest process (a log line every few seconds)."""
    made = []

    def client() -> MooncakeStoreBackend:
        made.append(MooncakeStoreBackend(master.addr))
        return made[-1]

    yield client
    for store in made:
        store.close()


def test_entries_spill_from_host_to_mooncake_and_come_back(connect):
    store = connect()
    stack = TierStack(FP, HostTier(HEADER_BYTES + len(PAYLOAD)), store)
    stack.put(KV, 1, PAYLOAD)
    stack.put(STATE, 1, PAYLOAD[::-1])  # pushes KV 1 into Mooncake
    assert stack.stats.stored == 1 and store.exists(FP.key(KV, 1))
    assert stack.get(KV, 1, len(PAYLOAD)) == PAYLOAD
    assert stack.get(STATE, 1, len(PAYLOAD)) == PAYLOAD[::-1]
    assert (stack.stats.storage_hits, stack.stats.host_hits, stack.stats.misses) == (1, 1, 0)


def test_a_corrupt_mooncake_entry_is_a_miss_and_is_removed(connect):
    store = connect()
    stack = TierStack(FP, None, store)
    bad = bytearray(encode(FP, KV, 3, PAYLOAD))
    bad[-1] ^= 1
    assert store.put(FP.key(KV, 3), bytes(bad))
    assert stack.get(KV, 3, len(PAYLOAD)) is None
    assert stack.stats.corrupt == 1 and not store.exists(FP.key(KV, 3))


def test_a_dead_then_empty_master_gives_misses_and_the_tier_recovers(master, connect):
    store = connect()
    stack = TierStack(FP, None, store, retry_s=1.0)
    stack.put(KV, 10, PAYLOAD)
    master.stop()
    t0 = time.monotonic()
    assert stack.get(KV, 10, len(PAYLOAD)) is None  # down: a miss, not an exception
    stack.put(KV, 11, PAYLOAD)
    assert stack.get(KV, 11, len(PAYLOAD)) is None
    assert time.monotonic() - t0 < 15  # at most one RPC timeout per retry window (~4.4 s measured)
    master.start()  # restarted empty (same port): everything written before is gone
    time.sleep(1.2)  # past the retry window
    assert stack.get(KV, 10, len(PAYLOAD)) is None
    deadline = time.monotonic() + 20  # the client remounts its segment on the new master
    while time.monotonic() < deadline and stack.get(KV, 12, len(PAYLOAD)) is None:
        time.sleep(1.2)
        stack.put(KV, 12, PAYLOAD)
    assert stack.get(KV, 12, len(PAYLOAD)) == PAYLOAD


def test_entries_injected_straight_into_the_master_are_refused_under_a_tier_key(connect):
    """Anyone who reaches mooncake_master can put any key: an unsigned entry and one signed under another
    key, each well formed for this model, are refused by a keyed reader, counted and removed; the
    reader's own signed entry loads."""
    key = b"k" * 64
    attacker = connect()  # a second client of the same master
    assert attacker.put(FP.key(KV, 20), encode(FP, KV, 20, PAYLOAD))
    assert attacker.put(FP.key(STATE, 20), encode(FP, STATE, 20, PAYLOAD, b"x" * 64))
    stack = TierStack(FP, None, connect(), key=key)
    assert stack.get(KV, 20, len(PAYLOAD)) is None and stack.get(STATE, 20, len(PAYLOAD)) is None
    assert stack.stats.refused_mac == 2 and stack.stats.corrupt == 0
    assert not attacker.exists(FP.key(KV, 20)) and not attacker.exists(FP.key(STATE, 20))
    stack.storage.put(FP.key(KV, 22), encode(FP, KV, 22, PAYLOAD, key))
    assert stack.get(KV, 22, len(PAYLOAD)) == PAYLOAD


def test_a_hung_master_holds_the_caller_no_longer_than_the_call_deadline(master, connect):
    """A stopped (SIGSTOP) master accepts connections and never answers: Mooncake's client then holds each
    call for 30 s (measured). With a 1 s deadline the get is a miss after ~1 s, the tier is skipped, the
    stuck call blocks nothing else, and once the master runs again the entry loads."""
    store = connect()
    stack = TierStack(FP, None, store, retry_s=0.5, call_timeout_s=1.0)
    stack.put(KV, 30, PAYLOAD)
    master.hang()
    try:
        t0 = time.monotonic()
        assert stack.get(KV, 30, len(PAYLOAD)) is None
        assert time.monotonic() - t0 < 3.0  # was 30 s without the deadline
        time.sleep(0.6)  # past the retry window: the stuck call is still pending, so this fails at once
        t1 = time.monotonic()
        stack.put(KV, 31, PAYLOAD)
        assert stack.get(KV, 31, len(PAYLOAD)) is None and time.monotonic() - t1 < 0.5
        t2 = time.monotonic()  # a hit's plan (one batched exists) is bounded the same way
        assert stack.present([(KV, 30), (KV, 31)]) == set() and time.monotonic() - t2 < 0.5
        assert stack.stats.storage_errors >= 2
    finally:
        master.resume()
    deadline = time.monotonic() + 40  # the stuck call returns once the master answers again
    while time.monotonic() < deadline and stack.get(KV, 30, len(PAYLOAD)) is None:
        time.sleep(0.5)
    assert stack.get(KV, 30, len(PAYLOAD)) == PAYLOAD


def test_an_absent_master_is_named_at_once():
    from prfaas_sgl.cachepool.tiers.master import free_port

    t0 = time.monotonic()
    with pytest.raises(ConnectionError, match="not reachable"):
        MooncakeStoreBackend(f"127.0.0.1:{free_port()}")
    assert time.monotonic() - t0 < 1.0  # Mooncake's setup alone: ~88 s of retries (measured)


def test_a_master_that_accepts_and_never_answers_at_setup_is_named_within_the_probe_bound(master):
    """Regression ("never a hang"): a stopped master accepts TCP connections, so the connect probe
    passes, and Mooncake's setup then never returned; it keeps the GIL, so no thread could bound it. The
    setup is tried first in a child process, killed at SETUP_PROBE_TIMEOUT_S (none left behind); once the
    master runs again the backend sets up and an entry round-trips."""
    from prfaas_sgl.cachepool.tiers.storage import SETUP_PROBE_TIMEOUT_S

    master.hang()
    try:
        t0 = time.monotonic()
        with pytest.raises(ConnectionError, match=f"{master.addr} accepts connections but .* no answer"):
            MooncakeStoreBackend(master.addr)
        assert SETUP_PROBE_TIMEOUT_S <= time.monotonic() - t0 < SETUP_PROBE_TIMEOUT_S + 2.0
        assert _children() == {master.proc.pid}
    finally:
        master.resume()
    store = MooncakeStoreBackend(master.addr)
    assert store.put("after-sigcont", PAYLOAD) and store.get("after-sigcont", len(PAYLOAD)) == PAYLOAD
    store.close()


def _children() -> set[int]:
    """Pids of this process's live children (zombies included: a child not waited for is one left behind)."""
    pids = set()
    for d in os.listdir("/proc"):
        try:
            with open(f"/proc/{d}/stat") as f:
                if int(f.read().rsplit(")", 1)[1].split()[1]) == os.getpid():
                    pids.add(int(d))
        except (OSError, ValueError, IndexError):
            continue
    return pids


def test_a_hung_master_has_every_thread_stopped_when_hang_returns(master):
    """kill(SIGSTOP) only queues the stop; the fault tests above read a miss right after it, so hang() must
    return only once none of the master's threads can answer (with two busy cores, 84 of 200 plain kills
    left some of its 22 threads running for up to 6 ms)."""
    for _ in range(20):
        master.hang()
        states = {(t / "stat").read_text().rsplit(")", 1)[1].split()[0]
                  for t in Path(f"/proc/{master.proc.pid}/task").iterdir()}
        assert states == {"T"}, states
        master.resume()
