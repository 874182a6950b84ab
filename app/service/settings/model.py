"""The model served: which one, its dtype and torch's threads."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, model_validator

from .base import AreaSettings

# The model `hypic serve` and scripts/serve serve when none is named: the real-language hybrid with
# its shipped reuse adapter (training/reuse/) merged on load; "smollm2-hybrid-135m" is it untuned.
DEFAULT_MODEL = "smollm2-hybrid-135m-reuse"


class ModelSettings(AreaSettings):
    """Which model the gateway serves and how it runs."""

    model: str = Field(DEFAULT_MODEL, description="A named model (`hypic models`), a checkpoint directory, a .gguf file, "
                       "or a hub id in the local Hugging Face cache. Default: smollm2-hybrid-135m-reuse, the real-language "
                       "hybrid tuned so that reuse keeps full's answers (smollm2-hybrid-135m: untuned); hypic-tiny is "
                       "the test suite's toy model.")
    model_path: str | None = Field(None, description="Former name of `model` (HYPIC_MODEL_PATH), still read when `model` is unset.")
    model_name: str | None = Field(None, description="Name served on /v1/models; default: the named model, directory or file name.")
    models_dir: Path | None = Field(None, description="Where converted (.gguf) models are kept; default ~/.cache/hypic/models.")
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto", description="Weights and activations; auto: float32 on CPU, the checkpoint's dtype (else bfloat16) on CUDA.")
    # Default: torch's (one per core), for a machine the gateway has to itself: a 1k-token
    # SmolLM2 prefill takes 1.8x less time with 2 threads than 1 on 2 cores (docs/benchmarks.md).
    # On a machine shared with other work set 1: spinning intra-op threads made the bundled
    # model's prefill 7-100x slower there (docs/api.md).
    torch_threads: int | None = Field(None, ge=1, description="torch intra-op threads; None: torch's default (one per "
                                      "core); 1 on a machine shared with other work.")

    @model_validator(mode="after")
    def _former_model_path(self) -> "ModelSettings":
        if self.model_path is not None and "model" not in self.model_fields_set:
            self.model = self.model_path
        return self


    @property
    def served_model_name(self) -> str:
        from hypic_core.models.registry import served_name

        return self.model_name or served_name(self.model)
