"""What a running gateway holds: settings, engine, vector index, chunker, prompter, engine thread, metrics.

The engine and the index load on a background thread started by `start_loading`, so the server
answers /health and /ready (503) at once. If loading fails, `load_error` says why and
`on_load_failure` (set by `hypic serve`) is called with it. An engine or index given to `create_app` (an object,
or a zero-argument callable returning one, e.g. for tests) replaces loading it from settings.
When the index is empty after loading and a corpus is due (`corpus_to_seed`: the demo corpus only
into the default index), the corpus is ingested first.
"""

from __future__ import annotations

import logging
import threading
import time
from pathlib import Path
from typing import Callable, Union

from hypic_core.cache import build_store as build_segment_store
from hypic_core.cache.store import SegmentStore
from hypic_core.config import EngineConfig
from hypic_core.engine.engine import Engine
from hypic_core.models.registry import KNOWN_MODELS, ResolvedModel
from hypic_core.models.registry import resolve as resolve_model
from retrieval.chunker import Chunker, default_chunk_tokens
from retrieval.index import VectorIndex

from .engine_thread import EngineThread
from .errors import NotReadyError
from .guard import Guard, release_for
from .metrics import Metrics
from .prompter import Prompter
from .settings import Settings
from .tenants import Collections, Quotas, TenantLabels
from .tokens import TokenText

log = logging.getLogger("hypic.runtime")

EngineSource = Union[Engine, Callable[[], Engine], None]
IndexSource = Union[VectorIndex, Callable[[], VectorIndex], None]


def store_from_settings(settings: Settings) -> SegmentStore:
    """A hot tier on the model's device (GPU), host memory, a disk tier in `cache_dir` when set, and
    a Redis tier shared with other gateways when `redis_url` is set."""
    redis_url = settings.redis_url.get_secret_value() if settings.redis_url is not None else None
    return build_segment_store(settings.cache_memory_bytes, device=settings.device, device_bytes=settings.cache_device_bytes,
                               directory=settings.cache_dir, disk_bytes=settings.cache_disk_bytes,
                               storage_dtype=settings.cache_storage_dtype, redis_url=redis_url,
                               redis_bytes=settings.redis_max_bytes, redis_ttl_s=settings.redis_ttl_s,
                               redis_prefix=settings.redis_prefix, redis_timeout_s=settings.redis_timeout_s,
                               redis_secret=settings.cache_secret.get_secret_value() if settings.cache_secret else None)


def load_engine(settings: Settings, model: ResolvedModel | None = None) -> Engine:
    """`settings.model` (resolved here unless given) with the configured seam, mode, budgets, dtype and store."""
    model = model or resolve_model(settings.model, settings.models_dir)
    config = EngineConfig(seam=settings.seam, memory_budget_bytes=settings.cache_memory_bytes,
                          exact_budget_bytes=settings.exact_runs_bytes, exact_repeats=settings.exact_repeats,
                          repeats=settings.repeats, scheduling=settings.scheduling, cold_prefill=settings.cold_prefill,
                          decode_step=settings.decode_step, decode_kernel=settings.decode_kernel,
                          speculation=settings.speculation, reuse_key_scale=settings.reuse_key_scale,
                          reuse_key_scope=settings.reuse_key_scope, recompute_ratio=settings.recompute_ratio,
                          lookup_deadline_s=settings.lookup_deadline_s, entry_batching=settings.entry_batching)
    return Engine.from_pretrained(model.path, config, store_from_settings(settings), dtype=settings.dtype, device=settings.device,
                                  model_id=settings.served_model_name, prefill_workers=settings.prefill_workers,
                                  prefill_backend=settings.prefill_backend, prefill_threads=settings.prefill_worker_threads,
                                  ray_address=settings.ray_address, prefill_split_tokens=settings.prefill_split_tokens)


def load_index(settings: Settings) -> VectorIndex:
    from retrieval.embedder import load_embedder

    return VectorIndex(settings.index_dir, load_embedder(settings.embedder))


def corpus_to_seed(settings: Settings) -> Path | None:
    """The corpus to ingest into an empty index at startup: `corpus_path` when it was set
    explicitly; the model's demo corpus (its default) only into the model's default `index_dir`,
    so an index the user pointed the gateway at never receives demo documents. None: ingest nothing."""
    if "corpus_path" in settings.model_fields_set or settings.demo_index:
        return settings.corpus_path
    return None


def build_chunker(settings: Settings, engine: Engine) -> Chunker:
    """A chunker in the engine's tokenizer, `settings.chunk_tokens` per chunk (default: min(384,
    a quarter of the model's context)), chunks of at most 4/3 of that."""
    target = settings.chunk_tokens or default_chunk_tokens(engine.max_positions)
    return Chunker(engine.tokenizer, target, target * 4 // 3)


class Runtime:
    """Shared state of one app. `engine`, `index`, `chunker`, `prompter`, `tokens` are set once `ready`."""

    def __init__(self, settings: Settings, engine: EngineSource = None, index: IndexSource = None) -> None:
        self.settings = settings
        self.metrics = Metrics(settings.served_model_name)
        self.engine_thread = EngineThread(settings.max_running, settings.max_queue, self.metrics)
        self.engine: Engine | None = None
        self.index: VectorIndex | None = None
        self.chunker: Chunker | None = None
        self.prompter: Prompter | None = None
        self.tokens: TokenText | None = None
        self.guard: Guard | None = None  # the accuracy guard (app/service/guard.py), set once loaded
        self.collections: Collections | None = None  # every tenant's documents (app/service/tenants.py), set once loaded
        self.quotas = Quotas(settings.tenant_max_documents, settings.tenant_max_bytes, settings.tenant_max_requests)
        self.tenant_labels = TenantLabels(list(settings.tenant_keys.values()), named=settings.metrics_tenant_labels)
        self.model_name = settings.served_model_name
        self.load_error: str | None = None
        self.created = int(time.time())
        self.on_load_failure: Callable[[str], None] | None = None  # called on the loader thread with `load_error`
        self._ready = threading.Event()
        self._engine_source = engine
        self._index_source = index
        self._owns_engine = engine is None  # a given engine (and its store) belongs to the caller

    @property
    def ready(self) -> bool:
        return self._ready.is_set()

    def start_loading(self) -> None:
        """Load on a background thread; `ready` turns true when done, `load_error` says why not."""
        threading.Thread(target=self._load, name="hypic-loader", daemon=True).start()

    def require_ready(self) -> None:
        """Raise `NotReadyError` unless the model and index are loaded."""
        if not self.ready:
            detail = f"loading failed: {self.load_error}" if self.load_error else "model and index are loading"
            raise NotReadyError(detail)

    def close(self) -> None:
        """Stop the engine thread; an engine loaded here stops its prefill workers and its store finishes its disk writes."""
        self.engine_thread.close()
        if self._owns_engine and self.engine is not None:
            self.engine.close()  # its prefill workers, if any
            if hasattr(self.engine.store, "close"):
                self.engine.store.close()

    def _load(self) -> None:
        started = time.perf_counter()
        stage = f"loading model {self.settings.model}"  # what was being done, for the reason given on failure
        try:
            if self.settings.torch_threads:
                import torch

                torch.set_num_threads(self.settings.torch_threads)
            if self.settings.device == "cpu":
                # transformers warns that each fused GPU kernel is missing: on a CPU the torch
                # fallbacks are what runs anyway (hypic_core/adapters/kernels.py), so say nothing.
                logging.getLogger("transformers.integrations.hub_kernels").setLevel(logging.ERROR)
            known, release = KNOWN_MODELS.get(self.settings.model), None
            prompt = known.prompt if known else None  # a given engine: the named model's, if it is one
            if self._engine_source is None:
                model = resolve_model(self.settings.model, self.settings.models_dir, progress=log.info)
                prompt = model.prompt
                release = release_for(model.name, model.path)  # the model card's faithfulness, the guard's default threshold
                stage = f"loading model {self.settings.model} from {model.path}"
                engine = load_engine(self.settings, model)
            else:
                stage = "loading the given engine"
                engine = _resolve(self._engine_source)
            self.engine_thread.attach(engine)  # before its limits change: another gateway's engine is refused here
            engine.set_limits(self.settings.max_running, self.settings.max_step_tokens, self.settings.running_budget_bytes)
            stage = f"opening index {self.settings.index_dir}"
            index = load_index(self.settings) if self._index_source is None else _resolve(self._index_source)
            chunker = build_chunker(self.settings, engine)
            corpus = corpus_to_seed(self.settings)
            if len(index) == 0 and corpus is not None and corpus.is_file():
                from retrieval.ingest import ingest_paths
                from retrieval.pipeline import ProgressLog

                stage = f"ingesting corpus {corpus}"
                progress = ProgressLog(lambda p: log.info("ingesting corpus", extra={"documents": p.documents, "of": p.documents_total,
                                                                                     "chunks": p.chunks, "chunks_per_s": round(p.chunks_per_second, 1)}))
                summary = ingest_paths([corpus], index, chunker, progress)
                log.info("ingested corpus", extra={"corpus": str(corpus), "documents": summary.documents, "chunks": summary.chunks})
            self.engine, self.index, self.chunker = engine, index, chunker
            self.collections = Collections(self.settings.collections_root, index, self.settings.shared_collections)
            layout = self.settings.prompt_layout(engine.tokenizer, prompt)
            self.prompter = Prompter(engine.tokenizer, layout, engine.max_positions)
            self.tokens = TokenText(engine.tokenizer)
            if not self._owns_engine:
                self.model_name = self.settings.model_name or engine.model_id
                self.metrics.model_name = self.model_name
            self.metrics.watch_store(engine.store)
            self.metrics.watch_lookups(engine.lookups)
            self.metrics.watch_speculation(engine.speculation)
            self.guard = Guard.for_engine(self.settings, engine, self.model_name, self.metrics.registry, wake=self.engine_thread.wake,
                                          release=release,
                                          submit=lambda request, deliver: self.engine_thread.submit_internal(engine, request, deliver))
            self.engine_thread.run_when_idle(self.guard)
            self._ready.set()
            log.info("ready", extra={"model": self.model_name, "chunks": len(index), "seconds": round(time.perf_counter() - started, 3)})
        except Exception as exc:  # reported by /ready; `hypic serve` exits unless told to stay up for inspection
            self.load_error = f"{stage}: {type(exc).__name__}: {exc}"
            log.exception("loading failed")
            if self.on_load_failure is not None:
                self.on_load_failure(self.load_error)


def _resolve(source):
    return source() if callable(source) else source
