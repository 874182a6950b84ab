"""Embedders: unit-norm float32 output, determinism, MiniLM against sentence-transformers."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch

from retrieval import Embedder, HashingEmbedder, InvalidInputError, LocalEmbedder, MiniLMEmbedder, load_embedder, minilm_model_dir

TEXTS = [
    "The cat sat on the mat.",
    "Central banks raise interest rates to fight inflation.",
    "Kittens and cats like to nap in the sun.",
    "",
]

# First six components of sentence-transformers' normalised all-MiniLM-L6-v2 embeddings of
# TEXTS[0] and TEXTS[1] (SentenceTransformer(minilm_model_dir()).encode(..., normalize_embeddings=True)).
REFERENCE = np.array(
    [
        [0.130237, -0.015773, -0.036717, 0.057986, -0.059792, 0.033054],
        [0.019403, -0.060099, -0.083660, -0.003400, 0.031075, -0.051875],
    ],
    dtype=np.float32,
)


@pytest.fixture(scope="module")
def minilm() -> MiniLMEmbedder:
    return MiniLMEmbedder(num_threads=1)


def _assert_unit_rows(vectors: np.ndarray, count: int, dim: int) -> None:
    assert vectors.dtype == np.float32
    assert vectors.shape == (count, dim)
    np.testing.assert_allclose(np.linalg.norm(vectors, axis=1), 1.0, atol=1e-5)


def test_minilm_matches_sentence_transformers(minilm):
    assert isinstance(minilm, Embedder)
    assert (minilm.name, minilm.dim, minilm.max_length, minilm.pooling) == ("all-MiniLM-L6-v2", 384, 256, "mean")
    vectors = minilm.embed(TEXTS[:2])
    np.testing.assert_allclose(vectors[:, :6], REFERENCE, atol=1e-5)


def test_minilm_normalised_deterministic_and_batch_independent(minilm):
    first = minilm.embed(TEXTS)
    _assert_unit_rows(first, len(TEXTS), 384)
    np.testing.assert_array_equal(first, minilm.embed(TEXTS))
    np.testing.assert_allclose(minilm.embed([TEXTS[2]])[0], first[2], atol=1e-5)
    assert first[0] @ first[2] > first[0] @ first[1] + 0.2, "cat sentences should be closer to each other than to finance"


def test_minilm_restores_torch_threads_and_truncates(minilm):
    before = torch.get_num_threads()
    long_text = "word " * 2000
    _assert_unit_rows(minilm.embed([long_text]), 1, 384)
    assert torch.get_num_threads() == before


def test_minilm_concurrent_embeds_agree_and_restore_threads(minilm):
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        with ThreadPoolExecutor(max_workers=4) as pool:
            results = list(pool.map(lambda text: minilm.embed([text]), TEXTS * 2))
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)
    np.testing.assert_array_equal(np.concatenate(results[:4]), np.concatenate(results[4:]))


def test_hashing_embedder_is_deterministic_unit_and_lexical():
    embedder = HashingEmbedder(64)
    vectors = embedder.embed(TEXTS)
    _assert_unit_rows(vectors, len(TEXTS), 64)
    np.testing.assert_array_equal(vectors, HashingEmbedder(64).embed(TEXTS))
    assert embedder.name == "hashing-64"
    assert vectors[0] @ HashingEmbedder(64).embed(["the CAT sat on the mat"])[0] > 0.99
    assert isinstance(embedder, Embedder)
    assert embedder.embed([]).shape == (0, 64)
    with pytest.raises(ValueError):
        HashingEmbedder(0)


def test_load_embedder_specs(tmp_path):
    assert load_embedder("hashing").dim == 256
    assert load_embedder("hashing-32").name == "hashing-32"
    assert load_embedder(MiniLMEmbedder().name).name == "all-MiniLM-L6-v2"  # the name an index's manifest records
    with pytest.raises(InvalidInputError, match="unknown embedder"):
        load_embedder("bert-large")
    with pytest.raises(InvalidInputError, match="not a model directory"):
        load_embedder(str(tmp_path))
    with pytest.raises(InvalidInputError, match="not a model directory"):
        LocalEmbedder(tmp_path / "missing")


def test_local_directory_with_cls_pooling(tmp_path, minilm):
    model_dir = tmp_path / "my-encoder"
    (model_dir / "1_Pooling").mkdir(parents=True)
    for file in minilm_model_dir().iterdir():
        if file.is_file():
            (model_dir / file.name).symlink_to(file)
    (model_dir / "1_Pooling" / "config.json").write_text('{"pooling_mode_cls_token": true, "pooling_mode_mean_tokens": false}')
    local = load_embedder(str(model_dir))
    assert (local.name, local.dim, local.pooling) == ("my-encoder", 384, "cls")
    vectors = local.embed(TEXTS[:2])
    batch = minilm.tokenizer(TEXTS[:2], padding=True, return_tensors="pt")
    with torch.inference_mode():
        cls = minilm.model(**batch).last_hidden_state[:, 0].numpy()
    np.testing.assert_allclose(vectors, cls / np.linalg.norm(cls, axis=1, keepdims=True), atol=1e-5)
    assert np.abs(vectors - minilm.embed(TEXTS[:2])).max() > 0.01


def test_minilm_query_is_not_held_up_by_an_upload_in_flight(minilm):
    """A one-text embed (a query) answers while a window of long chunks (an upload) is still
    embedding on another thread: it once waited for the whole window (13 s for 256 chunks)."""
    window = [f"chunk {i} " + "the harbour of Lyastil trades salt and amber " * 40 for i in range(32)]
    upload = ThreadPoolExecutor(max_workers=1)
    try:
        embedded = upload.submit(minilm.embed, window)
        time.sleep(0.2)  # tokenized (milliseconds) and into its forward (seconds)
        query = minilm.embed(["Where does Lyastil trade salt?"])
        assert not embedded.done(), "the query waited for the upload's window"
        _assert_unit_rows(query, 1, 384)
        _assert_unit_rows(embedded.result(), len(window), 384)
    finally:
        upload.shutdown()
    np.testing.assert_allclose(query, minilm.embed(["Where does Lyastil trade salt?"]), atol=1e-6)
