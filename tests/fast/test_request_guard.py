"""The plugin's request guard (prfaas_sgl/srt/request_guard.py): what it refuses before SGLang's scheduler sees it.

The real-server proof (a request with an out-of-vocabulary id killed a prefill before the guard) is
tests/sglang/test_hostile_requests.py; these pin the rules themselves.
"""
from __future__ import annotations

from types import SimpleNamespace

import pytest

from prfaas_sgl.srt import request_guard as guard

VOCAB = 1000


@pytest.mark.parametrize("ids,needle", [
    ([1, VOCAB], "input_ids[1] = 1000"),
    ([-1], "input_ids[0] = -1"),
    ([True, 2], "input_ids[0] must be an integer"),
    ([1, 2**70], "valid: 0 <= id < 1000"),
    ([1.0], "must be an integer"),
    (["7"], "must be an integer"),
    ("12", "must be a list"),
])
def test_prompt_ids_outside_the_vocabulary_are_named(ids, needle):
    problem = guard.prompt_problem(ids, VOCAB)
    assert problem is not None and needle in problem


def test_prompt_ids_inside_the_vocabulary_pass():
    assert guard.prompt_problem([0, 1, VOCAB - 1], VOCAB) is None


@pytest.mark.parametrize("params,needle", [
    ({"stop_token_ids": [VOCAB]}, "stop_token_ids"),
    ({"stop_token_ids": [True]}, "stop_token_ids"),
    ({"stop_token_ids": "x"}, "stop_token_ids"),
])
def test_sampling_values_that_crash_the_scheduler_are_refused(params, needle):
    problem = guard.sampling_problem(params, VOCAB)
    assert problem is not None and needle in problem


def test_check_raises_value_error_sglangs_400_path():
    obj = SimpleNamespace(sampling_params={"max_new_tokens": 2})
    with pytest.raises(ValueError, match="not a token id of this model"):
        guard.check(obj, [1, 10_000_000], VOCAB)
    guard.check(obj, [1, 2], VOCAB)  # fine: nothing raised
    guard.check(obj, None, VOCAB)  # input_embeds requests carry no ids


@pytest.mark.parametrize("batch,n,needle", [
    (1, 10**6, "n must be an integer in [1, 128]"),  # one prompt, n = 10**6: a CPU server grew past 14 GiB
    (1, 0, "n must be"), (1, -1, "n must be"), (1, True, "n must be"), (1, 1.5, "n must be"),
    (16, 128, "more than 1024 sequences"),
])
def test_fan_out_past_the_bound_is_refused(batch, n, needle):
    problem = guard.fan_out_problem(batch, n)
    assert problem is not None and needle in problem


def test_fan_out_within_the_bound_passes():
    assert guard.fan_out_problem(8, 128) is None and guard.fan_out_problem(1, 1) is None


@pytest.mark.parametrize("top,start,needle", [
    (10**6, None, "top_logprobs_num"),  # k = 10**6: "selected index k out of range" in the sampler took a server down
    (-1, None, "top_logprobs_num"), (True, None, "top_logprobs_num"), ([2, VOCAB + 1], None, "top_logprobs_num"),
    (None, -5, "logprob_start_len"), (None, 1.5, "logprob_start_len"),
])
def test_logprob_fields_that_crash_the_sampler_are_refused(top, start, needle):
    problem = guard.logprob_problem(top, start, VOCAB)
    assert problem is not None and needle in problem


def test_logprob_fields_within_range_pass():
    assert guard.logprob_problem(5, -1, VOCAB) is None and guard.logprob_problem(None, None, VOCAB) is None
    assert guard.logprob_problem([0, VOCAB], [0, 3], VOCAB) is None


@pytest.mark.parametrize("kwargs", [{"tokenize": True}, {"add_generation_prompt": False}, {"conversation": []}])
def test_template_kwargs_that_clash_with_the_servers_own_are_refused(kwargs):
    # {"tokenize": true} raised TypeError inside SGLang's chat handler: a 500 from a server asked directly
    assert "may not set" in guard.template_kwargs_problem(kwargs)


def test_template_kwargs_of_the_template_pass():
    assert guard.template_kwargs_problem({"enable_thinking": False}) is None
    assert guard.template_kwargs_problem(None) is None
    assert guard.template_kwargs_problem("x") == "chat_template_kwargs must be an object"
