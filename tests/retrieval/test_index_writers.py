"""One index directory, several processes: writers take turns at the write lock and load each
other's generations, readers see them; `hypic ingest` next to a live gateway loses nothing."""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import subprocess
import sys
from pathlib import Path

import filelock
import httpx
import pytest

from app.http.server import create_app
from app.service.settings import Settings
from app.testing import LiveServer
from retrieval import HashingEmbedder, IndexCorruptError, IndexLockedError, VectorIndex, minilm_model_dir
from retrieval.index import LOCK_NAME

import gateways
from index_child import document, writer

ROOT = Path(__file__).resolve().parents[2]


def _ids(index: VectorIndex) -> set[str]:
    return {d.document_id for d in index.list_documents()}


def test_two_processes_writing_one_index_lose_nothing(tmp_path):
    """Without the lock and the reload under it, each process writes generations from its own
    in-memory state and the last one to save drops the other's documents."""
    VectorIndex(tmp_path / "index", HashingEmbedder(64)).upsert(document("seed"))
    ctx = mp.get_context("spawn")
    start, done = ctx.Barrier(2), ctx.Queue()  # both hold generation 1 before either writes
    writers = [ctx.Process(target=writer, args=(str(tmp_path / "index"), prefix, 15, start, done)) for prefix in ("a", "b")]
    for p in writers:
        p.start()
    for p in writers:
        p.join(120)
    assert [p.exitcode for p in writers] == [0, 0]  # before the lock: a writer failed on files the other replaced
    seen = dict(done.get(timeout=10) for _ in writers)
    expected = {"seed"} | {f"{prefix}-{n:02d}" for prefix in "ab" for n in range(15)}
    assert _ids(VectorIndex(tmp_path / "index", HashingEmbedder(64))) == expected
    # Each writer held, after its last write, everything written before it: its own and the other's so far.
    assert all({f"{prefix}-{n:02d}" for n in range(15)} <= set(ids) for prefix, ids in seen.items())
    assert max(len(ids) for ids in seen.values()) == len(expected)


def test_a_reader_sees_another_process_s_generation_and_a_damaged_one_does_not_stop_it(tmp_path, caplog):
    reader = VectorIndex(tmp_path / "index", HashingEmbedder(64))
    assert len(reader) == 0
    ctx = mp.get_context("spawn")
    done = ctx.Queue()
    p = ctx.Process(target=writer, args=(str(tmp_path / "index"), "x", 2, None, done))
    p.start()
    done.get(timeout=120)
    p.join(30)
    assert _ids(reader) == {"x-00", "x-01"} and len(reader) == 2
    assert reader.search("river number x-01", top_k=1)[0].chunk.document_id == "x-01"
    # A newer generation that cannot be read: reads keep serving the one held (logged once); a
    # write refuses to overwrite it.
    manifest_path = reader.directory / "manifest.json"
    manifest = json.loads(manifest_path.read_text())
    manifest |= {"generation": manifest["generation"] + 1, "index_file": "index-999999.faiss"}
    manifest_path.write_text(json.dumps(manifest))
    assert _ids(reader) == {"x-00", "x-01"} and _ids(reader) == {"x-00", "x-01"}
    assert [r.levelname for r in caplog.records if "cannot load" in r.message] == ["WARNING"]
    with pytest.raises(IndexCorruptError, match="cannot read index generation"):
        reader.upsert(document("y"))


def test_a_writer_waits_for_the_lock_then_names_its_holder(tmp_path):
    index = VectorIndex(tmp_path / "index", HashingEmbedder(64), lock_timeout=0.3)
    index.upsert(document("a"))
    with filelock.FileLock(tmp_path / "index" / LOCK_NAME):  # another writer, mid-save
        with pytest.raises(IndexLockedError) as info:
            index.upsert(document("b"))
    assert f"pid {os.getpid()}" in str(info.value) and "write lock" in str(info.value)
    index.upsert(document("b"))
    assert _ids(index) == {"a", "b"}


def _cli_ingest(index_dir: Path, *paths: Path, lock_timeout: float | None = None) -> subprocess.CompletedProcess:
    """`hypic ingest` in its own process, as a user runs it next to a gateway."""
    command = [sys.executable, "-m", "app.cli", "ingest", *map(str, paths), "--index-dir", str(index_dir),
               "--embedder", "hashing-64", "--tokenizer", str(minilm_model_dir())]
    if lock_timeout is not None:
        command += ["--lock-timeout", str(lock_timeout)]
    env = {k: v for k, v in os.environ.items() if not k.startswith("HYPIC_")} | {"HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
        "PYTHONPATH": os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])}  # this checkout's code
    return subprocess.run(command, cwd=index_dir.parent, env=env, capture_output=True, text=True, timeout=180)


@pytest.fixture(scope="module")
def engine(tiny_tokenizer):
    with gateways.engine(tiny_tokenizer) as engine:
        yield engine


def test_hypic_ingest_next_to_a_live_gateway_loses_nothing(engine, tmp_path):
    """The gateway serves what the CLI ingested from its next request, and its own next write
    keeps it (before: the gateway wrote a generation from its stale state, dropping it)."""
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "alna.md").write_text("# Alna\n\nThe river Alna flows through Varo.\n")
    (docs / "brill.txt").write_text("Brill was founded by Tam Oke.\n")
    index_dir = tmp_path / "index"
    settings = Settings(_env_file=None, torch_threads=None, index_dir=index_dir, corpus_path=None, cache_dir=None)
    gateway_index = VectorIndex(index_dir, HashingEmbedder(64), lock_timeout=0.5)
    with LiveServer(create_app(settings, engine=engine, index=gateway_index)) as live:
        live.wait_ready()
        first = httpx.post(f"{live.url}/documents", json={"id": "api-1", "text": "The mayor of Varo is Ines Kell."}, timeout=30)
        assert first.status_code == 201, first.text

        ingested = _cli_ingest(index_dir, docs)
        assert ingested.returncode == 0, ingested.stderr
        assert "ingested 2 documents" in ingested.stdout and "[3 chunks total]" in ingested.stdout

        listed = httpx.get(f"{live.url}/documents").json()
        assert [d["document_id"] for d in listed["data"]] == ["api-1", "docs/alna.md", "docs/brill.txt"]
        assert httpx.get(f"{live.url}/ready").json()["chunks"] == 3
        hits = httpx.post(f"{live.url}/search", json={"query": "Who founded Brill?", "top_k": 1}).json()["data"]
        assert hits[0]["document_id"] == "docs/brill.txt"
        second = httpx.post(f"{live.url}/documents", json={"id": "api-2", "text": "Varo has two bridges."}, timeout=30)
        assert second.status_code == 201, second.text
        assert httpx.delete(f"{live.url}/documents/api-1").status_code == 200

        with filelock.FileLock(index_dir / LOCK_NAME):  # a writer that does not finish in time: 503, nothing lost
            locked = httpx.post(f"{live.url}/documents", json={"id": "api-3", "text": "Too late."}, timeout=30)
        assert locked.status_code == 503 and locked.json()["error"]["code"] == "index_locked"
        assert locked.headers["retry-after"] and f"pid {os.getpid()}" in locked.json()["error"]["message"]

    expected = {"docs/alna.md", "docs/brill.txt", "api-2"}
    assert _ids(VectorIndex(index_dir, HashingEmbedder(64))) == expected


def test_hypic_ingest_gives_up_on_a_held_lock_naming_the_holder(tmp_path):
    VectorIndex(tmp_path / "index", HashingEmbedder(64)).upsert(document("a"))
    (tmp_path / "new.txt").write_text("A new document.\n")
    with filelock.FileLock(tmp_path / "index" / LOCK_NAME):
        result = _cli_ingest(tmp_path / "index", tmp_path / "new.txt", lock_timeout=0.5)
    assert result.returncode == 1
    message = " ".join(result.stderr.split())
    assert f"is being written by pid {os.getpid()}" in message and "gave up after waiting 0.5 s" in message
    assert _ids(VectorIndex(tmp_path / "index", HashingEmbedder(64))) == {"a"}
