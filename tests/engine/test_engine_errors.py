"""Bad input gets a clear exception naming the field, and nothing is computed or cached."""

from __future__ import annotations

import pytest

import engines
from helpers import random_segments
from hypic_core.config import GenerationRequest, SamplingParams
from hypic_core.engine.engine import Engine
from hypic_core.errors import EngineBusyError, InvalidRequestError, PromptTooLongError, UnsupportedArchitectureError


@pytest.fixture(scope="module")
def engine():
    return engines.engine(4, model=engines.model("qwen3_5", max_position_embeddings=128))


def test_no_segments():
    with pytest.raises(InvalidRequestError, match="segments"):
        GenerationRequest(())


def test_empty_segment():
    with pytest.raises(InvalidRequestError, match=r"segments\[1\].*empty"):
        GenerationRequest(((1, 2), (), (3,)))


def test_unknown_mode():
    with pytest.raises(InvalidRequestError, match="mode.*'fast'"):
        GenerationRequest(((1, 2),), mode="fast")


@pytest.mark.parametrize("field,kwargs", [("max_tokens", {"max_tokens": 0}), ("temperature", {"temperature": -1.0}),
                                          ("top_p", {"top_p": 0.0}), ("top_k", {"top_k": -2}), ("stop", {"stop": ("",)})])
def test_bad_sampling(field, kwargs):
    with pytest.raises(InvalidRequestError, match=field):
        SamplingParams(**kwargs)


def test_prompt_over_max_length_caches_nothing(engine):
    segs = random_segments((60, 60, 20), seed=1)
    before = len(engine.store)
    with pytest.raises(PromptTooLongError, match="140 tokens.*128"):
        engine.prefill(GenerationRequest(segs))
    assert len(engine.store) == before


def test_token_outside_vocabulary_caches_nothing(engine):
    before = len(engine.store)
    with pytest.raises(InvalidRequestError, match=r"segments\[1\].*token id 100000"):
        engine.prefill(GenerationRequest(((5, 6), (7, 100000), (8,))))
    assert len(engine.store) == before


def test_unsupported_architecture_is_named():
    import transformers as tf

    cfg = tf.JambaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, num_experts=2, mamba_d_state=4,
                         mamba_expand=1, mamba_dt_rank=4, attn_layer_period=2, attn_layer_offset=1, expert_layer_period=2)
    with pytest.raises(UnsupportedArchitectureError, match="'jamba'.*cannot resume"):
        Engine(tf.AutoModelForCausalLM.from_config(cfg))
    gpt2 = tf.AutoModelForCausalLM.from_config(tf.GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=64))
    with pytest.raises(UnsupportedArchitectureError, match="'gpt2'.*no adapter"):
        Engine(gpt2)


def test_loader_refuses_unsupported_checkpoint_before_reading_weights(tmp_path):
    from hypic_core.models.loader import load_local

    (tmp_path / "config.json").write_text('{"model_type": "recurrent_gemma"}')
    with pytest.raises(UnsupportedArchitectureError, match="recurrent_gemma.*position_ids == 0"):
        load_local(tmp_path)


def test_a_second_driver_is_refused_until_the_first_releases(engine):
    """Two drivers routing `step()`'s outputs would drop each other's: the second claim is refused."""
    first, second = object(), object()
    engine.driver.claim(first)
    try:
        engine.driver.claim(first)  # again: nothing
        with pytest.raises(EngineBusyError, match="already driven by .*one gateway serves an engine at a time"):
            engine.driver.claim(second)
        engine.driver.release(second)  # holds nothing: frees nothing
        assert engine.driver.holder is first
    finally:
        engine.driver.release(first)
    engine.driver.claim(second)
    engine.driver.release(second)
    assert engine.driver.holder is None
