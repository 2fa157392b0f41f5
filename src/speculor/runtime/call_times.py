"""`CallTimes`: a backend's calls timed by their rows as the process makes them (runtime/cost.py `Measured` reads
them). Pure bookkeeping: no model, no speculor import."""

from __future__ import annotations


class CallTimes:
    """Seconds of a backend's calls by their rows, 1..limit (llama.cpp's exact calls), as moving averages: each call
    moves its size's estimate c(k) by ALPHA. `ratio(k)`, once both sizes were timed SEEN times, is a moving average of
    each k-row call over c(1) as it stood then, not c(k) / c(1): a call's time grows with the context it attends to
    (docs/algorithms.md §11.1), and c(k) of rarer multi-row calls would be read against one-row calls made at another
    length."""

    ALPHA = 0.1
    SEEN = 4

    def __init__(self, limit: int) -> None:
        self.limit, self.s, self.n = limit, [0.0] * (limit + 1), [0] * (limit + 1)
        self.r = [0.0] * (limit + 1)  # ratio(k)'s moving average, k >= 2 (0: none yet)

    def add(self, rows: int, seconds: float) -> None:
        if not 1 <= rows <= self.limit:
            return
        if rows > 1 and self.n[1]:
            x = seconds / self.s[1]
            self.r[rows] = x if not self.r[rows] else self.r[rows] + self.ALPHA * (x - self.r[rows])
        self.s[rows] = seconds if not self.n[rows] else self.s[rows] + self.ALPHA * (seconds - self.s[rows])
        self.n[rows] += 1

    def ratio(self, k: int) -> float | None:
        if k == 1:
            return 1.0
        return self.r[k] if min(self.n[k], self.n[1]) >= self.SEEN and self.r[k] > 0 else None
