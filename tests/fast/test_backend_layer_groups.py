"""SGLang's K/V buffer order -> layer groups: positional MHA and MLA pools, a hybrid pool's
`kv_layer_ids` (full-attention layers only), groups of whole layers with their K and V buffers."""

import pytest

from prfaas_sgl.srt.backend.layer_groups import group_after, kv_buffer_layers, layer_groups


def test_an_mha_pool_registers_k_of_every_layer_then_v():
    assert kv_buffer_layers([], 6, is_mla=False) == (0, 1, 2, 0, 1, 2)


def test_an_mla_pool_registers_one_latent_buffer_per_layer():
    assert kv_buffer_layers(None, 3, is_mla=True) == (0, 1, 2)


def test_a_hybrid_pool_names_its_full_attention_layers():
    assert kv_buffer_layers([3, 7, 11, 3, 7, 11], 6, is_mla=False) == (3, 7, 11, 3, 7, 11)


def test_buffer_and_layer_counts_must_agree():
    with pytest.raises(ValueError, match="names 2 layers for 6"):
        kv_buffer_layers([3, 7], 6, is_mla=False)
    with pytest.raises(ValueError, match="whole layers"):
        kv_buffer_layers([], 5, is_mla=False)


def test_groups_hold_consecutive_layers_with_their_k_and_v_buffers():
    """Layout ids 10..19: K of layers 3 7 11 15 19, then their V; two layers per group."""
    layers = kv_buffer_layers([3, 7, 11, 15, 19] * 2, 10, is_mla=False)
    groups = layer_groups(range(10, 20), layers, 2)
    assert [g.layers for g in groups] == [(3, 7), (11, 15), (19,)]
    assert [g.buffer_ids for g in groups] == [(10, 11, 15, 16), (12, 13, 17, 18), (14, 19)]
    assert group_after(groups) == {7: 0, 15: 1, 19: 2}
    assert sorted(b for g in groups for b in g.buffer_ids) == list(range(10, 20))


def test_one_group_per_layer_and_one_group_for_all():
    layers = kv_buffer_layers([], 8, is_mla=False)
    assert [g.buffer_ids for g in layer_groups(range(8), layers, 1)] == [(0, 4), (1, 5), (2, 6), (3, 7)]
    (whole,) = layer_groups(range(8), layers, 99)
    assert whole.buffer_ids == tuple(range(8)) and whole.last_layer == 3


def test_bad_group_sizes_are_refused():
    with pytest.raises(ValueError, match=">= 1"):
        layer_groups(range(4), (0, 1, 0, 1), 0)
    with pytest.raises(ValueError, match="4 K/V buffer ids but 3"):
        layer_groups(range(4), (0, 1, 0), 1)
