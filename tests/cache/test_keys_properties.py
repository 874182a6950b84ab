"""Properties of cache keys (hypic_core/algebra/keys.py) and segment operators (hypic_core/algebra/operators.py).

Keys: `SegmentKey.of` is a function of (model, seam, token ids) only, distinct inputs give
distinct keys and strings, and the string form is stable across versions (disk caches outlive
processes). Operators: composition is associative, `compose_tree` equals `compose`, and a
composed operator maps a state as the spans applied one after another.
"""

from __future__ import annotations

import hashlib
import struct

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hypic_core.algebra.keys import SCHEMA_VERSION, SegmentKey
from hypic_core.algebra.operators import LinearOperator, compose, compose_tree

PROPERTY = settings(max_examples=100, deadline=None)

token_ids = st.lists(st.integers(-(2**31), 2**31 - 1), max_size=40).map(tuple)
fingerprints = st.text("0123456789abcdef", min_size=64, max_size=64)
seams = st.integers(0, 4096)


@PROPERTY
@given(model=fingerprints, seam=seams, tokens=token_ids)
def test_segment_key_is_a_function_of_its_inputs(model, seam, tokens):
    key = SegmentKey.of(model, seam, tokens)
    again = SegmentKey.of(model, seam, list(tokens))
    assert key == again and hash(key) == hash(again) and key.to_str() == again.to_str() == str(key)
    assert key.schema == SCHEMA_VERSION


@PROPERTY
@given(model=fingerprints, seam=seams, a=token_ids, b=token_ids)
def test_distinct_token_ids_give_distinct_keys(model, seam, a, b):
    if a != b:
        assert SegmentKey.of(model, seam, a).to_str() != SegmentKey.of(model, seam, b).to_str()


@PROPERTY
@given(models=st.tuples(fingerprints, fingerprints), seams=st.tuples(seams, seams), tokens=token_ids)
def test_distinct_models_or_seams_give_distinct_keys(models, seams, tokens):
    a, b = (SegmentKey.of(m, w, tokens) for m, w in zip(models, seams))
    assert (a == b) == (models[0] == models[1] and seams[0] == seams[1])
    # The string form keeps the fingerprint's first 24 hex digits (96 bits of a SHA-256); the
    # disk tier's entries also store the whole fingerprint and check it on read (cache/serde.py).
    if models[0][:24] != models[1][:24] or seams[0] != seams[1]:
        assert a.to_str() != b.to_str()


def test_key_string_is_stable():
    """A disk cache written by an earlier build must be found again: the format is fixed."""
    key = SegmentKey.of("ab" * 32, 4, (1, 2, 3))
    assert key.to_str() == ("hypic/v1/abababababababababababab/w4/"
                            "4636993d3e1da4e9d6b8f87b79e8f7c6d018580d52661950eabc3845c5897a4d")
    assert key.tokens == hashlib.sha256(struct.pack("<3i", 1, 2, 3)).hexdigest()  # little-endian int32 ids


@PROPERTY
@given(tokens=token_ids)
def test_token_hash_is_the_sha256_of_little_endian_int32_ids(tokens):
    data = struct.pack(f"<{len(tokens)}i", *tokens)
    assert SegmentKey.of("m" * 64, 0, tokens).tokens == hashlib.sha256(data).hexdigest()


# --- operators ---------------------------------------------------------------------------
@st.composite
def operators(draw, count: int) -> list[LinearOperator]:
    """`count` random operators of one shape, dense or scalar, contractive so products stay small."""
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**32 - 1)))
    heads, dk, dv = draw(st.integers(1, 3)), draw(st.integers(1, 5)), draw(st.integers(1, 4))
    scalar = draw(st.booleans())
    ops = []
    for _ in range(count):
        if scalar:
            transition = torch.rand(heads, generator=g)
        else:
            transition = torch.randn(heads, dk, dk, generator=g) / (2 * dk)
        ops.append(LinearOperator(transition, torch.randn(heads, dk, dv, generator=g)))
    return ops


def close(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.allclose(a, b, rtol=1e-5, atol=1e-5)


@PROPERTY
@given(ops=operators(3))
def test_composition_is_associative(ops):
    a, b, c = ops
    left, right = a.then(b).then(c), a.then(b.then(c))
    assert close(left.transition, right.transition) and close(left.end, right.end)


@PROPERTY
@given(n=st.integers(1, 9), data=st.data())
def test_tree_composition_equals_the_left_fold_and_the_sequence(n, data):
    ops = data.draw(operators(n))
    folded, tree = compose(ops), compose_tree(list(ops))
    assert close(folded.transition, tree.transition) and close(folded.end, tree.end)
    state = torch.randn(ops[0].end.shape, generator=torch.Generator().manual_seed(n))
    sequential = state
    for op in ops:
        sequential = op.apply(sequential)
    assert close(folded.apply(state), sequential)
    identity = LinearOperator.identity_like(ops[0])
    assert close(identity.then(folded).apply(state), sequential) and close(folded.then(identity).apply(state), sequential)
