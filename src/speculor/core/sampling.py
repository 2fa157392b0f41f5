"""Pure tensor functions that turn logits into the distribution tokens are drawn from.

`warp` is the sampling transform W of docs/algorithms.md §0 (temperature, top-k, top-p), applied alike to
target logits (giving p) and draft logits (giving q). Everything is computed in fp32.
"""

from __future__ import annotations

import torch

from speculor.config import SamplingConfig
from speculor.errors import SpeculorError


def check_finite(logits: torch.Tensor, who: str) -> None:
    # a NaN anywhere makes the sum NaN: one vectorized pass, cheaper than isnan().any() over a row (docs/algorithms.md
    # §0); the exact test only where the sum says so (+inf beside -inf sums to NaN too)
    if torch.isnan(logits.sum()) and torch.isnan(logits).any():
        raise SpeculorError(f"the {who} model produced NaN logits; the model file or its dtype is broken")


def warp(logits: torch.Tensor, cfg: SamplingConfig) -> torch.Tensor:
    """W(logits) -> probabilities [..., V] for temperature > 0: softmax(logits / T) kept to top-k, top-p, min-p."""
    z = logits.float() / cfg.temperature
    if 0 < cfg.top_k < z.shape[-1]:
        kth = torch.topk(z, cfg.top_k, dim=-1).values[..., -1:]
        z = z.masked_fill(z < kth, float("-inf"))
    probs = torch.softmax(z, dim=-1)
    if cfg.top_p < 1:
        probs = top_p(probs, cfg.top_p)
    if cfg.min_p > 0:  # drop tokens less likely than min_p times the most likely one
        probs = probs.masked_fill(probs < cfg.min_p * probs.amax(dim=-1, keepdim=True), 0.0)
        probs = probs / probs.sum(dim=-1, keepdim=True)
    return probs


TOP_P_FIRST = 1024  # top-p looks for its prefix among this many largest first (a full sort is dear: algorithms.md §0)


def top_p(probs: torch.Tensor, p: float) -> torch.Tensor:
    """probs [..., V] kept to the smallest prefix of the descending order whose mass reaches p (always >= 1 token),
    renormalised. Every token after that prefix is dropped, so when the TOP_P_FIRST largest already reach p the
    prefix is found among them, and the rest need no order."""
    n = probs.shape[-1]
    sorted_p, order = torch.topk(probs, min(TOP_P_FIRST, n), dim=-1)
    csum = torch.cumsum(sorted_p, dim=-1)
    if sorted_p.shape[-1] < n and not bool((csum[..., -1] >= p).all()):
        sorted_p, order = torch.sort(probs, dim=-1, descending=True)
        csum = torch.cumsum(sorted_p, dim=-1)
    keep = torch.zeros_like(probs, dtype=torch.bool).scatter(-1, order, (csum - sorted_p) < p)
    probs = probs.masked_fill(~keep, 0.0)
    return probs / probs.sum(dim=-1, keepdim=True)


def sample(probs: torch.Tensor, generator: torch.Generator | None) -> int:
    """One draw from a probability vector [V] (mass need not sum to 1)."""
    return draw_iid(probs, 1, generator)[0]


def greedy(logits: torch.Tensor) -> int:
    """argmax with the lowest id on ties (torch's and numpy's argmax return the first maximum); numpy's on a host
    fp32 row (far cheaper than torch's, which was a plain step's largest host cost: docs/algorithms.md §0)."""
    if logits.dtype == torch.float32 and logits.device.type == "cpu" and not logits.requires_grad:
        return int(logits.numpy().argmax())
    return int(torch.argmax(logits))


def residual(r: torch.Tensor, d: torch.Tensor) -> torch.Tensor | None:
    """resid(r, d) = norm(max(r - d, 0)); None when it has no mass (then r == d and rejection has prob. 0)."""
    res = torch.clamp(r - d, min=0)
    mass = res.sum()
    return None if mass <= 1e-12 else res / mass


def draw_iid(q: torch.Tensor, k: int, generator: torch.Generator | None) -> list[int]:
    """k independent draws from q [V] (mass need not sum to 1), in draw order; repeats are kept (MSS verifies each
    draw, §2). On the CPU by the inverse CDF: token i for uniform u * C[V-1] in [C[i-1], C[i]), C the fp64
    cumulative sum, so P(i) = q[i] / sum and a zero-mass token is never drawn (C[i] = C[i-1]); torch.multinomial
    is dearer on a CPU (docs/algorithms.md §0)."""
    if q.device.type != "cpu":
        return torch.multinomial(q, k, replacement=True, generator=generator).tolist()
    c = torch.cumsum(q, 0, dtype=torch.float64)
    u = torch.rand(k, dtype=torch.float64, generator=generator) * c[-1]
    i = torch.searchsorted(c, u, right=True)
    past = i == len(c)  # u * C[V-1] rounded up to C[V-1]: the last token with mass
    if bool(past.any()):
        i[past] = int(torch.nonzero(q).max())
    return i.tolist()


def draw_swor(q: torch.Tensor, k: int, generator: torch.Generator | None) -> list[int]:
    """min(k, |supp q|) draws without replacement from q [V], in draw order (exponential keys, §4.3).

    κ_x = log(u_x) / q(x) with u_x ~ U(0, 1) in fp64 (kept > 0), top-k by κ: descending κ is the draw order.
    Tokens with q = 0 have κ = -inf and are never drawn, so k is capped at the support size.
    """
    k = min(k, int((q > 0).sum()))
    u = torch.rand(q.shape, dtype=torch.float64, generator=generator).clamp_min_(torch.finfo(torch.float64).tiny)
    keys = u.log_() / q.double()  # log u < 0: q = 0 gives -inf
    return torch.topk(keys, k).indices.tolist()


def top_tokens(logits: torch.Tensor, k: int) -> list[int]:
    """The k (at most: only finite logits count) distinct most likely tokens, best first (ties in any order:
    these are drafts for greedy verification, where any draft is lossless)."""
    k = min(k, int(torch.isfinite(logits).sum()))
    return torch.topk(logits, k).indices.tolist()
