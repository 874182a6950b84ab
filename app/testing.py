"""Test helpers: a real uvicorn server on a loopback port, in a thread, and a tiny engine.

    engine = tiny_engine(tokenizer)
    with LiveServer(create_app(settings, engine=engine, index=index)) as server:
        server.wait_ready()
        httpx.get(f"{server.url}/health")

    with LiveServer(tiny_gateway(tmp_dir, tokenizer, corpus)) as server: ...   # all of it in one call
"""

from __future__ import annotations

import contextlib
import json
import socket
import threading
import time
from pathlib import Path
from typing import Iterator

import httpx
import uvicorn


# Fixed ports a local Ray instance binds once it starts, inside the kernel's ephemeral range the
# OS hands out below (Ray's dashboard agent listens on 52365 even with the dashboard off). A test
# that picked one of them before `ray.init` lost it to Ray and Serve's proxy failed to bind.
_TAKEN_LATER = frozenset({52365})


def free_port() -> int:
    """A port free on 127.0.0.1 now. Call it after starting anything that binds ports of its own."""
    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port not in _TAKEN_LATER:
            return port


@contextlib.contextmanager
def single_torch_thread() -> Iterator[None]:
    """Run torch with one intra-op thread inside the block (restored after).

    The tiny test model's ops are too small to split: with 2 intra-op threads on 2 cores shared
    with other jobs, gateway requests were measured 10-100x slower than with 1.
    """
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def tiny_engine(tokenizer, seed: int = 0, stop_at_eos: bool = True):
    """An `Engine` over a tiny random qwen3_5 model sized to `tokenizer` (seam 4, model id "tiny").
    With `stop_at_eos=False` it never samples its way to EOS, so generations run to max_tokens."""
    from hypic_core.config import EngineConfig
    from hypic_core.engine.engine import Engine
    from hypic_core.testing import tiny_model

    engine = Engine(tiny_model("qwen3_5", seed=seed, vocab_size=len(tokenizer)), tokenizer, EngineConfig(seam=4), model_id="tiny")
    if not stop_at_eos:
        engine.eos_ids = frozenset()
    return engine


def tiny_gateway(root: Path, tokenizer, corpus: list[dict], **settings):
    """A gateway app over `tiny_engine(tokenizer)` and a `HashingEmbedder(64)` index in `root`,
    with `corpus` (`{"id", "text", "title"?}` records) ingested when it starts; `settings`
    override `Settings` fields (no .env file or torch thread setting is read)."""
    from retrieval import HashingEmbedder, VectorIndex

    from .http.server import create_app
    from .service.settings import Settings

    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    (root / "corpus.jsonl").write_text("".join(json.dumps(d) + "\n" for d in corpus))
    config = Settings(**{"_env_file": None, "torch_threads": None, "index_dir": root / "index",
                         "corpus_path": root / "corpus.jsonl", **settings})
    return create_app(config, engine=tiny_engine(tokenizer), index=VectorIndex(config.index_dir, HashingEmbedder(64)))


class LiveServer:
    """Serves `app` on 127.0.0.1 at a free port from `start()` (or `with`) until `stop()`, with
    the connection limits of the app's settings (`connections.uvicorn_options`), as `hypic serve`."""

    def __init__(self, app, port: int | None = None) -> None:
        from .http.connections import uvicorn_options

        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        runtime = getattr(app.state, "runtime", None)
        options = uvicorn_options(runtime.settings) if runtime is not None else {}
        config = uvicorn.Config(app, host="127.0.0.1", port=self.port, log_config=None, access_log=False,
                                timeout_graceful_shutdown=2, **options)
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, name=f"uvicorn-{self.port}", daemon=True)

    def start(self, timeout: float = 30.0) -> "LiveServer":
        """Start serving; returns once the socket accepts connections. Raises TimeoutError."""
        self.thread.start()
        deadline = time.monotonic() + timeout
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise TimeoutError(f"uvicorn did not start on port {self.port}")
            time.sleep(0.02)
        return self

    def wait_ready(self, timeout: float = 60.0, headers: dict | None = None) -> None:
        """Poll GET /ready until 200. Raises TimeoutError with the last answer."""
        deadline = time.monotonic() + timeout
        last = None
        while time.monotonic() < deadline:
            last = httpx.get(f"{self.url}/ready", headers=headers)
            if last.status_code == 200:
                return
            time.sleep(0.05)
        raise TimeoutError(f"{self.url}/ready: {last.status_code if last else '-'} {last.text if last else ''}")

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)

    def __enter__(self) -> "LiveServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
