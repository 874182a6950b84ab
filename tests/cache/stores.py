"""The cache tests' one fixture factory: the models and gateways the tiers are tried under.

- `model()`: the two-layer hybrid (one linear-attention layer, one full-attention layer) that the
  engine-on-a-store tests run (`cache/conftest.py` gives it to each module as the `model` fixture);
- `engine(store, tokenizer)`: `app.testing.tiny_engine`'s engine (qwen3_5 sized to `tokenizer`,
  seam 4, model id "tiny") over `store`;
- `gateway(root, tokenizer, corpus, store=None, **settings)`: a gateway app over that engine, with
  `corpus` ingested when it starts, and its store: `store`, or the one `hypic serve` builds from
  the settings (host memory, a disk tier beside the index, Redis where `redis_url` is set).
"""

from __future__ import annotations

import json
from pathlib import Path

from app.http.server import create_app
from app.service.runtime import store_from_settings
from app.service.settings import Settings
from hypic_core.config import EngineConfig
from hypic_core.engine.engine import Engine
from hypic_core.testing import tiny_model
from retrieval import HashingEmbedder, VectorIndex

__all__ = ["engine", "gateway", "model"]


def model():
    return tiny_model("qwen3_5", num_hidden_layers=2, layer_types=["linear_attention", "full_attention"])


def engine(store, tokenizer) -> Engine:
    return Engine(tiny_model("qwen3_5", vocab_size=len(tokenizer)), tokenizer, EngineConfig(seam=4), store=store, model_id="tiny")


def gateway(root: Path, tokenizer, corpus: list[dict], store=None, **overrides):
    """(app, store): see the module's docstring. `overrides` are `Settings` fields (no .env file or
    torch thread setting is read)."""
    root.mkdir(parents=True, exist_ok=True)
    (root / "corpus.jsonl").write_text("".join(json.dumps(d) + "\n" for d in corpus))
    settings = Settings(**{"_env_file": None, "torch_threads": None, "index_dir": root / "index",
                           "corpus_path": root / "corpus.jsonl", **overrides})
    store = store if store is not None else store_from_settings(settings)
    app = create_app(settings, engine=engine(store, tokenizer), index=VectorIndex(settings.index_dir, HashingEmbedder(64)))
    return app, store
