"""Serialization of segment entries: lossless roundtrip, bf16 storage, and every kind of damage."""

from __future__ import annotations

import pickle

import pytest
import torch

from hypic_core.algebra.entry import SegmentEntry
from hypic_core.algebra.keys import SCHEMA_VERSION, SegmentKey
from hypic_core.algebra.operators import LinearOperator
from hypic_core.cache import CorruptEntry, decode, encode

MODEL = "a" * 64


def make_entry(n: int = 12, seam: int = 3, seed: int = 0, width: int = 8) -> SegmentEntry:
    """A synthetic entry shaped like a 2-attention, 2-linear-layer model's (K/V fp32, T/E fp32)."""
    g = torch.Generator().manual_seed(seed)
    tokens = tuple(torch.randint(2, 300, (n,), generator=g).tolist())
    kv = lambda: torch.randn(2, n - seam, width, generator=g)  # noqa: E731
    op = lambda: LinearOperator(torch.randn(2, 4, 4, generator=g), torch.randn(2, 4, 4, generator=g))  # noqa: E731
    return SegmentEntry(tokens, seam, (kv(), kv()), (kv(), kv()), (op(), op()),
                        (torch.randn(16, 4, generator=g), torch.randn(16, 4, generator=g)))


def key_of(entry: SegmentEntry, model: str = MODEL, schema: int = SCHEMA_VERSION) -> SegmentKey:
    k = SegmentKey.of(model, 8, entry.token_ids)
    return SegmentKey(k.model, k.seam, k.tokens, schema)


def tensors_equal(a: SegmentEntry, b: SegmentEntry) -> bool:
    ta, tb = a.to_tensors(), b.to_tensors()
    return ta.keys() == tb.keys() and all(ta[n].dtype == tb[n].dtype and torch.equal(ta[n], tb[n]) for n in ta)


def test_roundtrip_is_lossless():
    e = make_entry()
    back = decode(encode(e, key_of(e)), key_of(e), e.token_ids)
    assert back.token_ids == e.token_ids and back.seam == e.seam and tensors_equal(back, e)


def test_roundtrip_keeps_half_precision_kv():
    e = make_entry()
    half = SegmentEntry(e.token_ids, e.seam, tuple(k.to(torch.bfloat16) for k in e.keys),
                        tuple(v.to(torch.bfloat16) for v in e.values), e.operators, e.conv_tails)
    assert tensors_equal(decode(encode(half, key_of(e)), key_of(e)), half)


def test_bf16_storage_halves_bytes_and_restores_dtypes():
    e = make_entry(n=200, width=64)
    full, small = encode(e, key_of(e), "auto"), encode(e, key_of(e), "bf16")
    assert len(small) < 0.6 * len(full)
    back = decode(small, key_of(e), e.token_ids, "bf16")
    assert back.keys[0].dtype == torch.float32 and back.operators[0].transition.dtype == torch.float32
    assert torch.equal(back.conv_tails[0], e.conv_tails[0])  # conv tails keep their precision
    err = (back.keys[0] - e.keys[0]).abs().max() / e.keys[0].abs().max()
    assert 0 < err < 1e-2
    with pytest.raises(CorruptEntry) as info:  # a store configured for fp32 never serves bf16 bytes
        decode(small, key_of(e), e.token_ids, "auto")
    assert info.value.reason == "storage_dtype"


def test_empty_body_roundtrips():
    e = SegmentEntry((5, 6, 7), 3, (torch.zeros(2, 0, 8),), (torch.zeros(2, 0, 8),), (), ())
    assert decode(encode(e, key_of(e)), key_of(e), e.token_ids).body_length == 0


@pytest.mark.parametrize("cut", [0, 10, 47, 48, 200, -1], ids=lambda c: f"cut{c}")
def test_truncated_value_is_corrupt(cut):
    e = make_entry()
    data = encode(e, key_of(e))
    with pytest.raises(CorruptEntry) as info:
        decode(data[:cut], key_of(e), e.token_ids)
    assert info.value.reason == "truncated"


@pytest.mark.parametrize("where", ["magic", "length", "digest", "header", "tensor", "last"])
def test_flipped_byte_is_corrupt(where):
    e = make_entry()
    data = bytearray(encode(e, key_of(e)))
    offset = {"magic": 0, "length": 9, "digest": 20, "header": 60, "tensor": len(data) - 100, "last": len(data) - 1}
    data[offset[where]] ^= 0x01
    with pytest.raises(CorruptEntry) as info:
        decode(bytes(data), key_of(e), e.token_ids)
    assert info.value.reason in {"magic": ("magic",), "length": ("truncated",)}.get(where, ("checksum",))


def test_wrong_schema_version_is_corrupt():
    e = make_entry()
    old = key_of(e, schema=SCHEMA_VERSION + 1)
    with pytest.raises(CorruptEntry) as info:
        decode(encode(e, old), key_of(e), e.token_ids)
    assert info.value.reason == "schema"


def test_entry_of_another_model_is_corrupt():
    e = make_entry()
    with pytest.raises(CorruptEntry) as info:
        decode(encode(e, key_of(e, model="b" * 64)), key_of(e), e.token_ids)
    assert info.value.reason == "model"


def test_entry_under_another_key_is_corrupt():
    e, other = make_entry(seed=0), make_entry(seed=1)
    with pytest.raises(CorruptEntry) as info:
        decode(encode(other, key_of(other)), key_of(e))
    assert info.value.reason == "key"


def test_other_token_ids_are_corrupt():
    e = make_entry()
    with pytest.raises(CorruptEntry) as info:
        decode(encode(e, key_of(e)), key_of(e), tuple(reversed(e.token_ids)))
    assert info.value.reason == "tokens"


@pytest.mark.parametrize("value", [None, "text", 3, pickle.dumps({"a": 1})], ids=["none", "str", "int", "pickle"])
def test_non_entry_values_are_corrupt(value):
    e = make_entry()
    with pytest.raises(CorruptEntry):
        decode(value, key_of(e), e.token_ids)


def test_unknown_storage_dtype_is_refused():
    e = make_entry()
    with pytest.raises(ValueError):
        encode(e, key_of(e), "fp8")
