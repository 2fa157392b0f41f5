"""Prompt lookup: drafts copied from earlier occurrences of the sequence's last n-gram (model-free)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from speculor.config import SamplingConfig, check_int
from speculor.core.tree import DraftTree, merge
from speculor.drafters.base import Drafter, Proposal


def ngram_continuations(seq: Sequence[int], n_max: int, k: int, branches: int) -> list[list[int]]:
    """Prompt lookup: up to `branches` distinct continuations (≤ k tokens each) of earlier occurrences of the
    last n tokens of seq, for n = n_max down to 1, the most recent occurrence first."""
    out: list[list[int]] = []
    for n in range(min(n_max, len(seq) - 1), 0, -1):
        suffix = list(seq[-n:])
        for start in range(len(seq) - n - 1, -1, -1):
            if seq[start + n - 1] == suffix[-1] and list(seq[start:start + n]) == suffix:
                cont = list(seq[start + n:start + n + k])
                if cont not in out:
                    out.append(cont)
                if len(out) >= branches:
                    return out
    return out


class NgramDrafter(Drafter):
    """Model-free prompt lookup: the continuations of `ngram_continuations`, merged by prefix into a tree of
    deterministic drafts (point-mass rule; greedy matching at temperature 0). Zero draft forwards."""

    def __init__(self, k: int = 8, n: int = 3, branches: int = 1) -> None:
        for name, value, top in (("k", k, 64), ("n", n, 16), ("branches", branches, 16)):
            check_int(name, value, 1, top)
        self.k, self.n, self.branches, self.forwards = k, n, branches, 0

    def propose(self, seq: list[int], cfg: SamplingConfig, generator: torch.Generator | None) -> Proposal:
        chains = [DraftTree.chain(c, draw="point") for c in ngram_continuations(seq, self.n, self.k, self.branches)]
        return merge(chains).tree
        yield  # asks for nothing


