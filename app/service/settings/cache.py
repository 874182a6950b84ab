"""The segment cache's tiers: device, host memory, disk, exact runs and the shared Redis tier (hypic_core/cache/redis_tier.py; docs/deploy-redis.md)."""

from __future__ import annotations

from pathlib import Path

from pydantic import Field, SecretStr, field_validator, model_validator

from .base import AreaSettings


class CacheSettings(AreaSettings):
    """Sizes and places of the segment cache's tiers."""

    cache_device_bytes: int = Field(0, ge=0, description="Hot tier of the segment cache in the model's device memory (GPU only).")
    cache_memory_bytes: int = Field(2 << 30, ge=0, description="Host-memory tier of the segment cache.")
    cache_dir: Path | None = Field(None, description="Disk tier of the segment cache. Unset: a 'cache' directory beside index_dir "
                                   "(data/cache by default); none: no disk tier, memory only.")
    cache_disk_bytes: int = Field(16 << 30, ge=0, description="Disk tier of the segment cache; least recently used entries "
                                  "are removed past it.")
    cache_storage_dtype: str = Field("auto", description="Disk-tier entries: auto (as computed: K/V in the model's dtype, "
                                     "T and E fp32) or bf16 (narrowed); fp32, a former name of auto, is still read.")
    exact_runs_bytes: int = Field(512 << 20, ge=0, description="Exact snapshots of leading segment runs (system "
                                  "prompt, earlier turns, repeated documents, prefix mode).")
    prefix_cache_bytes: int | None = Field(None, ge=0, description="Former name of `exact_runs_bytes` "
                                           "(HYPIC_PREFIX_CACHE_BYTES), still read when that is unset.")

    redis_url: SecretStr | None = Field(None, description="Redis server that gateway replicas share segment entries through "
                                        "(redis://[user:password@]host:port/db, rediss://..., unix:///path); unset: no Redis tier.")
    redis_max_bytes: int = Field(4 << 30, ge=0, description="Entry bytes all gateways sharing redis_url and redis_prefix may hold "
                                 "together there; least recently used entries are removed past it.")
    redis_ttl_s: int = Field(7 * 24 * 3600, ge=0, description="An entry unused this many seconds expires from Redis; 0: never.")
    redis_prefix: str = Field("hypic:", min_length=1, description="Prefix of every key the tier writes; gateways with the same "
                              "prefix share entries and one redis_max_bytes budget.")
    redis_timeout_s: float = Field(0.5, gt=0, description="Connect and per-call socket timeout: the longest one Redis call "
                                   "waits before the tier is counted down and skipped.")
    lookup_deadline_s: float = Field(1.0, gt=0, description="The longest an arriving request waits for its disk and Redis "
                                     "lookups (they run off the engine thread, in parallel); what has not returned by then "
                                     "is computed for it, and kept in memory for the next request when it returns.")
    cache_secret: SecretStr | None = Field(None, description="The deployment's secret, the same on every replica: the key of "
                                           "the HMAC that signs each entry in the shared (Redis) tier, so that whoever can "
                                           "write to Redis cannot plant one. Required with redis_url; use 32 random bytes "
                                           "or more (openssl rand -hex 32).")

    @model_validator(mode="after")
    def _former_prefix_cache_bytes(self) -> "CacheSettings":
        if self.prefix_cache_bytes is not None and "exact_runs_bytes" not in self.model_fields_set:
            self.exact_runs_bytes = self.prefix_cache_bytes
        return self


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
    def _shared_tier_is_signed(self) -> "CacheSettings":
        if self.cache_secret is not None and not self.cache_secret.get_secret_value():
            self.cache_secret = None
        if self.redis_url is not None and self.cache_secret is None:
            raise ValueError("HYPIC_REDIS_URL (a shared cache tier) needs HYPIC_CACHE_SECRET, the secret that signs its "
                             "entries, the same on every replica (docs/deploy-redis.md)")
        return self
