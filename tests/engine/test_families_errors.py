"""Bad input gets a clear error for every added family, and nothing is computed or cached."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

import engines
from helpers import random_segments
from hypic_core.config import GenerationRequest
from hypic_core.engine.engine import Engine
from hypic_core.errors import InvalidRequestError, PromptTooLongError, UnsupportedArchitectureError
from hypic_core.testing import tiny_model

ADDED = ["bamba", "granitemoehybrid", "nemotron_h", "zamba2", "falcon_h1", "kimi_linear", "minimax"]


@pytest.mark.parametrize("family", ADDED)
def test_bad_requests_are_refused_and_cache_nothing(family):
    engine = engines.engine(4, model=engines.model(family, max_position_embeddings=64))
    assert engine.max_positions == 64
    with pytest.raises(InvalidRequestError, match=r"segments\[1\].*token id 100000"):
        engine.prefill(GenerationRequest(((5, 6), (7, 100000), (8,))))
    with pytest.raises(PromptTooLongError, match="70 tokens.*64"):
        engine.prefill(GenerationRequest(random_segments((30, 30, 10), seed=1)))
    assert len(engine.store) == 0


def test_minimax_sliding_window_is_refused():
    with pytest.raises(UnsupportedArchitectureError, match="'minimax'.*sliding-window"):
        Engine(tiny_model("minimax", sliding_window=16))


def test_zamba_v1_is_refused_with_the_reason():
    import transformers as tf

    from hypic_core.adapters import adapter_for

    # Refusal reads only the config; a tiny Zamba v1 model cannot even be built (its weight tying breaks).
    with pytest.raises(UnsupportedArchitectureError, match="'zamba'.*cannot resume.*Mamba1"):
        adapter_for(SimpleNamespace(config=tf.ZambaConfig()))
