"""Settings around documents: where the disk cache goes, which index gets the demo corpus, chunk size."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest

from app.http.server import create_app
from app.service.runtime import build_chunker, corpus_to_seed
from app.service.settings import DEFAULT_INDEX_DIR, DEFAULT_MODEL, DEMO_CORPUS_PATH, TINY_CORPUS_PATH, TINY_INDEX_DIR, Settings
from app.testing import LiveServer, single_torch_thread, tiny_engine
from retrieval import HashingEmbedder, VectorIndex


@pytest.fixture(autouse=True)
def clean_env(monkeypatch):
    for name in ("HYPIC_CACHE_DIR", "HYPIC_CORPUS_PATH", "HYPIC_INDEX_DIR", "HYPIC_CHUNK_TOKENS"):
        monkeypatch.delenv(name, raising=False)


def settings(**overrides) -> Settings:
    return Settings(_env_file=None, torch_threads=None, **overrides)


def test_disk_cache_is_on_by_default_beside_the_index(tmp_path, monkeypatch):
    assert settings(model=DEFAULT_MODEL).cache_dir == Path("data/cache")
    assert settings(model="hypic-tiny").cache_dir == Path("data/hypic-tiny/cache")  # the toy model's world apart
    assert settings(index_dir=tmp_path / "index").cache_dir == tmp_path / "cache"
    assert settings(index_dir=tmp_path / "index", cache_dir=tmp_path / "elsewhere").cache_dir == tmp_path / "elsewhere"
    assert settings(cache_dir=None).cache_dir is None
    monkeypatch.setenv("HYPIC_CACHE_DIR", "none")
    assert settings().cache_dir is None
    monkeypatch.setenv("HYPIC_CACHE_DIR", "")  # empty counts as unset
    assert settings(index_dir=tmp_path / "index").cache_dir == tmp_path / "cache"
    monkeypatch.setenv("HYPIC_INDEX_DIR", str(tmp_path / "from-env" / "index"))
    assert settings().cache_dir == tmp_path / "from-env" / "cache"


def test_demo_corpus_seeds_only_the_default_index(tmp_path, monkeypatch):
    real = settings(model=DEFAULT_MODEL)
    assert (real.index_dir, corpus_to_seed(real)) == (Path(DEFAULT_INDEX_DIR), Path(DEMO_CORPUS_PATH))
    assert corpus_to_seed(settings(model=DEFAULT_MODEL, index_dir=Path(DEFAULT_INDEX_DIR))) == Path(DEMO_CORPUS_PATH)
    assert corpus_to_seed(settings(model="smollm2-135m-instruct")) == Path(DEMO_CORPUS_PATH)  # any real-language model
    tiny = settings(model="hypic-tiny")  # the suite's model (tests/conftest.py) and a named choice: its made-up world
    assert (tiny.index_dir, corpus_to_seed(tiny)) == (Path(TINY_INDEX_DIR), Path(TINY_CORPUS_PATH))
    assert corpus_to_seed(settings(model="hypic-tiny", index_dir=Path(DEFAULT_INDEX_DIR))) is None  # not into the real one
    monkeypatch.setenv("HYPIC_MODEL_PATH", "hypic-tiny")  # the former name of `model` picks the defaults too
    monkeypatch.delenv("HYPIC_MODEL")
    assert corpus_to_seed(settings()) == Path(TINY_CORPUS_PATH)
    monkeypatch.delenv("HYPIC_MODEL_PATH")
    assert corpus_to_seed(settings()) == Path(DEMO_CORPUS_PATH)  # nothing named: the real default
    monkeypatch.setenv("HYPIC_MODEL", "hypic-tiny")
    assert corpus_to_seed(settings(index_dir=tmp_path / "mine")) is None
    mine = tmp_path / "corpus.jsonl"
    assert corpus_to_seed(settings(index_dir=tmp_path / "mine", corpus_path=mine)) == mine
    monkeypatch.setenv("HYPIC_INDEX_DIR", str(tmp_path / "env-index"))
    assert corpus_to_seed(settings()) is None
    monkeypatch.setenv("HYPIC_CORPUS_PATH", str(mine))
    assert corpus_to_seed(settings()) == mine
    monkeypatch.setenv("HYPIC_CORPUS_PATH", "none")
    monkeypatch.delenv("HYPIC_INDEX_DIR")
    assert corpus_to_seed(settings()) is None


def _documents_after_start(engine, settings_: Settings, index: VectorIndex) -> list[str]:
    with single_torch_thread(), LiveServer(create_app(settings_, engine=engine, index=index)) as live:
        live.wait_ready()
        return [d["document_id"] for d in httpx.get(f"{live.url}/documents", params={"limit": 1000}).json()["data"]]


def test_gateway_seeds_the_demo_corpus_only_into_the_default_index(tiny_tokenizer, tmp_path):
    assert Path(DEMO_CORPUS_PATH).is_file() and Path(TINY_CORPUS_PATH).is_file(), "run from the repository root"
    engine = tiny_engine(tiny_tokenizer)
    pointed = settings(index_dir=tmp_path / "user-index")
    assert _documents_after_start(engine, pointed, VectorIndex(pointed.index_dir, HashingEmbedder(64))) == []
    # The default index_dir (the index object is a tmp one, so nothing is written to data/).
    seeded = _documents_after_start(engine, settings(), VectorIndex(tmp_path / "stand-in", HashingEmbedder(64)))
    assert len(seeded) > 10
    off = settings(corpus_path=None)
    assert _documents_after_start(engine, off, VectorIndex(tmp_path / "off", HashingEmbedder(64))) == []


def _engine_with_context(tokenizer, positions: int) -> SimpleNamespace:
    """What `build_chunker` reads of an engine: its tokenizer and `max_positions`."""
    return SimpleNamespace(tokenizer=tokenizer, max_positions=positions)


def test_chunk_size_follows_the_model(tiny_tokenizer):
    big = build_chunker(settings(), _engine_with_context(tiny_tokenizer, 32768))
    assert (big.target_tokens, big.max_tokens) == (384, 512)
    small = build_chunker(settings(), _engine_with_context(tiny_tokenizer, 256))
    assert (small.target_tokens, small.max_tokens) == (64, 85)
    unknown = build_chunker(settings(), _engine_with_context(tiny_tokenizer, 1 << 20))  # an engine's value when the config has none
    assert unknown.target_tokens == 384
    chosen = build_chunker(settings(chunk_tokens=30), _engine_with_context(tiny_tokenizer, 256))
    assert (chosen.target_tokens, chosen.max_tokens) == (30, 40)


def test_api_chunks_with_chunk_tokens(tiny_tokenizer, tmp_path):
    s = settings(index_dir=tmp_path / "index", chunk_tokens=16)
    text = "\n\n".join(f"The river Alna flows through Varo, paragraph {n}. Its mayor is Ines Kell." for n in range(8))
    with single_torch_thread(), LiveServer(create_app(s, engine=tiny_engine(tiny_tokenizer), index=VectorIndex(s.index_dir, HashingEmbedder(64)))) as live:
        live.wait_ready()
        assert httpx.post(f"{live.url}/documents", json={"id": "long", "text": text}).status_code == 201
        content = httpx.get(f"{live.url}/documents/long").json()["content"]
    assert len(content) > 4 and max(c["tokens"] for c in content) <= 21
