"""Workload generation: length distributions, seeding, multi-turn sessions, prompt text."""

import math
from statistics import NormalDist

import numpy as np
import pytest

from prfaas_sgl.tools.loadgen.prompts import PromptBuilder
from prfaas_sgl.tools.loadgen.workload import SyntheticSpec, synthesize
from prfaas_sgl.workload.arrivals import ArrivalSpec
from prfaas_sgl.workload.lengths import Fixed, TruncLogNormal, Uniform, parse_length_dist, scaled


def test_paper_lognormal_mean_and_bounds():
    d = parse_length_dist("paper")
    assert d == TruncLogNormal(9.9, 1.0, 128, 131072)
    # paper-notes §3: mean ~27.5K tokens
    assert d.mean == pytest.approx(27.5e3, rel=0.01)
    x = d.sample(np.random.default_rng(0), 40_000)
    assert x.min() >= 128 and x.max() <= 131072
    # std of the truncated law is ~24K; 40K samples -> standard error ~120 tokens
    assert x.mean() == pytest.approx(d.mean, abs=600)
    # median of the truncated law: the midpoint of the kept CDF mass (upper cut moves it below e^mu)
    nd = NormalDist()
    pa, pb = nd.cdf((math.log(128) - 9.9) / 1.0), nd.cdf((math.log(131072) - 9.9) / 1.0)
    assert np.median(x) == pytest.approx(math.exp(9.9 + nd.inv_cdf((pa + pb) / 2)), rel=0.02)


def test_scale_shrinks_lengths_and_keeps_at_least_one_token():
    d = parse_length_dist("paper")
    x = scaled(d.sample(np.random.default_rng(1), 5000), 1 / 64)
    assert x.min() >= 2 and x.max() <= 2048
    assert scaled(Fixed(10).sample(np.random.default_rng(0), 3), 0.01).tolist() == [1, 1, 1]
    u = Uniform(5, 7).sample(np.random.default_rng(0), 1000)
    assert set(u.tolist()) == {5, 6, 7}


@pytest.mark.parametrize("spec", ["fixed", "fixed:0", "uniform:5", "uniform:9:3", "lognormal:1:0:1:2", "zipf:1",
                                  "lognormal:9.9:1:100:50"])
def test_bad_length_specs_say_what_to_use(spec):
    with pytest.raises(ValueError, match="spec|must|needs"):
        parse_length_dist(spec)


def _spec(**kw):
    base = dict(n_sessions=20, input_len="paper", output_len="uniform:16:64", scale=1 / 64, turns=3,
                followup_len="fixed:512", shared_prefix=1024, prefix_groups=2)
    base = {("input_dist" if k == "input_len" else "output_dist" if k == "output_len" else
             "followup_dist" if k == "followup_len" else "shared_prefix_len" if k == "shared_prefix" else k): v
            for k, v in {**base, **kw}.items()}
    return SyntheticSpec(**base)


def test_same_seed_same_workload_and_arrivals_do_not_change_lengths():
    a = synthesize(_spec(), ArrivalSpec("poisson", 2.0), seed=7)
    b = synthesize(_spec(), ArrivalSpec("poisson", 2.0), seed=7)
    c = synthesize(_spec(), ArrivalSpec("poisson", 2.0), seed=8)
    d = synthesize(_spec(), ArrivalSpec("uniform", 5.0), seed=7)
    assert a == b
    assert [s.turns for s in a.sessions] != [s.turns for s in c.sessions]
    assert [s.turns for s in a.sessions] == [s.turns for s in d.sessions]
    assert [s.start_s for s in d.sessions] == [i / 5.0 for i in range(20)]


def test_multi_turn_sessions_extend_their_prefix_and_share_group_prefix():
    w = synthesize(_spec(), None, seed=3)
    assert w.block_size == 8  # 512 / 64
    prefix_blocks = 1024 // 64 // 8
    for s in w.sessions:
        assert s.start_s == 0.0  # closed loop
        for prev, nxt in zip(s.turns, s.turns[1:]):
            assert nxt.hash_ids[: len(prev.hash_ids)] == prev.hash_ids
            assert nxt.input_len == prev.input_len + prev.output_len + 512 // 64
        for t in s.turns:
            assert len(t.hash_ids) == -(-t.input_len // w.block_size)
            assert t.input_len <= 2048  # capped at the scaled distribution maximum
        group = w.sessions[s.index % 2].turns[0].hash_ids[:prefix_blocks]
        assert s.turns[0].hash_ids[:prefix_blocks] == group
    g0, g1 = w.sessions[0].turns[0].hash_ids, w.sessions[1].turns[0].hash_ids
    assert set(g0[:prefix_blocks]).isdisjoint(g1[:prefix_blocks])
    private = [set(s.turns[-1].hash_ids[prefix_blocks:]) for s in w.sessions]
    assert sum(map(len, private)) == len(set().union(*private))  # private blocks never shared


def test_prompts_share_text_exactly_as_far_as_hash_ids_agree():
    pb = PromptBuilder(seed=0, block_size=8)
    a = pb.build((1, 2, 3), 20)
    b = pb.build((1, 2, 4), 24)
    assert len(a.split()) == 20 and len(b.split()) == 24
    assert a.split()[:16] == b.split()[:16] and a.split()[16:20] != b.split()[16:20]
    assert pb.build((1, 2, 3), 13) == a[: len(pb.build((1, 2, 3), 13))]  # a cut block is a prefix
    # missing ids are private to the request key, deterministic, and never equal to real ids
    assert pb.build((1,), 16, (5, 0)) == pb.build((1,), 16, (5, 0)) != pb.build((1,), 16, (6, 0))
    assert PromptBuilder(seed=0, block_size=8).build((1, 2, 3), 20) == a
    assert PromptBuilder(seed=1, block_size=8).build((1, 2, 3), 20) != a


def _train_tokenizer(path):
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    from prfaas_sgl.tools.loadgen.words import WORDS

    tok = Tokenizer(models.BPE(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(vocab_size=600, special_tokens=["[UNK]"], show_progress=False)
    # Half the words appear often enough to become single tokens, the rest stay split.
    corpus = [" ".join(WORDS[: len(WORDS) // 2])] * 50 + [" ".join(WORDS)]
    tok.train_from_iterator(corpus, trainer)
    tok.save(str(path))


def test_tokenizer_mode_hits_lengths_exactly(tmp_path):
    path = tmp_path / "tokenizer.json"
    _train_tokenizer(path)
    pb = PromptBuilder(seed=0, block_size=16, tokenizer_path=str(path))
    for n in (1, 15, 16, 17, 100, 333):
        text = pb.build(tuple(range(n // 16 + 1)), n, (n,))
        assert pb.count_tokens(text) == n
    a, b = pb.build((1, 2), 32), pb.build((1, 3), 32)
    assert a[: len(a) // 2 - 5] == b[: len(a) // 2 - 5]


def test_tokenizer_resolution(tmp_path):
    from prfaas_sgl.tools.loadgen.prompts import resolve_tokenizer

    (tmp_path / "tokenizer.json").write_text("{}")
    assert resolve_tokenizer("auto", str(tmp_path)) == str(tmp_path / "tokenizer.json")
    assert resolve_tokenizer("auto", "some-served-name") is None
    assert resolve_tokenizer("none", str(tmp_path)) is None
    assert resolve_tokenizer(str(tmp_path / "tokenizer.json"), "x") == str(tmp_path / "tokenizer.json")
    with pytest.raises(ValueError, match="not a file"):
        resolve_tokenizer(str(tmp_path / "missing.json"), "x")
