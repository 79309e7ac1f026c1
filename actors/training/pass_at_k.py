"""pass@k: the unbiased estimator of Chen et al. (2021, "Evaluating Large Language Models Trained on Code")
and its standard error over problems.

For a problem with n samples of which c pass, the chance that k of them drawn without replacement hold at
least one pass is ``1 - C(n-c, k) / C(n, k)``, an unbiased estimate of the problem's pass@k for k <= n.
It is computed as ``1 - prod_{i=n-c+1}^{n} (1 - k/i)``: the same ratio written as a product of c factors
in [0, 1), so no binomial coefficient (astronomical for n in the hundreds) is formed and no large
numbers are divided.

The benchmark's figure is the mean of the per-problem estimates over its P problems. Its standard error
is the sample standard deviation of those estimates (ddof = 1) divided by sqrt(P): problems are taken as
drawn from a population of problems, and since each per-problem estimate is unbiased, their spread holds
both the differences between problems and each estimate's own sampling noise. With one problem there is
no spread to measure and the standard error is NaN.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

__all__ = ["PassAtK", "estimate_pass_at_k", "pass_at_k", "reported_ks"]


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k of one problem with ``c`` passing samples out of ``n``.

    Raises:
        ValueError: unless 0 <= c <= n and 1 <= k <= n.
    """
    if not (0 <= c <= n and 1 <= k <= n):
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n, got n={n}, c={c}, k={k}")
    if n - c < k:  # every k-subset holds a pass
        return 1.0
    return 1.0 - math.prod(1.0 - k / i for i in range(n - c + 1, n + 1))


@dataclass(frozen=True)
class PassAtK:
    """pass@k over a set of problems: the mean of the per-problem estimates and its standard error."""

    k: int
    value: float
    stderr: float
    num_problems: int


def estimate_pass_at_k(counts: Sequence[tuple[int, int]], k: int) -> PassAtK:
    """pass@k over problems given as (num samples, num passed) pairs (see the module docstring).

    Raises:
        ValueError: no problems, or a pair `pass_at_k` refuses (k above a problem's samples included).
    """
    if not counts:
        raise ValueError("pass@k needs at least one problem")
    values = [pass_at_k(n, c, k) for n, c in counts]
    mean = math.fsum(values) / len(values)
    if len(values) < 2:
        return PassAtK(k, mean, math.nan, len(values))
    variance = math.fsum((v - mean) ** 2 for v in values) / (len(values) - 1)
    return PassAtK(k, mean, math.sqrt(variance / len(values)), len(values))


def reported_ks(samples_per_problem: int, ks: Iterable[int] = (1, 10, 100)) -> list[int]:
    """The k to report for this many samples a problem: HumanEval's 1, 10, 100 where there are enough
    samples, and the largest k the samples allow."""
    return sorted({k for k in ks if k <= samples_per_problem} | {samples_per_problem})
