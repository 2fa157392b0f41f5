"""Statistics of the law tests: a chi-square goodness of fit with the TV distance and its noise floor, and the counts
of the first N tokens of seeded toy decodings at temperature 1."""

from __future__ import annotations

import math
from dataclasses import replace

import torch
from scipy.stats import chisquare

from speculor import engine
from speculor.runtime.model import Model

from .toy import T1, N, ToyLM, V


def goodness_of_fit(counts: torch.Tensor, law: torch.Tensor) -> tuple[float, float, float]:
    """(chi-square p-value with cells of expected count < 5 pooled, TV distance, TV noise floor)."""
    m = float(counts.sum())
    obs, exp = counts.flatten().numpy(), (law.flatten() * m).numpy()
    assert obs[exp == 0].sum() == 0, "a token sequence of probability 0 was generated"
    big = exp >= 5
    f_obs = list(obs[big]) + ([obs[~big].sum()] if (~big).any() else [])
    f_exp = list(exp[big]) + ([exp[~big].sum()] if (~big).any() else [])
    if f_exp[-1] == 0:
        f_obs, f_exp = f_obs[:-1], f_exp[:-1]
    pvalue = float(chisquare(f_obs, f_exp).pvalue)
    p = law.flatten()
    tv = 0.5 * float((counts.flatten() / m - p).abs().sum())
    floor = 0.5 * float(torch.sqrt(2 * p * (1 - p) / (math.pi * m)).sum())
    return pvalue, tv, floor


def counts(target: ToyLM, drafter, prompt: list[int], m: int, seed0: int) -> torch.Tensor:
    """Counts [V]*N of the first N tokens over m seeded generations at T1 (one target model and drafter reused)."""
    t_model = Model(target)
    out = torch.zeros([V] * N, dtype=torch.float64)
    for i in range(m):
        run = replace(T1, max_new_tokens=N, seed=seed0 + i)
        out[tuple(t.id for t in engine.stream(t_model, drafter, prompt, run))] += 1
    return out
