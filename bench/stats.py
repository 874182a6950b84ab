"""Paired statistics for the accuracy benchmarks: exact McNemar p-values and paired bootstrap intervals.

    from stats import mcnemar_exact, paired_bootstrap_ci

    p = mcnemar_exact(lost=4, gained=0)                # 0.125: four questions lost, none gained
    ci = paired_bootstrap_ci(reuse_kl, full_kl)        # mean(reuse - full) over prompts, 95% interval

Both judge two configurations run on the same prompts. McNemar looks only at the discordant pairs (a
question one configuration answers and the other does not): under "no difference" each of the
`lost + gained` discordant pairs falls either way with probability 1/2, so the two-sided exact p-value
is twice the binomial tail of the smaller count (capped at 1). The bootstrap resamples prompts (pairs
stay together) and reads the percentile interval of the resampled means.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path
from typing import NamedTuple, Sequence

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def mcnemar_exact(lost: int, gained: int) -> float:
    """Two-sided exact McNemar p-value of `lost` and `gained` discordant pairs (1.0 when there are none).
    Raises ValueError for a negative count."""
    if lost < 0 or gained < 0:
        raise ValueError(f"mcnemar_exact: counts must be >= 0, got lost={lost}, gained={gained}")
    n = lost + gained
    if n == 0:
        return 1.0
    tail = sum(math.comb(n, i) for i in range(min(lost, gained) + 1)) / 2 ** n
    return min(1.0, 2.0 * tail)


class Interval(NamedTuple):
    """A statistic and its confidence interval."""

    mean: float
    low: float
    high: float

    def cell(self, fmt: str = ".3f", scale: float = 1.0) -> str:
        """`mean (low-high)` for a markdown table, each times `scale`."""
        return f"{self.mean * scale:{fmt}} ({self.low * scale:{fmt}}-{self.high * scale:{fmt}})"


def paired_bootstrap_ci(a: Sequence[float], b: Sequence[float] | None = None, resamples: int = 2000,
                        level: float = 0.95, seed: int = 0) -> Interval:
    """The mean of `a` (or of `a - b`, pair by pair) with a percentile bootstrap interval over `resamples`
    resamplings of the pairs, drawn from `seed` (the same inputs give the same interval).

    Raises ValueError for empty input, pairs of unequal length, `level` outside (0, 1) or `resamples` < 1."""
    values = _differences(a, b)
    if not 0.0 < level < 1.0:
        raise ValueError(f"paired_bootstrap_ci: level must be in (0, 1), got {level}")
    if resamples < 1:
        raise ValueError(f"paired_bootstrap_ci: resamples must be >= 1, got {resamples}")
    import numpy as np

    x = np.asarray(values, dtype=np.float64)
    idx = np.random.default_rng(seed).integers(0, len(x), size=(resamples, len(x)))
    means = np.sort(x[idx].mean(axis=1))
    lo, hi = _percentile_ranks(resamples, level)
    return Interval(float(x.mean()), float(means[lo]), float(means[hi]))


def paired_bootstrap_ci_reference(a: Sequence[float], b: Sequence[float] | None = None, resamples: int = 2000,
                                  level: float = 0.95, seed: int = 0) -> Interval:
    """`paired_bootstrap_ci` in plain Python, one resample at a time over the same index draws (the test's twin)."""
    import numpy as np

    values = _differences(a, b)
    draws = np.random.default_rng(seed).integers(0, len(values), size=(resamples, len(values))).tolist()
    means = sorted(math.fsum(values[i] for i in row) / len(values) for row in draws)
    lo, hi = _percentile_ranks(resamples, level)
    return Interval(math.fsum(values) / len(values), means[lo], means[hi])


def wilson_interval(successes: int, n: int, z: float = 1.96) -> Interval:
    """A share `successes / n` with its Wilson score interval (fractions, not percent): the accuracy guard's
    (app/service/guard/policy.py), so the benchmark and the gate judge a share alike. Raises ValueError for n < 1."""
    from app.service.guard.policy import wilson_interval as guard_wilson

    return Interval(*guard_wilson(successes, n, z))


def identical_share(rows: Sequence[dict], config: str = "hypic:8") -> tuple[int, Interval]:
    """bench/faithfulness.py's rows: how many ran `config` (rows without it are left out), and the share
    whose answer is `full`'s word for word with its Wilson 95% interval. Raises ValueError when none ran it."""
    same = [bool(r[config]["identical"]) for r in rows if config in r]
    if not same:
        raise ValueError(f"no rows of {config!r}")
    return len(same), wilson_interval(sum(same), len(same))


def _differences(a: Sequence[float], b: Sequence[float] | None) -> list[float]:
    a = [float(v) for v in a]
    if not a:
        raise ValueError("paired_bootstrap_ci: no values")
    if b is None:
        return a
    b = [float(v) for v in b]
    if len(a) != len(b):
        raise ValueError(f"paired_bootstrap_ci: pairs of unequal length ({len(a)} and {len(b)})")
    return [x - y for x, y in zip(a, b)]


def _percentile_ranks(resamples: int, level: float) -> tuple[int, int]:
    """Indices of the lower and upper percentile among `resamples` sorted resampled means."""
    tail = (1.0 - level) / 2
    return int(math.floor(tail * (resamples - 1))), int(math.ceil((1.0 - tail) * (resamples - 1)))


if __name__ == "__main__":  # a quick look: python bench/stats.py LOST GAINED
    import sys

    lost, gained = (int(v) for v in sys.argv[1:3])
    print(f"lost {lost} / gained {gained}: exact McNemar p = {mcnemar_exact(lost, gained):.4g}")
