"""Invariant 5: a cached key re-rotated to a new offset equals the key rotated at the absolute position."""

from __future__ import annotations

import pytest
import torch

from hypic_core.adapters import adapter_for
from hypic_core.testing import tiny_model
from helpers import random_segments


def first_attention_keys(model, adapter, ids, start):
    """Keys of the first attention layer for `ids` run alone at positions start.. (its input is position-free)."""
    cache = adapter.new_cache()
    pos = torch.arange(start, start + len(ids))[None]
    with torch.inference_mode():
        model.base_model(input_ids=torch.tensor([ids]), position_ids=pos, cache=cache, use_cache=True)
    return cache.layers[adapter.attention_layers[0]].keys[0]


@pytest.mark.parametrize("family,rotary", [("qwen3_5", 4), ("llama", 16), ("olmo_hybrid", 16), ("olmo_hybrid_nope", 0),
                                           ("bamba", 8), ("granitemoehybrid", 0), ("nemotron_h", 0), ("zamba2", 32),
                                           ("falcon_h1", 16), ("kimi_linear", 0), ("minimax", 16)])
@pytest.mark.parametrize("offset", [1, 37, 1500])
def test_rerotation_matches_absolute_rotation(family, rotary, offset):
    model = tiny_model(family)
    adapter = adapter_for(model)
    assert adapter.rotary_dim == rotary  # qwen3_5: partial rotary (head_dim 16 * 0.25); NoPE: none
    (ids,) = random_segments([24], seed=offset)
    local = first_attention_keys(model, adapter, ids, 0)
    absolute = first_attention_keys(model, adapter, ids, offset)
    moved = adapter.rotate_keys(local, offset)
    # The model computes angles p * f in fp32 (absolute error ~6e-8 * p); the re-rotation uses
    # float64 angles. Allow the model's own rounding, nothing more.
    tol = 1e-5 + 1.2e-7 * (offset + len(ids)) * local.abs().max().item()
    assert (moved - absolute).abs().max().item() <= tol
    # Dims past the rotary ones are untouched (partial rotary and NoPE).
    assert torch.equal(moved[..., rotary:], local[..., rotary:])
    if rotary:
        assert (local - absolute).abs().max().item() > 1e-3  # the test can fail: positions matter


def test_rope_reference_matches_rotation_of_rotated_keys():
    adapter = adapter_for(tiny_model("qwen3_5"))
    keys = torch.randn(2, 5, 16)
    at_3 = adapter.rope_at(keys, torch.full((5,), 3))
    at_10 = adapter.rope_at(keys, torch.full((5,), 10))
    assert (adapter.rotate_keys(at_3, 7) - at_10).abs().max().item() <= 1e-5


@pytest.mark.parametrize("family", ["qwen3_5", "llama", "bamba", "granitemoehybrid"])
def test_one_mover_for_several_bodies_equals_moving_each(family):
    """A stitch moves its bodies' keys, concatenated, with one mover (angles worked out once); column for
    column this is bit for bit what moving each body by its own offset gives (NoPE: nothing moves)."""
    adapter = adapter_for(tiny_model(family))
    gen = torch.Generator().manual_seed(3)
    bodies = [torch.randn(2, n, 16, generator=gen) for n in (5, 1, 12)]
    offsets = [0, 40, 1500]
    moves = torch.cat([torch.full((b.shape[1],), o) for b, o in zip(bodies, offsets)])
    together = adapter.key_mover(moves)(torch.cat(bodies, dim=1))
    assert torch.equal(together, torch.cat([adapter.rotate_keys(b, o) for b, o in zip(bodies, offsets)], dim=1))
    if adapter.rotary_dim:
        assert not torch.equal(together, torch.cat(bodies, dim=1))
