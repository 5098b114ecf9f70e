"""The fault campaign's pure logic (prfaas_sgl.tools.chaos): schedules and loads from a seed, outcome
classification, and the counting invariant sent = completed + errored (+ violations) with nothing lost."""
from __future__ import annotations

from dataclasses import replace

import pytest

from prfaas_sgl.tools.chaos import outcome as O
from prfaas_sgl.tools.chaos.config import CI, FULL, CampaignConfig
from prfaas_sgl.tools.chaos.plan import LoadSpec, make_plan, make_probes
from prfaas_sgl.tools.chaos.schedule import LINK, TARGETS, ScheduleSpec, make_schedule

REF = [5, 6, 7, 8]
BOUND = 100.0


# ---------------------------------------------------------------- schedule


def test_schedule_is_a_function_of_the_seed():
    spec = ScheduleSpec(span_s=200.0)
    assert make_schedule(spec, 7) == make_schedule(spec, 7)
    assert make_schedule(spec, 7) != make_schedule(spec, 8)


@pytest.mark.parametrize("seed", range(20))
def test_schedule_hits_every_target_inside_the_window_and_spaced(seed):
    spec = ScheduleSpec(span_s=200.0, kills_per_target=2, link_drops=2, lead_s=10, tail_s=30, gap_s=8)
    events = make_schedule(spec, seed)
    kills = sorted(e.target for e in events if e.kind == "kill")
    assert kills == sorted(TARGETS * 2)
    drops = [e for e in events if e.kind == "link_down"]
    assert len(drops) == 2 and all(e.target == LINK and 3.0 <= e.duration_s <= 6.0 for e in drops)
    times = [e.at_s for e in events]
    assert times == sorted(times)
    assert 10.0 <= times[0] and times[-1] <= 170.0
    assert all(b - a >= 8.0 - 1e-9 for a, b in zip(times, times[1:]))
    assert all(0.0 <= e.restart_after_s <= 3.0 for e in events if e.kind == "kill")


def test_schedule_that_cannot_fit_is_refused_with_the_knob_to_turn():
    with pytest.raises(ValueError, match="raise span_s"):
        ScheduleSpec(span_s=40.0, kills_per_target=2, link_drops=2, gap_s=8)
    assert make_schedule(ScheduleSpec(span_s=40.0, kills_per_target=0, link_drops=0), 1) == ()


# ---------------------------------------------------------------- load


def test_plan_is_seeded_mixed_and_spread_over_the_span():
    spec = LoadSpec(n_requests=200, span_s=300.0, threshold=300, short_len=(16, 160), long_len=(400, 1600))
    plan = make_plan(spec, 3)
    assert plan == make_plan(spec, 3) and plan != make_plan(spec, 4)
    assert [r.index for r in plan] == list(range(200))
    sends = [r.send_at_s for r in plan]
    assert sends == sorted(sends) and 0.0 <= sends[0] and sends[-1] < 300.0
    shorts = [r for r in plan if r.kind == "short"]
    longs = [r for r in plan if r.kind == "long"]
    assert 60 <= len(shorts) <= 140 and len(shorts) + len(longs) == 200
    assert all(16 <= r.n_tokens <= 160 for r in shorts) and all(400 <= r.n_tokens <= 1600 for r in longs)
    assert len({tuple(r.input_ids()) for r in plan}) == 200  # no two requests share a prompt


def test_prompt_ids_are_deterministic_and_skip_special_tokens():
    r = make_plan(LoadSpec(n_requests=1, span_s=1.0, threshold=300, long_frac=1.0), 0)[0]
    ids = r.input_ids()
    assert ids == r.input_ids() and len(ids) == r.n_tokens
    assert min(ids) >= 3 and max(ids) < 512


def test_probes_take_both_routes_and_follow_the_load():
    spec = LoadSpec(n_requests=50, span_s=10.0, threshold=300)
    probes = make_probes(spec, 0, 4)
    assert [p.kind for p in probes] == ["short", "long", "short", "long"]
    assert [p.index for p in probes] == [50, 51, 52, 53]
    assert all(p.n_tokens <= 300 < q.n_tokens for p, q in zip(probes[::2], probes[1::2]))
    assert probes == make_probes(spec, 0, 4)


def test_load_spec_rejects_lengths_that_do_not_straddle_the_threshold():
    with pytest.raises(ValueError, match="threshold"):
        LoadSpec(n_requests=1, span_s=1.0, threshold=100, short_len=(16, 160))


# ---------------------------------------------------------------- classification


def ans(status, body, elapsed=1.0, **kw) -> O.Answer:
    return O.Answer(status, body, elapsed, **kw)


def done(ids, finish=None) -> dict:
    return {"output_ids": ids, "meta_info": {"finish_reason": finish or {"type": "length", "length": len(ids)}}}


@pytest.mark.parametrize("answer,expected", [
    (ans(200, done(REF)), O.OK),
    (ans(200, done([5, 6, 7, 9])), O.WRONG),
    (ans(200, done(REF[:3])), O.WRONG),  # truncated output is wrong, not an error
    (ans(502, {"error": {"message": "prefill/decode failed: ...", "code": "upstream_failed"}}), O.ERROR),
    (ans(503, {"error": "no healthy decode"}), O.ERROR),
    (ans(200, done([], {"type": "abort", "message": "Lost connection with prefill instance"})), O.ERROR),
    (ans(502, {"error": {"message": ""}}), O.UNCLEAR),
    (ans(500, "Internal Server Error"), O.UNCLEAR),
    (ans(200, "not json"), O.UNCLEAR),
    (ans(200, {"text": "x"}), O.UNCLEAR),
    (ans(200, done([], {"type": "abort"})), O.UNCLEAR),
    (ans(200, done(REF), elapsed=BOUND + 1), O.LATE),  # right tokens, but after the bound
    (ans(502, {"error": "x"}, elapsed=BOUND + 1), O.LATE),
    (ans(None, None, BOUND + 30, client_error="TimeoutError", timed_out=True), O.HANG),
    (ans(None, None, 0.1, client_error="ServerDisconnectedError"), O.DROPPED),
])
def test_classify(answer, expected):
    outcome, detail = O.classify(answer, REF, BOUND)
    assert outcome == expected
    assert (detail == "") == (expected == O.OK)


# ---------------------------------------------------------------- counting


def result(i: int, outcome: str, status: int | None = 200, route: str = "local") -> O.RequestResult:
    return O.RequestResult(i, "short", 10, 0.0, 1.0 + i, outcome, status, route)


def test_counts_balance_and_a_clean_run_is_clean():
    results = [result(0, O.OK), result(1, O.OK, route="prfaas"), result(2, O.ERROR, 502),
               result(3, O.ERROR, 200)]
    c = O.count([0, 1, 2, 3], results)
    j = c.to_json()
    assert (j["sent"], j["completed"], j["errored"], j["lost"]) == (4, 2, 2, 0)
    assert j["sent"] == j["completed"] + j["errored"]
    assert j["errors_by_status"] == {"502": 1, "200-abort": 1}
    assert j["ok_by_route"] == {"local": 1, "prfaas": 1}
    assert c.clean and j["max_elapsed_s"] == 4.0


@pytest.mark.parametrize("violation", O.VIOLATIONS)
def test_any_violation_makes_the_run_unclean(violation):
    assert not O.count([0, 1], [result(0, O.OK), result(1, violation)]).clean


def test_a_sent_request_without_a_result_is_lost():
    c = O.count([0, 1, 2], [result(0, O.OK), result(2, O.ERROR, 503)])
    assert c.lost == 1 and not c.clean


def test_a_request_counted_twice_is_flagged():
    c = O.count([0], [result(0, O.OK), result(0, O.OK)])
    assert c.duplicates == 1 and not c.clean


# ---------------------------------------------------------------- config and bound


def test_bound_follows_the_router_timeouts():
    cfg = CampaignConfig(request_timeout_s=50.0)
    # two attempts (the first and the router's one local retry), each cut at request_timeout_s
    assert cfg.bound_s == 2 * 50.0 + cfg.bound_slack_s
    assert cfg.client_timeout_s > cfg.bound_s


def test_presets_meet_the_issue_minimums():
    assert CI.n_requests >= 50 and FULL.n_requests >= 200
    for cfg in (CI, FULL):
        assert cfg.schedule_spec().n_events >= 4  # every target killed once, the link dropped once
        assert cfg.zmq_timeout_s < cfg.request_timeout_s  # the transport gives up before the router does


def test_config_refuses_a_transport_timeout_beyond_the_router_timeout():
    with pytest.raises(ValueError, match="zmq_timeout_s"):
        CampaignConfig(zmq_timeout_s=90.0, request_timeout_s=60.0)


def test_a_prefill_kill_waits_for_the_other_prefill_and_a_link_drop_for_the_remote_one():
    from prfaas_sgl.tools.chaos.runner import _wait_for
    from prfaas_sgl.tools.chaos.schedule import FaultEvent

    starting = {"local_prefill": object(), "decode_b": object()}
    assert _wait_for(FaultEvent(1.0, "kill", "remote_prefill"), starting) == ["local_prefill"]
    assert _wait_for(FaultEvent(1.0, "kill", "local_prefill"), starting) == ["local_prefill"]
    assert _wait_for(FaultEvent(1.0, "kill", "decode_b"), starting) == ["decode_b"]
    assert _wait_for(FaultEvent(1.0, "link_down", LINK, duration_s=3.0), starting) == []
    assert _wait_for(FaultEvent(1.0, "link_down", LINK, duration_s=3.0), {"remote_prefill": 1}) == ["remote_prefill"]


def test_a_fault_waits_for_a_request_in_flight_but_not_forever():
    """CI saw all four faults fire between requests (in flight 0): they tested only recovery."""
    import asyncio
    import time

    from prfaas_sgl.tools.chaos.runner import LoadRun, until_load

    async def scenario() -> tuple[float, float]:
        load = LoadRun()

        async def request_arrives() -> None:
            await asyncio.sleep(0.3)
            load.inflight += 1

        t0 = time.monotonic()
        arrival = asyncio.create_task(request_arrives())
        await until_load(load, limit_s=10.0)
        waited = time.monotonic() - t0
        await arrival
        load.inflight = 0
        t1 = time.monotonic()
        await until_load(load, limit_s=0.2)  # no request comes: the fault runs anyway, late
        return waited, time.monotonic() - t1

    waited, gave_up = asyncio.run(scenario())
    assert 0.25 <= waited < 5.0 and 0.2 <= gave_up < 5.0


def test_the_shorter_ci_load_keeps_the_fault_schedule_of_the_five_minute_one():
    """The CI load was cut from 300 s to 220 s for CI time: its faults stay where the 300-s preset put them
    (the same targets at the same planned times), and the load still runs 70 s past the last of them."""
    five_minutes = replace(CI, span_s=300.0, fault_tail_s=150.0)
    assert make_schedule(CI.schedule_spec(), CI.seed) == make_schedule(five_minutes.schedule_spec(), CI.seed)
    assert CI.span_s - max(e.at_s for e in make_schedule(CI.schedule_spec(), CI.seed)) >= 70.0
    shorter, longer = make_plan(CI.load_spec(), CI.seed), make_plan(five_minutes.load_spec(), CI.seed)
    assert [r.input_ids() for r in shorter] == [r.input_ids() for r in longer]  # the same references
