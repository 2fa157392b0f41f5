"""A cost curve and calls timed on it, for the tests of the auto budgets' cuts (test_cost_choice, test_suffix)."""

from __future__ import annotations

from speculor.runtime.call_times import CallTimes
from speculor.runtime.cost import CostModel

SIZES = tuple(range(1, 17))
GENTLE = CostModel(SIZES, tuple(0.05 * (1 + 0.15 * (n - 1)) for n in SIZES), SIZES, tuple(0.0 for _ in SIZES))


def timed(ratios: dict[int, float], times: int = CallTimes.SEEN) -> CallTimes:
    """Calls of k rows timed at ratios[k] x a one-row call's 0.05 s, `times` each."""
    calls = CallTimes(3)
    for _ in range(times):
        for k, r in ratios.items():
            calls.add(k, 0.05 * r)
    return calls
