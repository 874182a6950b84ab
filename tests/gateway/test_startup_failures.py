"""Startup failures: `hypic serve` exits with the reason when the model does not load (unless told
to stay up), and a damaged disk cache does not keep the gateway from becoming ready."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from app.http.server import create_app
from app.service.settings import Settings
from app.testing import LiveServer, free_port

import gateways
from test_cache_disk import _damage, _filled_cache
from test_gateway_operations import metric

ROOT = Path(__file__).resolve().parents[2]


def _serve(tmp_path: Path, model: str, **env: str) -> tuple[subprocess.Popen, str]:
    """`hypic serve --model MODEL` in its own process, with an index and no cache under tmp_path."""
    port = free_port()
    environment = {k: v for k, v in os.environ.items() if not k.startswith("HYPIC_")} | {
        "HYPIC_INDEX_DIR": str(tmp_path / "index"), "HYPIC_CORPUS_PATH": "none", "HYPIC_CACHE_DIR": "none",
        "HYPIC_EMBEDDER": "hashing-64", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
        "PYTHONPATH": os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])} | env  # this checkout's code, not .env
    process = subprocess.Popen([sys.executable, "-m", "app.cli", "serve", "--model", model, "--port", str(port)], cwd=tmp_path,
                               env=environment, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    return process, f"http://127.0.0.1:{port}"


def test_serve_exits_non_zero_with_the_reason_when_the_model_does_not_load(tmp_path):
    """Before: the process stayed up answering 503 forever, so Compose's restart policy never acted."""
    broken = tmp_path / "broken-model"
    broken.mkdir()
    (broken / "config.json").write_text('{"model_type": "qwen3_5", "hidden_size": ')
    started = time.monotonic()
    process, _ = _serve(tmp_path, str(broken))
    try:
        output, _ = process.communicate(timeout=60)
    finally:
        process.kill()
    assert process.returncode == 1 and time.monotonic() - started < 60, output
    assert f"error: loading failed: loading model {broken} from {broken}: JSONDecodeError" in output


def test_serve_stays_up_answering_503_when_told_to(tmp_path):
    process, url = _serve(tmp_path, str(tmp_path / "nonexistent"), HYPIC_EXIT_ON_LOAD_FAILURE="false")
    try:
        deadline, ready = time.monotonic() + 120, None
        while time.monotonic() < deadline and process.poll() is None:
            try:
                ready = httpx.get(f"{url}/ready", timeout=2)
                if ready.json().get("status") == "failed":
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        assert ready is not None and ready.status_code == 503, process.poll()
        assert "nonexistent" in ready.json()["error"]
        time.sleep(0.5)
        assert process.poll() is None and httpx.get(f"{url}/health").status_code == 200
    finally:
        process.terminate()
        process.communicate(timeout=30)
    assert process.returncode in (0, -15)  # SIGTERM: a clean shutdown (uvicorn re-raises the signal it caught)


@pytest.fixture(scope="module")
def engine(tiny_tokenizer):
    with gateways.engine(tiny_tokenizer) as engine:
        yield engine


def test_a_damaged_disk_cache_does_not_keep_the_gateway_from_becoming_ready(engine, tmp_path):
    """The model, index and disk tier all load from settings; the tier's cache.db is damaged."""
    model_dir = tmp_path / "model"
    engine.model.save_pretrained(model_dir)
    engine.tokenizer.save_pretrained(model_dir)
    cache = tmp_path / "cache"
    _filled_cache(cache)
    _damage(cache / "cache.db", "cut-100")
    settings = Settings(_env_file=None, torch_threads=None, model=str(model_dir), index_dir=tmp_path / "index",
                        corpus_path=None, embedder="hashing-64", cache_dir=cache, seam=2)
    with LiveServer(create_app(settings)) as live:
        live.wait_ready(timeout=60)
        assert metric(live.url, "hypic_cache_disk_damaged_total") == 1
        assert httpx.post(f"{live.url}/documents", json={"id": "a", "text": "Varo lies on the Alna."}, timeout=30).status_code == 201
        assert httpx.post(f"{live.url}/query", json={"question": "Where is Varo?", "max_tokens": 2}, timeout=30).status_code == 200
    assert len(list(tmp_path.glob("cache.damaged-*"))) == 1
