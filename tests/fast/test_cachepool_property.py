"""Random operation sequences on a hybrid pool (full + SWA + linear); check_integrity() after every
step, and every hit must be a prefix that some request really computed and committed."""
from __future__ import annotations

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from prfaas_sgl.cachepool import (GroupSpec, HybridCachePool, PoolConfig, PoolExhaustedError,
                                  RequestTooLongError)

BS = 4
GROUPS = (
    GroupSpec("attn", "full", 1, kv_bytes_per_token=8),
    GroupSpec("swa", "swa", 1, kv_bytes_per_token=8, window=6),
    GroupSpec("gdn", "linear", 1, state_bytes=60, checkpoint_interval=8),  # 2 blocks per state
)
PREFIXES = [list(range(0, 40)), list(range(100, 140)), [7] * 40]


class PoolMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.pool = HybridCachePool(PoolConfig(48, BS, GROUPS, enable_events=True))
        self.live: dict[str, list] = {}  # req_id -> [tokens, allocated, computed]
        self.committed: set[tuple[int, ...]] = set()  # block-aligned prefixes ever committed
        self.n = 0

    @rule(p=st.integers(0, 2), cut=st.integers(0, 40), tail=st.lists(st.integers(0, 3), max_size=12),
          chunk=st.integers(1, 60), transfer=st.booleans())
    def admit(self, p, cut, tail, chunk, transfer):
        tokens = PREFIXES[p][:cut] + tail
        if not tokens:
            return
        rid, self.n = f"r{self.n}", self.n + 1
        hit = self.pool.match(tokens)
        try:
            a = self.pool.admit(rid, tokens, min(len(tokens), hit + chunk), transfer=transfer)
        except (PoolExhaustedError, RequestTooLongError):
            return
        assert a.num_cached_tokens == hit and hit % BS == 0 and hit < len(tokens)
        if hit:
            assert tuple(tokens[:hit]) in self.committed, "hit on a prefix nobody committed"
        self.live[rid] = [tokens, a.num_tokens, hit]

    @precondition(lambda self: self.live)
    @rule(data=st.data(), step=st.integers(1, 60))
    def compute(self, data, step):
        rid = data.draw(st.sampled_from(sorted(self.live)))
        tokens, allocated, computed = self.live[rid]
        done = min(allocated, computed + step)
        self.pool.commit(rid, done)
        for k in range(BS, done + 1, BS):
            self.committed.add(tuple(tokens[:k]))
        self.live[rid][2] = done

    @precondition(lambda self: self.live)
    @rule(data=st.data(), step=st.integers(1, 60), extra=st.lists(st.integers(0, 3), max_size=6))
    def grow(self, data, step, extra):
        rid = data.draw(st.sampled_from(sorted(self.live)))
        tokens, allocated, _ = self.live[rid]
        if allocated == len(tokens):  # prefill done: decode appends tokens
            tokens = tokens + extra
        try:
            a = self.pool.grow(rid, min(len(tokens), allocated + step), tokens)
        except PoolExhaustedError:
            return
        self.live[rid][0], self.live[rid][1] = tokens, a.num_tokens

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def free(self, data):
        rid = data.draw(st.sampled_from(sorted(self.live)))
        self.pool.free(rid)
        del self.live[rid]

    @invariant()
    def integrity(self):
        self.pool.check_integrity()
        u = self.pool.usage()
        assert u.free + u.cached_idle + u.in_use == u.total
        if not self.live:
            assert u.in_use == 0


TestPoolMachine = PoolMachine.TestCase
TestPoolMachine.settings = settings(max_examples=60, stateful_step_count=40, deadline=None,
                                    suppress_health_check=[HealthCheck.too_slow])
