"""The online accuracy guard of the served model (app/service/guard/; docs/architecture.md)."""

from __future__ import annotations

from pydantic import Field, model_validator

from .base import AreaSettings


class GuardSettings(AreaSettings):
    """Shadow checks of approximate reuse against full prefill, and when the guard acts."""

    guard_enabled: bool = Field(True, description="Shadow-check approximate reuse against full prefill and widen the seam "
                                "or fall back to prefix when agreement drops.")
    guard_sample_rate: float = Field(0.05, ge=0.0, le=1.0, description="Share of admitted requests shadow-checked (when the engine is idle).")
    guard_greedy_sample: float = Field(1.0, ge=0.0, le=1.0, description="Share of checks that compare whole answers (the "
                                       "first guard_answer_tokens greedy tokens); the rest compare the first token only.")
    guard_answer_tokens: int = Field(32, ge=1, description="Greedy tokens an answer check compares with full prefill's; the "
                                     "share of identical answers is the model's faithfulness estimate (/health, /metrics).")
    guard_min_faithfulness: float | None = Field(None, ge=0.0, le=1.0, description="Share of identical answers below which "
                                                 "the guard acts (when the upper end of its 95% interval falls below it); "
                                                 "unset: the faithfulness measured for the model at release, the lower end of its "
                                                 "95% interval (its model card's faithfulness.json, when measured over "
                                                 "guard_answer_tokens tokens).")
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

    @model_validator(mode="after")
    def _guard_window(self) -> "GuardSettings":
        if self.guard_min_checks > self.guard_window:
            raise ValueError(f"guard_min_checks ({self.guard_min_checks}) must be <= guard_window ({self.guard_window})")
        return self
