"""The gateway tests' one fixture factory: live gateways over the tiny engine, torch on one thread.

- `gateway(root, tokenizer, corpus, **settings)`: `app.testing.tiny_gateway` (the tiny engine, a
  hashing embedder, `corpus` ingested at start) served on a free port until the block ends;
- `served(app)`: an app built otherwise, served the same way;
- `app(root, engine, **settings)`: a gateway app over a given engine with an empty index in `root`;
- `engine(tokenizer, stop_at_eos=...)`: the tiny engine (`app.testing.tiny_engine`) for a module's
  gateways to share; `settings(root, **overrides)`: the settings every one of them starts from.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Iterator

from app.http.server import create_app
from app.service.settings import Settings
from app.testing import LiveServer, single_torch_thread, tiny_engine, tiny_gateway
from retrieval import HashingEmbedder, VectorIndex

__all__ = ["app", "engine", "gateway", "served", "settings"]


def settings(root: Path, **overrides) -> Settings:
    """A gateway's settings with its index in `root`/index: no .env file, torch thread setting or
    startup corpus is read unless `overrides` name one."""
    return Settings(**{"_env_file": None, "torch_threads": None, "index_dir": root / "index", "corpus_path": None,
                       **overrides})


def app(root: Path, engine, **overrides):
    """A gateway app over `engine` and an empty `HashingEmbedder(64)` index in `root`/index."""
    return create_app(settings(root, **overrides), engine=engine, index=VectorIndex(root / "index", HashingEmbedder(64)))


@contextlib.contextmanager
def served(app, headers: dict | None = None) -> Iterator[LiveServer]:
    """`app` on a free port, ready (GET /ready answered 200, asked with `headers`), until the block ends."""
    with single_torch_thread(), LiveServer(app) as live:
        live.wait_ready(headers=headers)
        yield live


@contextlib.contextmanager
def gateway(root: Path, tokenizer, corpus: list[dict], headers: dict | None = None, **overrides) -> Iterator[LiveServer]:
    """`app.testing.tiny_gateway(root, tokenizer, corpus, **overrides)`, served (`served`)."""
    with served(tiny_gateway(root, tokenizer, corpus, **overrides), headers) as live:
        yield live


@contextlib.contextmanager
def engine(tokenizer, stop_at_eos: bool = True):
    """The tiny engine sized to `tokenizer`, built with torch on one thread (`stop_at_eos=False`:
    generations run to max_tokens)."""
    with single_torch_thread():
        yield tiny_engine(tokenizer, stop_at_eos=stop_at_eos)
