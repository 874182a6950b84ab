"""Gateway settings: the only place environment variables are read.

Every field can be set as `HYPIC_<FIELD>` in the environment or in a `.env` file in the working
directory (environment wins), e.g. `HYPIC_PORT=9000`, `HYPIC_API_KEY=secret`; an empty variable counts as
unset and `none` sets an optional field to None. Paths are relative to the working directory. Invalid values fail at startup with the
field named.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, PrivateAttr, SecretStr, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from hypic_core.config import DEFAULT_SEAM, Mode
from hypic_core.errors import InvalidRequestError

DEFAULT_INDEX_DIR = "data/index"
DEMO_CORPUS_PATH = "data/demo_corpus.jsonl"


class Settings(BaseSettings):
    """Configuration of one gateway process."""

    model_config = SettingsConfigDict(env_prefix="HYPIC_", env_file=".env", env_file_encoding="utf-8", extra="ignore",
                                      env_ignore_empty=True, env_parse_none_str="none")

    # model
    model: str = Field("hypic-tiny", description="A named model (`hypic models`), a checkpoint directory, a .gguf file, "
                       "or a hub id in the local Hugging Face cache.")
    model_path: str | None = Field(None, description="Former name of `model` (HYPIC_MODEL_PATH), still read when `model` is unset.")
    model_name: str | None = Field(None, description="Name served on /v1/models; default: the named model, directory or file name.")
    models_dir: Path | None = Field(None, description="Where converted (.gguf) models are kept; default ~/.cache/hypic/models.")
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto", description="Weights and activations; auto: float32 on CPU, the checkpoint's dtype (else bfloat16) on CUDA.")

    # prompt (unset: the named model's own layout, else the generic one for the format; app/service/prompter.py)
    prompt_format: Literal["auto", "chat", "raw"] = Field("auto", description="chat: the tokenizer's chat template; raw: the "
                                                          "templates below as given; auto: chat when the tokenizer has a template.")
    system_prompt: str | None = Field(None, description="System message (chat) or the text the prompt starts with (raw).")
    document_template: str | None = Field(None, description="How a retrieved chunk is written into the prompt ({text}, {title}).")
    question_template: str | None = Field(None, description="How a /query question is written into the prompt ({question}).")
    answer_prefix: str | None = Field(None, description="Text after the question (raw) or after the generation prompt (chat).")
    answer_reserve_tokens: int = Field(256, ge=1, description="Context kept for the answer when fitting retrieved chunks to a "
                                       "request without max_tokens.")
    # Default: torch's (one per core), for a machine the gateway has to itself: a 1k-token
    # SmolLM2 prefill takes 1.8x less time with 2 threads than 1 on 2 cores (docs/benchmarks.md).
    # On a machine shared with other work set 1: spinning intra-op threads made the bundled
    # model's prefill 7-100x slower there (docs/api.md).
    torch_threads: int | None = Field(None, ge=1, description="torch intra-op threads; None: torch's default (one per "
                                      "core); 1 on a machine shared with other work.")

    # retrieval
    index_dir: Path = Path(DEFAULT_INDEX_DIR)
    corpus_path: Path | None = Field(Path(DEMO_CORPUS_PATH), description="Ingested at startup when the index is empty. The demo corpus "
                                     "(this default) only goes into the default index_dir, never into an index you point the gateway at; "
                                     "a corpus_path you set goes into any empty index. none: never ingest at startup.")
    chunk_tokens: int | None = Field(None, ge=8, description="Chunk size (serving-model tokens) for documents added through the API; "
                                     "default: min(384, a quarter of the model's context). Chunks may reach 4/3 of it.")
    embedder: str = Field("minilm", description="minilm, hashing, hashing-<dim>, or a model directory.")
    default_top_k: int = Field(4, ge=1)
    max_top_k: int = Field(32, ge=1)

    # engine and cache
    seam: int = Field(DEFAULT_SEAM, ge=0)
    default_mode: str = Mode.HYPIC.value
    device: str = Field("cpu", pattern=r"^(cpu|cuda(:\d+)?)$", description="Where the model runs: cpu or cuda[:N].")
    cache_device_bytes: int = Field(0, ge=0, description="Hot tier of the segment cache in the model's device memory (GPU only).")
    cache_memory_bytes: int = Field(2 << 30, ge=0, description="Host-memory tier of the segment cache.")
    cache_dir: Path | None = Field(None, description="Disk tier of the segment cache. Unset: a 'cache' directory beside index_dir "
                                   "(data/cache by default); none: no disk tier, memory only.")
    cache_disk_bytes: int = Field(16 << 30, ge=0)
    cache_storage_dtype: str = Field("auto", description="Disk-tier entries: auto (as computed: K/V in the model's dtype, "
                                     "T and E fp32) or bf16 (narrowed); fp32, a former name of auto, is still read.")
    exact_runs_bytes: int = Field(512 << 20, ge=0, description="Exact snapshots of leading segment runs (system "
                                  "prompt, earlier turns, repeated documents, prefix mode).")
    prefix_cache_bytes: int | None = Field(None, ge=0, description="Former name of `exact_runs_bytes` "
                                           "(HYPIC_PREFIX_CACHE_BYTES), still read when that is unset.")
    exact_repeats: bool = Field(True, description="Documents an earlier request had in the same order (after the system "
                                "prompt) are computed exactly once and then reused exactly (counted in cached_tokens); "
                                "false: they always compose.")
    repeats: Literal["cheaper", "exact"] = Field("cheaper", description="With exact_repeats, documents seen before in "
                                                 "the same order that no exact snapshot holds yet: cheaper (composed "
                                                 "from the stored entries when the cost model puts that below a forward "
                                                 "over them, so no request pays for more than the cheaper of the two; "
                                                 "no snapshot is kept then) or exact (computed in context at their "
                                                 "second sighting and kept, so later repeats are restored and answer as "
                                                 "full prefill does).")
    reuse_key_scale: float = Field(1.0, ge=0.25, le=4.0, description="Stitched documents' reused keys are multiplied by "
                                   "this: a temperature of 1/scale on every later token's attention logits over reused "
                                   "tokens (docs/accuracy.md, rung 4); 1.0: as computed.")
    reuse_key_scope: Literal["prompt", "all"] = Field("prompt", description="Which tokens read the scaled keys: prompt "
                                                       "(the prompt's own; set back to 1x before the answer) or all.")
    recompute_ratio: float = Field(0.0, ge=0.0, le=1.0, description="Query-aware recompute budget: this share of the "
                                   "reused tokens is recomputed in context, as wider seams on the documents nearest the "
                                   "question (docs/accuracy.md, rung 3); 0: seams only, 1: every document in context. A "
                                   "request's `recompute` overrides it.")
    cold_prefill: Literal["auto", "exact", "stitch"] = Field("auto", description="A request whose chunks' cache entries "
                                                             "are missing: auto (one exact forward over the prompt, as full "
                                                             "prefill, when that costs less than computing the entries and "
                                                             "stitching; the entries are then computed after its first token), "
                                                             "exact (so whenever every entry is missing) or stitch (never).")
    decode_step: Literal["lean", "lean-packed", "module"] = Field("lean", description="The batched decode forward: lean "
                                                   "(one forward written for one token per sequence: fused weights, "
                                                   "closed-form linear-layer updates; llama, qwen3, qwen3_5, qwen3_next "
                                                   "and bamba models, others keep module), lean-packed (the same on a second, "
                                                   "oneDNN-packed copy of the weights: faster with several streams on "
                                                   "AVX2 CPUs) or module (the transformers modules, the reference).")
    decode_kernel: Literal["native", "torch", "native-f16", "native-i8"] = Field("native", description="The lean decode step's "
                                                                     "kernels: native (AVX2 kernels built once with "
                                                                     "the C++ compiler, on the fp32 weights, for the "
                                                                     "matmuls and the step's norms, attention and "
                                                                     "Mamba2 mixers: exact up to summation order, "
                                                                     "faster than torch's at 1-8 streams on AVX2 CPUs; "
                                                                     "without a compiler or AVX2, or for a model not "
                                                                     "fp32 on the CPU, torch's run and a warning says "
                                                                     "why), torch (torch's kernels), native-f16 (the "
                                                                     "native kernels on an fp16 copy of the weights: "
                                                                     "half the bytes, logits no longer exact) or "
                                                                     "native-i8 (on a per-row int8 copy: a quarter of "
                                                                     "the bytes, lossier; docs/accuracy.md measures "
                                                                     "both).")
    speculation: bool = Field(True, description="Speculative decoding: each running answer drafts its next tokens from "
                              "its own prompt (n-gram lookup) and the decode forward verifies them, so text copied from "
                              "the documents comes several tokens a step; greedy answers are unchanged. Runs with "
                              "decode_step lean; a request's `speculation` field overrides.")
    scheduling: Literal["fcfs", "priority"] = Field("fcfs", description="Order in which waiting requests are admitted: "
                                                    "fcfs (arrival) or priority (a request's priority, then arrival).")
    prefill_workers: int = Field(0, ge=0, description="Model replicas computing cold chunks' cache entries in parallel "
                                 "(each loads the model); 0: the engine computes them itself.")
    prefill_backend: Literal["processes", "ray"] = Field("processes", description="Where prefill workers run: local "
                                                         "processes, or Ray actors (the `ray` extra).")
    prefill_worker_threads: int | None = Field(None, ge=1, description="torch threads per prefill worker; default: "
                                               "the machine's cores divided by prefill_workers (at least 1).")
    prefill_split_tokens: int = Field(0, ge=0, description="With prefill workers: a cold chunk longer than this is split "
                                      "into pieces computed on different workers and joined (an approximation: attention "
                                      "inside a piece does not see the pieces before it); 0: off. At least 64 when set.")

    # shared segment-cache tier (hypic_core/cache/redis_tier.py; docs/deploy-redis.md)
    redis_url: SecretStr | None = Field(None, description="Redis server that gateway replicas share segment entries through "
                                        "(redis://[user:password@]host:port/db, rediss://..., unix:///path); unset: no Redis tier.")
    redis_max_bytes: int = Field(4 << 30, ge=0, description="Entry bytes all gateways sharing redis_url and redis_prefix may hold "
                                 "together there; least recently used entries are removed past it.")
    redis_ttl_s: int = Field(7 * 24 * 3600, ge=0, description="An entry unused this many seconds expires from Redis; 0: never.")
    redis_prefix: str = Field("hypic:", min_length=1, description="Prefix of every key the tier writes; gateways with the same "
                              "prefix share entries and one redis_max_bytes budget.")
    redis_timeout_s: float = Field(0.5, gt=0, description="Connect and per-call socket timeout: the longest a lookup waits for "
                                   "Redis before serving without it.")
    cache_secret: SecretStr | None = Field(None, description="The deployment's secret, the same on every replica: the key of "
                                           "the HMAC that signs each entry in the shared (Redis) tier, so that whoever can "
                                           "write to Redis cannot plant one. Required with redis_url; use 32 random bytes "
                                           "or more (openssl rand -hex 32).")

    # online accuracy guard of the served model (app/service/guard.py; docs/architecture.md)
    guard_enabled: bool = Field(True, description="Shadow-check approximate reuse against full prefill and widen the seam "
                                "or fall back to prefix when agreement drops.")
    guard_sample_rate: float = Field(0.05, ge=0.0, le=1.0, description="Share of admitted requests shadow-checked (when the engine is idle).")
    guard_greedy_sample: float = Field(0.2, ge=0.0, le=1.0, description="Share of checks that also compare the first greedy tokens.")
    guard_greedy_tokens: int = Field(8, ge=1, description="Greedy tokens compared by such a check.")
    guard_window: int = Field(50, ge=1, description="Checks kept per (mode, seam) for the rolling agreement.")
    guard_min_checks: int = Field(20, ge=1, description="Checks in a window before the guard acts on it (<= guard_window).")
    guard_min_agreement: float = Field(0.9, ge=0.0, le=1.0, description="Rolling top-1 agreement below which the guard acts.")
    guard_max_seam: int = Field(64, ge=0, description="Widest seam the guard widens to before it switches to prefix.")
    guard_max_recompute: float = Field(0.2, ge=0.0, le=1.0, description="Largest recompute budget the guard widens to (each "
                                       "widening doubles the seam and the budget, from 0.05) before it switches to prefix; "
                                       "0: the guard widens the seam alone.")
    guard_queue_size: int = Field(64, ge=1, description="Checks waiting for an idle engine; a full queue drops its oldest.")
    guard_dense_checks: int = Field(20, ge=0, description="Checks taken from every request (not sampled) after start, after "
                                    "documents are added and after each widening, before guard_sample_rate applies; 0: always sampled.")
    max_new_tokens: int = Field(1024, ge=1, description="Upper bound on max_tokens of any request.")

    # admission and limits
    max_running: int = Field(8, ge=1, description="Generations prefilling or decoding at once; running ones advance in one batched forward per step.")
    max_step_tokens: int = Field(512, ge=1, description="Model tokens per engine step (decode tokens + a chunk of prefill): "
                                 "a long prompt is prefilled over several steps so running streams keep producing tokens.")
    running_budget_bytes: int = Field(4 << 30, ge=1, description="Attention K/V + linear state the running generations may hold; "
                                      "a request that does not fit waits.")
    max_queue: int = Field(16, ge=0, description="Admitted requests waiting for a running slot; beyond this: 429.")
    retry_after_s: int = Field(1, ge=1, description="Retry-After sent with 429 and with 503 while loading.")
    max_body_bytes: int = Field(8 << 20, ge=1)
    # Checked before anything is tokenized (on a thread): text costs ~0.6 s per MB to tokenize.
    max_text_bytes: int = Field(1 << 20, ge=1, description="UTF-8 bytes of text one request asks to tokenize: the question "
                                "or prompt, message contents and segments together (a /search query alone); beyond: 400 "
                                "naming the field where the total passes it, before anything is tokenized.")
    max_messages: int = Field(1024, ge=1, description="Messages in one chat request; beyond: 400 naming messages.")
    max_segments: int = Field(256, ge=1, description="Entries of `segments` in one request; beyond: 400 naming segments.")
    max_document_ids: int = Field(1024, ge=1, description="Entries of `document_ids` in one request; beyond: 400 naming "
                                  "document_ids (500,000 of them took 2.7 s of retrieval).")
    max_stop_strings: int = Field(16, ge=0, description="Stop strings in one request; beyond: 400 naming stop.")
    max_stop_bytes: int = Field(1024, ge=0, description="UTF-8 bytes of a request's stop strings together; beyond: 400 naming stop.")
    api_key: SecretStr | None = Field(None, description="When set, requests need 'Authorization: Bearer <key>'; the key "
                                      "opens the tenant 'default' (its documents are the index in index_dir).")
    # tenants (app/service/tenants.py; docs/deploy.md, "Teams")
    api_keys: SecretStr | None = Field(None, description='API keys and the tenant each opens, as JSON: {"<key>": "<tenant>", ...}; '
                                       "a tenant name is 1-63 of a-z 0-9 _ - (starting with a letter or digit), several keys "
                                       "may open one tenant. Beside api_key, which opens 'default'.")
    api_keys_file: Path | None = Field(None, description="A JSON file of the same shape as api_keys, read at startup.")
    collections_dir: Path | None = Field(None, description="Where tenants' collections of documents are kept (one index "
                                         "directory each); unset: a 'collections' directory beside index_dir.")
    shared_collections: dict[str, list[str]] = Field({}, description='Collections every tenant reads, with the tenants that may '
                                                     'write them: {"<collection>": ["<tenant>", ...]}. Their chunks\' cache '
                                                     "entries are shared by every tenant.")
    tenant_max_documents: int = Field(0, ge=0, description="Documents one tenant may keep in its collections; beyond: 429. 0: no limit.")
    tenant_max_bytes: int = Field(0, ge=0, description="UTF-8 bytes of chunk text one tenant may keep in its collections; "
                                  "beyond: 429. 0: no limit.")
    tenant_max_requests: int = Field(0, ge=0, description="Requests one tenant may have in flight at once (the probes "
                                     "excepted); beyond: 429 with Retry-After. 0: no limit.")
    _tenant_keys: dict[str, str] = PrivateAttr(default_factory=dict)
    cors_origins: list[str] = Field([], description='Browser origins allowed to call the API, e.g. ["http://localhost:3000"].')

    # server
    host: str = "127.0.0.1"
    port: int = Field(8000, ge=0, le=65535)
    log_level: Literal["debug", "info", "warning", "error"] = "info"

    # connections and browsers (docs/api.md, "Limits and browsers")
    allowed_hosts: list[str] | None = Field(None, description='Host header names served, e.g. ["api.example.com", "*.example.com"]; '
                                            '["*"]: any. Unset: localhost names when bound to a loopback address, also the bound '
                                            'name when bound to one, any when bound to all interfaces (0.0.0.0, ::). localhost, '
                                            '127.0.0.1 and [::1] are always allowed, and the probes answer any host.')
    keep_alive_timeout_s: float = Field(5.0, gt=0, description="An idle connection is closed this long after its last response.")
    header_timeout_s: float = Field(10.0, gt=0, description="A request's head must arrive within this long of the connection's "
                                    "start or the previous response's end, else 408 and the connection is closed.")
    body_timeout_s: float = Field(30.0, gt=0, description="A request body that stops arriving for this long gets a 408.")
    body_deadline_s: float = Field(120.0, gt=0, description="A request body not complete this long after its head arrived "
                                   "gets a 408 (a body trickling in a byte now and then never trips body_timeout_s).")
    max_headers: int = Field(100, ge=1, description="Header fields per request; beyond: 431.")
    max_header_bytes: int = Field(16 << 10, ge=1024, description="Bytes of header fields per request; beyond: 431 (or 400 "
                                  "from uvicorn for a head arriving in pieces).")
    sse_keepalive_s: float = Field(15.0, gt=0, description="A stream that has nothing to send for this long sends a "
                                   "': keep-alive' comment, so proxies do not close it.")

    @property
    def trusted_hosts(self) -> list[str]:
        """The Host names served (`allowed_hosts` resolved): ["*"] or a list with the loopback names."""
        loopback = ["localhost", "127.0.0.1", "[::1]"]
        if self.allowed_hosts is not None:
            return ["*"] if "*" in self.allowed_hosts else [*self.allowed_hosts, *loopback]
        if self.host in ("0.0.0.0", "::", ""):  # all interfaces: a compose service name, a LAN address, ...
            return ["*"]
        bound = f"[{self.host}]" if ":" in self.host and not self.host.startswith("[") else self.host
        return list(dict.fromkeys([*loopback, bound]))

    # several replicas on Ray Serve (`hypic serve-ray`; docs/deploy-ray.md)
    ray_address: str | None = Field(None, description="Ray cluster to join (`auto`: the one `ray start` began on this "
                                    "machine; `ray://host:10001`: a remote one); unset: start a local Ray instance. Used by `hypic serve-ray` "
                                    "and by prefill_backend=ray.")
    ray_replicas: int = Field(2, ge=1, description="Gateway replicas (each loads the model and keeps its own cache tiers).")
    ray_router: Literal["chunk", "pow2"] = Field("chunk", description="chunk: to the replica holding most of a request's "
                                                 "chunks, within ray_load_bound; pow2: Ray's power-of-two choices.")
    ray_load_bound: int = Field(2, ge=0, description="A chunk holder is chosen only while its ongoing requests exceed the "
                                "least-loaded replica's by at most this; beyond: the least-loaded replica.")
    ray_directory_keys: int = Field(100_000, ge=1, description="Chunk keys the router remembers (least recently routed dropped).")
    ray_replica_cpus: float = Field(1.0, ge=0, description="CPUs Ray reserves per gateway replica.")
    ray_replica_gpus: float | None = Field(None, ge=0, description="GPUs per replica; unset: 1 when device is cuda, else 0.")
    ray_ingress_replicas: int = Field(1, ge=1, description="Ingress replicas (each keeps its own chunk directory).")
    ray_health_check_s: float = Field(10.0, gt=0, description="How often Serve checks each replica; one whose model failed "
                                      "to load (with exit_on_load_failure) or whose engine thread died is replaced.")
    ray_max_ongoing_requests: int | None = Field(None, ge=1, description="Requests Ray sends one replica at once; "
                                                 "unset: max_running + max_queue. More wait in the ingress.")

    # startup failures
    exit_on_load_failure: bool = Field(True, description="When loading the model or index fails, `hypic serve` exits non-zero "
                                       "with the reason, so a supervisor (Compose's restart policy) sees it; false: stay up, "
                                       "/ready answering 503 with the reason.")

    @model_validator(mode="after")
    def _cache_beside_index(self) -> "Settings":
        # Unset (not even "none"): the disk tier lives beside the index, so an index pointed
        # elsewhere (a test's tmp dir) takes its cache along instead of writing into data/.
        if "cache_dir" not in self.model_fields_set:
            self.cache_dir = self.index_dir.parent / "cache"
        return self

    @field_validator("default_mode")
    @classmethod
    def _known_mode(cls, value: str) -> str:
        try:
            return Mode.parse(value).value
        except InvalidRequestError as exc:
            raise ValueError(exc.message) from None

    @field_validator("prefill_split_tokens")
    @classmethod
    def _split_pieces(cls, value: int) -> int:
        if 0 < value < 64:
            raise ValueError(f"must be 0 (off) or >= 64, got {value}")
        return value

    @model_validator(mode="after")
    def _guard_window(self) -> "Settings":
        if self.guard_min_checks > self.guard_window:
            raise ValueError(f"guard_min_checks ({self.guard_min_checks}) must be <= guard_window ({self.guard_window})")
        return self

    @model_validator(mode="after")
    def _former_model_path(self) -> "Settings":
        if self.model_path is not None and "model" not in self.model_fields_set:
            self.model = self.model_path
        return self

    @model_validator(mode="after")
    def _former_prefix_cache_bytes(self) -> "Settings":
        if self.prefix_cache_bytes is not None and "exact_runs_bytes" not in self.model_fields_set:
            self.exact_runs_bytes = self.prefix_cache_bytes
        return self

    @field_validator("document_template")
    @classmethod
    def _document_template(cls, value: str | None) -> str | None:
        from .prompter import check_template

        return None if value is None else check_template(value, {"text", "title"}, "text")

    @field_validator("question_template")
    @classmethod
    def _question_template(cls, value: str | None) -> str | None:
        from .prompter import check_template

        return None if value is None else check_template(value, {"question"}, "question")

    @field_validator("cache_storage_dtype")
    @classmethod
    def _known_dtype(cls, value: str) -> str:
        from hypic_core.cache import STORAGE_DTYPES

        value = "auto" if value == "fp32" else value
        if value not in STORAGE_DTYPES:
            raise ValueError(f"expected one of {', '.join(STORAGE_DTYPES)}, got {value!r}")
        return value

    @field_validator("redis_url")
    @classmethod
    def _redis_url(cls, value: SecretStr | None) -> SecretStr | None:
        if value is None or not value.get_secret_value():
            return None
        if not value.get_secret_value().startswith(("redis://", "rediss://", "unix://")):
            raise ValueError("expected a redis://, rediss:// or unix:// URL")
        return value

    @model_validator(mode="after")
    def _shared_tier_is_signed(self) -> "Settings":
        if self.cache_secret is not None and not self.cache_secret.get_secret_value():
            self.cache_secret = None
        if self.redis_url is not None and self.cache_secret is None:
            raise ValueError("HYPIC_REDIS_URL (a shared cache tier) needs HYPIC_CACHE_SECRET, the secret that signs its "
                             "entries, the same on every replica (docs/deploy-redis.md)")
        return self

    @field_validator("api_key")
    @classmethod
    def _blank_key_is_none(cls, value: SecretStr | None) -> SecretStr | None:
        return value if value is not None and value.get_secret_value() else None

    @model_validator(mode="after")
    def _tenant_keys_read(self) -> "Settings":
        from .tenants import DEFAULT_TENANT, check_collection_name, parse_keys

        keys: dict[str, str] = {}
        sources = [("api_key", {self.api_key.get_secret_value(): DEFAULT_TENANT} if self.api_key is not None else {})]
        if self.api_keys is not None and self.api_keys.get_secret_value().strip():
            sources.append(("api_keys", parse_keys(self.api_keys.get_secret_value(), "api_keys")))
        if self.api_keys_file is not None:
            try:
                text = self.api_keys_file.read_text(encoding="utf-8")
            except (OSError, UnicodeDecodeError) as exc:
                raise ValueError(f"api_keys_file: cannot read {self.api_keys_file}: {exc}") from None
            sources.append(("api_keys_file", parse_keys(text, "api_keys_file")))
        for name, found in sources:
            for key, tenant in found.items():
                if keys.get(key, tenant) != tenant:
                    raise ValueError(f"{name}: a key opens two tenants ({keys[key]!r} and {tenant!r})")
                keys[key] = tenant
        self._tenant_keys = keys
        for collection, writers in self.shared_collections.items():
            check_collection_name(collection, "shared_collections")
            for tenant in writers:
                parse_keys({"-": tenant}, "shared_collections")
        return self

    @property
    def tenant_keys(self) -> dict[str, str]:
        """Every API key and the tenant it opens (api_key, api_keys, api_keys_file); empty: no key needed."""
        return dict(self._tenant_keys)

    @property
    def collections_root(self) -> Path:
        """`collections_dir`, or 'collections' beside index_dir when unset."""
        return self.collections_dir if self.collections_dir is not None else self.index_dir.parent / "collections"

    @property
    def served_model_name(self) -> str:
        from hypic_core.models.registry import served_name

        return self.model_name or served_name(self.model)

    def prompt_layout(self, tokenizer, known_prompt: dict[str, str] | None = None):
        """The prompt layout: these settings where set, else the named model's, else the generic one."""
        from .prompter import GENERIC, PromptLayout

        fmt = self.prompt_format
        if fmt == "auto":
            fmt = "chat" if getattr(tokenizer, "chat_template", None) else "raw"
        base = GENERIC[fmt].__dict__ | (known_prompt or {})
        chosen = {name: getattr(self, name) for name in ("system_prompt", "document_template", "question_template", "answer_prefix")}
        return PromptLayout(**(base | {k: v for k, v in chosen.items() if v is not None} | {"format": fmt}))
