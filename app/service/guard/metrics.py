"""The guard's Prometheus series (one served model's), written as checks are recorded and the policy acts."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from .policy import CheckResult, GuardState, Interval, Window, Choice

KL_BUCKETS = (1e-6, 1e-5, 1e-4, 1e-3, 0.01, 0.03, 0.1, 0.3, 1.0, 3.0, 10.0)
STATE_VALUE = {GuardState.OK: 0, GuardState.WIDENED: 1, GuardState.EXACT: 2}


class GuardMetrics:
    def __init__(self, registry: CollectorRegistry, model: str) -> None:
        r, labels = registry, ["model", "mode", "seam", "recompute"]
        self.model = model
        self.checks = Counter("hypic_guard_checks", "Shadow checks run against full prefill, by configuration.",
                              labels, registry=r)
        self.kl = Histogram("hypic_guard_kl", "KL(full || served) of the first-token distributions, nats.",
                            labels, buckets=KL_BUCKETS, registry=r)
        self.top1 = Gauge("hypic_guard_top1_agreement", "Rolling top-1 first-token agreement with full prefill.",
                          labels, registry=r)
        self.greedy = Gauge("hypic_guard_greedy_agreement", "Rolling share of answer checks whose first "
                            "N greedy tokens (HYPIC_GUARD_ANSWER_TOKENS) equal full prefill's.", labels, registry=r)
        model_only = ["model"]
        self.faithfulness = Gauge("hypic_guard_faithfulness", "The served model's faithfulness estimate: the rolling "
                                  "share of identical N-token answers of the base configuration.", model_only, registry=r).labels(model)
        self.faithfulness_low = Gauge("hypic_guard_faithfulness_low", "Lower end of the faithfulness estimate's Wilson "
                                      "95% interval.", model_only, registry=r).labels(model)
        self.faithfulness_high = Gauge("hypic_guard_faithfulness_high", "Upper end of the faithfulness estimate's Wilson "
                                       "95% interval (the guard acts when it falls below the threshold).", model_only,
                                       registry=r).labels(model)
        self.threshold = Gauge("hypic_guard_faithfulness_threshold", "The faithfulness threshold: the operator's "
                               "HYPIC_GUARD_MIN_FAITHFULNESS, else the model's release measurement; -1 when neither is known.",
                               model_only, registry=r).labels(model)
        self.dropped = Counter("hypic_guard_dropped_checks", "Shadow checks dropped (the queue was full).",
                               model_only, registry=r).labels(model)
        self.errors = Counter("hypic_guard_check_errors", "Shadow checks that failed.", model_only, registry=r).labels(model)
        self.pending = Gauge("hypic_guard_pending_checks", "Shadow checks waiting for an idle engine.",
                             model_only, registry=r).labels(model)
        self.state = Gauge("hypic_guard_state", "What default-mode requests get: 0 ok (as configured), 1 widened "
                           "seam and recompute budget, 2 exact (prefix).", model_only, registry=r).labels(model)
        self.seam = Gauge("hypic_guard_seam", "Seam default-mode requests get.", model_only, registry=r).labels(model)
        self.recompute = Gauge("hypic_guard_recompute", "Recompute budget default-mode requests get.", model_only,
                               registry=r).labels(model)

    def observe(self, result: CheckResult, window: Window) -> None:
        labels = (self.model, result.choice.mode.value, str(result.choice.seam), f"{result.choice.recompute:g}")
        self.checks.labels(*labels).inc()
        self.kl.labels(*labels).observe(result.kl)
        self.top1.labels(*labels).set(window.top1_agreement)
        if window.greedy_agreement is not None:
            self.greedy.labels(*labels).set(window.greedy_agreement)

    def faithful(self, estimate: Interval | None, threshold: float | None) -> None:
        """The base configuration's faithfulness estimate (left as it was while none is known) and the threshold."""
        self.threshold.set(-1.0 if threshold is None else threshold)
        if estimate is not None:
            self.faithfulness.set(estimate.estimate)
            self.faithfulness_low.set(estimate.low)
            self.faithfulness_high.set(estimate.high)

    def serving(self, state: GuardState, choice: Choice) -> None:
        self.state.set(STATE_VALUE[state])
        self.seam.set(choice.seam)
        self.recompute.set(choice.recompute)
