"""The online accuracy guard: shadow checks of approximate reuse against full prefill, and the policy
that widens the seam and recompute budget, or falls back to exact reuse, when reused answers stop
agreeing with full prefill's (first tokens, and whole answers against the model's release faithfulness).

- `policy.py`: the decisions, pure (configurations, windows, the faithfulness estimate, the ladder);
- `checks.py`: a check as engine requests, and the comparison of their outputs;
- `metrics.py`: the Prometheus series;
- `release.py`: the model card's release measurement (the default faithfulness threshold);
- `guard.py`: `Guard`, which queues checks, runs them while the engine is idle and drives the policy.
"""

from .checks import CHECK_PRIORITY, InFlight, ShadowCheck, check_requests, compare, run_check
from .guard import Guard
from .metrics import GuardMetrics
from .policy import (EXACT_MODES, FIRST_RECOMPUTE, Action, CheckResult, Choice, GuardConfig, GuardPolicy, GuardState, Interval,
                     Release, Window, exact_mode, wilson_interval)
from .release import load_release, release_for

__all__ = ["Action", "CHECK_PRIORITY", "CheckResult", "Choice", "EXACT_MODES", "FIRST_RECOMPUTE", "Guard", "GuardConfig",
           "GuardMetrics", "GuardPolicy", "GuardState", "InFlight", "Interval", "Release", "ShadowCheck", "Window",
           "check_requests", "compare", "exact_mode", "load_release", "release_for", "run_check", "wilson_interval"]
