"""Layer-group streaming bookkeeping (srt/backend/layerwise.py): which pages of a request a forward's layer
groups send, what SGLang's own send of the chunk then leaves out, the groups bound to the model's attention
layers (an SWA pool lists only its full-attention layers, by position), and each forward's gates."""

import numpy as np
import pytest

from prfaas_sgl.srt.backend.layerwise import LayerwiseStreamer, Span, span, trim
from prfaas_sgl.transfer.config import LayerwiseConfig
from prfaas_sgl.transfer.items import ItemBatch, Items


def test_a_middle_chunk_sends_its_whole_pages_and_leaves_the_partial_one():
    # page 16, decode prefix 32 tokens (2 pages), nothing queued; this forward extends tokens [32, 232)
    assert span(32, 0, 16, 232, 1100) == Span(32, 224, 0)
    # next forward [232, 432): starts at the partial page left behind (token 224 = transfer page 12)
    assert span(32, 12, 16, 432, 1100) == Span(224, 432, 12)


def test_the_last_chunk_sends_through_the_prompt_end():
    assert span(0, 62, 16, 1100, 1100) == Span(992, 1100, 62)


def test_nothing_to_send_when_the_extend_ends_inside_a_queued_or_first_page():
    assert span(0, 0, 16, 10, 1100) is None
    assert span(0, 14, 16, 232, 1100) is None


def test_sglangs_send_drops_the_pages_queued_before_the_forward():
    ids = np.arange(100, 112)
    kept, where = trim(ids, slice(4, 16), queued_pages=10)
    assert kept.tolist() == [106, 107, 108, 109, 110, 111] and where == slice(10, 16)
    kept, where = trim(ids, slice(4, 16), queued_pages=16)
    assert len(kept) == 0 and where == slice(16, 16)
    kept, where = trim(ids, slice(4, 16), queued_pages=3)
    assert kept is ids and where == slice(4, 16)


def _streamer(layers, positional, per_group=1, counts=None):
    counts = {} if counts is None else counts
    count = lambda name, n: counts.__setitem__(name, counts.get(name, 0) + n)  # noqa: E731
    return LayerwiseStreamer(LayerwiseConfig(per_group, 600), range(10, 10 + len(layers)), layers, positional,
                             5.0, count)


def test_an_swa_pool_maps_positions_onto_the_full_attention_layers():
    # MiMo-style: layers 0 and 5 full, 1-4 and 6-7 sliding; the pool holds K then V of the full ones
    s = _streamer((0, 1, 0, 1), positional=True)
    assert s.bind(attention_layers=range(8), full_layers=(0, 5)) is None
    assert [(g.layers, g.buffer_ids) for g in s.groups] == [((0,), (10, 12)), ((5,), (11, 13))]


def test_a_pool_of_every_layer_maps_positions_one_to_one():
    s = _streamer((0, 1, 2, 0, 1, 2), positional=True, per_group=2)
    assert s.bind(range(3), range(3)) is None
    assert [g.layers for g in s.groups] == [(0, 1), (2,)]


def test_named_layers_that_run_no_attention_turn_streaming_off():
    s = _streamer((3, 7, 3, 7), positional=False)
    assert "layers [7]" in s.bind(attention_layers=(3,), full_layers=(3,))
    assert not s.streams(10_000)
    s = _streamer((0, 1, 2), positional=True)
    assert "3 layers" in s.bind(range(8), (0, 5))


def test_only_prompts_from_the_minimum_stream():
    s = _streamer((3, 7, 3, 7), positional=False)
    assert not s.streams(10_000)  # not bound to a model yet
    s.bind((3, 7), (3, 7))
    assert not s.streams(599) and s.streams(600)


def test_hooks_open_each_group_after_its_last_layer_and_the_rest_open_when_the_forward_returns():
    counts = {}
    s = _streamer((3, 7, 3, 7), positional=False, counts=counts)
    s.bind((3, 7), (3, 7))
    g0, g1 = s.begin()
    s.on_layer(2)
    assert not g0.is_open
    s.on_layer(3)
    assert g0.is_open and not g1.is_open and g0.forward_running
    s.end((g0, g1))
    assert g1.is_open and not g0.forward_running and not g1.forward_running
    assert counts == {"gates_opened_in_forward": 1, "gates_opened_after_forward": 1}
    s.on_layer(7)  # a later forward that did not stream: no gate of the finished one moves
    assert counts["gates_opened_in_forward"] == 1


def test_a_forward_that_raised_leaves_its_unwritten_groups_closed():
    s = _streamer((3, 7, 3, 7), positional=False)
    s.bind((3, 7), (3, 7))
    g0, g1 = s.begin()
    s.on_layer(3)
    s.end((g0, g1), ok=False)
    assert g0.is_open and not g1.is_open and not g1.forward_running


def test_the_splitter_cuts_a_chunk_into_one_gated_batch_per_group():
    s = _streamer((3, 7, 3, 7), positional=False)
    s.bind((3, 7), (3, 7))
    gates = s.begin()
    pages = np.array([5, 6])
    parts = s.splitter(gates)(ItemBatch((Items((10, 11, 12, 13), pages),)))
    assert [(p.groups[0].buffer_ids, p.gate) for p in parts] == [((10, 12), gates[0]), ((11, 13), gates[1])]


def test_queued_pages_are_the_furthest_either_path_reached_and_forgotten_with_the_room():
    s = _streamer((3, 7, 3, 7), positional=False)
    assert s.queued(room=1, sglang_pages=4) == 4
    s.note_queued(1, 12)
    assert s.queued(1, 4) == 12 and s.queued(1, 20) == 20
    kept, _ = s.trim(1, np.arange(8), slice(8, 16))
    assert len(kept) == 4
    s.forget(1)
    assert s.queued(1, 0) == 0


@pytest.mark.parametrize("bad", [dict(layers_per_group=-1), dict(min_tokens=0)])
def test_the_config_refuses_values_naming_the_field(bad):
    with pytest.raises(ValueError, match=next(iter(bad))):
        LayerwiseConfig(**bad)
