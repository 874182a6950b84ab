"""The engine: how prompts are prefilled (reuse, seams, recompute), decoded and scheduled."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator

from hypic_core.config import DEFAULT_SEAM, Mode
from hypic_core.errors import InvalidRequestError

from .base import AreaSettings


class EngineSettings(AreaSettings):
    """How the engine reuses cached segments, prefills, decodes and schedules."""

    seam: int = Field(DEFAULT_SEAM, ge=0, description="Tokens at the start of each reused document recomputed in "
                      "context (the seam); a request's `seam` overrides it.")
    default_mode: str = Field(Mode.HYPIC.value, description="Prefill mode of a request that names none: hypic (reuse "
                              "cached segments, seams recomputed), prefix (reuse exact leading runs only) or full.")
    device: str = Field("cpu", pattern=r"^(cpu|cuda(:\d+)?)$", description="Where the model runs: cpu or cuda[:N].")
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
    entry_batching: Literal["padded", "alone"] = Field("padded", description="How missing chunks' cache entries are "
                                                       "computed: padded (together in padded batches, fastest) or alone (one "
                                                       "forward each, ~2.5x the time measured on the hybrid: an entry's bytes, "
                                                       "and so greedy answers, then do not depend on which chunks missed "
                                                       "together, i.e. on timing).")
    decode_step: Literal["lean", "module"] = Field("lean", description="The batched decode forward: lean "
                                                   "(one forward written for one token per sequence: fused weights, "
                                                   "closed-form linear-layer updates; llama, qwen3, qwen3_5, qwen3_next "
                                                   "and bamba models, others keep module) or module (the transformers "
                                                   "modules, the reference). The former lean-packed was measured and "
                                                   "removed; that value is refused.")
    decode_kernel: Literal["native", "torch", "native-f16", "native-bf16", "native-i8", "native-q8"] = Field("native", description="The lean decode step's "
                                                                     "kernels: native (the CPU's best ISA variant "
                                                                     "(avx512bf16, avx512, avx2, generic) of kernels built once "
                                                                     "with the C++ compiler or ahead of time, checked "
                                                                     "before they load, on the fp32 weights, for the "
                                                                     "matmuls and the step's norms, attention and "
                                                                     "Mamba2 mixers: exact up to summation order, "
                                                                     "faster than torch's at 1-8 streams; without a "
                                                                     "compiler or a prebuilt library, or for a model "
                                                                     "not fp32 on the CPU, torch's run and a warning "
                                                                     "says why; /health shows which), torch (torch's "
                                                                     "kernels), native-f16 / native-bf16 (the native "
                                                                     "kernels on an fp16 / bf16 copy of the weights: "
                                                                     "half the bytes, logits no longer exact) or "
                                                                     "native-i8 / native-q8 (on an int8 copy with one "
                                                                     "scale per row / per 32 weights of a row: a "
                                                                     "quarter of the bytes, lossier; docs/accuracy.md "
                                                                     "measures each).")
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
