"""With `entry_batching="alone"` a canonical entry is a function of its segment (and seam) only, not of which
other segments missed beside it: the bytes a cold request stores for a segment equal, bit for bit, the
entry of that segment computed alone. In one padded batch (`"padded"`, the default, faster), rows come out
apart from the same segment alone (the linear layers' chunked scans read a padded row's end mid-chunk),
so which requests happened to arrive together changes the cache and, at a near tie, a greedy answer
(issue 60 item 5): that bound is measured here too."""

from __future__ import annotations

import pytest
import torch
from dataclasses import fields, is_dataclass

from helpers import random_segments
from hypic_core.config import EngineConfig, GenerationRequest, SamplingParams
from hypic_core.engine.engine import Engine
from hypic_core.testing import tiny_model

LENGTHS = (90, 70, 64, 50)  # one padded group: the shorter rows end mid-chunk


def tensors(entry) -> list[torch.Tensor]:
    out: list[torch.Tensor] = []

    def walk(o) -> None:
        if isinstance(o, torch.Tensor):
            out.append(o)
        elif isinstance(o, (list, tuple)):
            for x in o:
                walk(x)
        elif isinstance(o, dict):
            for x in o.values():
                walk(x)
        elif is_dataclass(o):
            for f in fields(o):
                walk(getattr(o, f.name))

    walk(entry)
    return out


def identical(a, b) -> bool:
    ta, tb = tensors(a), tensors(b)
    return len(ta) == len(tb) > 0 and all(x.shape == y.shape and torch.equal(x, y) for x, y in zip(ta, tb))


ALONE = EngineConfig(seam=4, entry_batching="alone")


def max_difference(a, b) -> float:
    return max((x.float() - y.float()).abs().max().item() for x, y in zip(tensors(a), tensors(b)))


@pytest.mark.parametrize("family", ["qwen3_5", "bamba"])
def test_alone_a_cold_batch_stores_the_entries_each_segment_has_alone(family):
    model = tiny_model(family, vocab_size=320)
    segments = random_segments(LENGTHS, seed=7)
    together = Engine(model, config=ALONE)
    together.segment_entries(segments, 4)  # all four miss at once
    question = random_segments((6,), seed=8)
    stitched = Engine(model, config=ALONE)  # the same four missing in one request's prefill
    list(stitched.generate(GenerationRequest((*segments, *question), sampling=SamplingParams(max_tokens=1))))
    padded = Engine(model, config=EngineConfig(seam=4))
    padded.segment_entries(segments, 4)
    apart = []
    for segment in segments:
        alone = Engine(model, config=ALONE).segment_entries((segment,), 4).entries[0]
        assert identical(together.segment_entries((segment,), 4).entries[0], alone), len(segment)
        key = stitched.cache_manager.key(stitched._sequence(GenerationRequest((segment, *question))), segment)
        assert identical(stitched.store.lookup(key, segment), alone), len(segment)
        apart.append(max_difference(padded.segment_entries((segment,), 4).entries[0], alone))
    # The default's bound (docs/architecture.md): padded rows ending mid-chunk differ in the last bits only.
    assert 0 < max(apart) < 1e-5, apart


def test_entry_batching_is_checked():
    with pytest.raises(ValueError, match="entry_batching"):
        EngineConfig(entry_batching="batched")
