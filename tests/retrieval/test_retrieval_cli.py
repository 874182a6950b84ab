"""`hypic ingest`: summary output, errors, and how the chunking tokenizer is chosen."""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer
from typer.testing import CliRunner

import retrieval.cli as retrieval_cli
from app.cli import cli
from retrieval import HashingEmbedder, VectorIndex, minilm_model_dir
from retrieval.errors import InvalidInputError

runner = CliRunner()


@pytest.fixture
def docs(tmp_path):
    root = tmp_path / "docs"
    root.mkdir()
    (root / "a.md").write_text("# Alpha\n\nThe first document talks about rivers.\n")
    (root / "b.txt").write_text("The second document talks about mountains.\n")
    return root


def _ingest(*args: str):
    return runner.invoke(cli, ["ingest", *args, "--embedder", "hashing-64", "--tokenizer", str(minilm_model_dir())])


def test_ingest_prints_a_summary_and_builds_the_index(tmp_path, docs):
    result = _ingest(str(docs), "--index-dir", str(tmp_path / "index"))
    assert result.exit_code == 0, result.output
    assert "ingested 2 documents (0 replaced) as 2 chunks" in result.stdout
    index = VectorIndex(tmp_path / "index", HashingEmbedder(64))
    assert [d.document_id for d in index.list_documents()] == ["docs/a.md", "docs/b.txt"]
    again = _ingest(str(docs / "b.txt"), str(docs / "b.txt"), "--index-dir", str(tmp_path / "index"))
    assert again.exit_code == 1 and "appears twice" in again.output
    rerun = _ingest(str(docs), "--index-dir", str(tmp_path / "index"))
    assert "(2 replaced)" in rerun.stdout and "[2 chunks total]" in rerun.stdout


def test_ingest_errors_exit_1_and_leave_the_index(tmp_path, docs):
    assert _ingest(str(docs), "--index-dir", str(tmp_path / "index")).exit_code == 0
    before = sorted((p.name, p.read_bytes()) for p in (tmp_path / "index").iterdir())
    (docs / "empty.txt").write_text("")
    result = _ingest(str(docs / "empty.txt"), "--index-dir", str(tmp_path / "index"))
    assert result.exit_code == 1
    assert "error:" in result.output and "empty.txt: empty" in result.output
    assert sorted((p.name, p.read_bytes()) for p in (tmp_path / "index").iterdir()) == before
    walked = _ingest(str(docs), "--index-dir", str(tmp_path / "index"))  # found by a walk: reported and skipped
    assert walked.exit_code == 0 and "skipped" in walked.output and "empty.txt" in walked.output
    assert "ingested 2 documents (2 replaced)" in walked.stdout
    mismatch = runner.invoke(cli, ["ingest", str(docs / "a.md"), "--index-dir", str(tmp_path / "index"), "--embedder", "hashing-32", "--tokenizer", str(minilm_model_dir())])
    assert mismatch.exit_code == 1 and "dimension 64" in mismatch.output


def test_tokenizer_resolution(tmp_path, monkeypatch):
    monkeypatch.setattr(retrieval_cli, "SERVING_MODEL_DIR", tmp_path / "no-model")
    fallback = retrieval_cli.resolve_tokenizer(None, HashingEmbedder(8))
    assert fallback.vocab_size == 30522  # MiniLM's WordPiece vocabulary

    class WithTokenizer(HashingEmbedder):
        tokenizer = "the embedder's tokenizer"

    assert retrieval_cli.resolve_tokenizer(None, WithTokenizer(8)) == "the embedder's tokenizer"
    serving = tmp_path / "serving"
    AutoTokenizer.from_pretrained(str(minilm_model_dir())).save_pretrained(serving)
    monkeypatch.setattr(retrieval_cli, "SERVING_MODEL_DIR", serving)
    assert retrieval_cli.resolve_tokenizer(None, WithTokenizer(8)).name_or_path == str(serving)
    with pytest.raises(InvalidInputError, match="no tokenizer files"):
        retrieval_cli.resolve_tokenizer(tmp_path, HashingEmbedder(8))


def test_ingest_follows_the_gateway_settings(tmp_path, monkeypatch, smollm2_dir):
    """Without options, `hypic ingest` writes the index the gateway serves (HYPIC_INDEX_DIR), with
    its embedder, chunked in its model's tokenizer (HYPIC_MODEL)."""
    doc = tmp_path / "eiffel.md"
    doc.write_text("# Eiffel\n\nThe Eiffel Tower was completed in 1889. It stands in Paris.\n")
    monkeypatch.setenv("HYPIC_INDEX_DIR", str(tmp_path / "served-index"))
    monkeypatch.setenv("HYPIC_EMBEDDER", "hashing-64")
    monkeypatch.setenv("HYPIC_MODEL", "smollm2-135m-instruct")
    monkeypatch.chdir(tmp_path)  # no .env, no data/index here
    result = CliRunner().invoke(cli, ["ingest", str(doc)])
    assert result.exit_code == 0, result.output
    index = VectorIndex(tmp_path / "served-index", HashingEmbedder(64))
    (chunk,) = [hit.chunk for hit in index.search("Eiffel", 1)]
    smollm2 = AutoTokenizer.from_pretrained(smollm2_dir)
    assert chunk.token_count == len(smollm2.encode(chunk.text, add_special_tokens=False))
    assert not (tmp_path / "data").exists()


def test_ingest_names_an_unknown_model(tmp_path, monkeypatch):
    monkeypatch.setenv("HYPIC_MODEL", "nobody/nothing")
    result = CliRunner().invoke(cli, ["ingest", str(tmp_path), "--index-dir", str(tmp_path / "i"), "--embedder", "hashing-8"])
    assert result.exit_code == 1 and "nobody/nothing" in result.output
