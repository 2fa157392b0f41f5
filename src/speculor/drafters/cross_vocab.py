"""A draft with another tokenizer (universal assisted generation): text is the common ground.

Each step: the committed target tokens are decoded to text and encoded with the draft's tokenizer; the draft's
cache keeps the longest prefix of draft ids it already holds and is fed the rest; the draft continues greedily
for k of its own tokens; their text is re-tokenized with the target's tokenizer after the last few committed
target tokens (so a word that continues across the boundary is tokenized as the target would), and the target
tokens after those are proposed as a chain of point-mass nodes. A point-mass proposal is verified exactly at any
temperature (docs/algorithms.md §2: accept x with probability p(x), else sample the residual p with x removed):
the draft's choices only change how many tokens are accepted, never what the target emits.
"""

from __future__ import annotations

from typing import Any

import torch

from speculor.config import SamplingConfig
from speculor.core.sampling import check_finite, greedy
from speculor.core.tree import EMPTY, DraftTree
from speculor.drafters.base import Drafter, Forward, Proposal
from speculor.runtime.backend import Backend, Block

BOUNDARY = 8  # committed target tokens re-tokenized with the draft's text


class CrossVocabDrafter(Drafter):
    """k greedy tokens of a draft model with its own tokenizer, proposed as target tokens (module docstring)."""

    def __init__(self, model: Backend, draft_tokenizer: Any, target_tokenizer: Any, k: int) -> None:
        self.model, self.k = model, k
        self.draft_tok, self.target_tok = draft_tokenizer, target_tokenizer
        self.reset()

    def reset(self) -> None:
        self.cache = self.model.new_cache()
        self.ids: list[int] = []  # the draft ids the cache holds, committed
        self.forwards = 0

    def propose(self, seq: list[int], cfg: SamplingConfig, generator: torch.Generator | None) -> Proposal:
        ids = self.draft_tok.encode(self.target_tok.decode(seq), add_special_tokens=False)
        if not ids:
            return EMPTY
        keep = min(_common(self.ids, ids), len(ids) - 1)  # at least the last id is fed: its logits are the next's
        self.cache.trim(keep)
        logits = (yield Forward(self.model, Block(self.cache, ids[keep:], last=True))).logits[-1]
        self.cache.keep(list(range(len(ids) - keep)))
        drafted: list[int] = []
        for i in range(self.k):
            check_finite(logits, "draft")
            drafted.append(greedy(logits))
            if i < self.k - 1:
                logits = (yield Forward(self.model, Block(self.cache, drafted[-1:], last=True))).logits[-1]
                self.cache.keep([0])
        self.ids = ids + drafted[:-1]
        self.forwards = self.k
        return DraftTree.chain(self._target_tokens(seq, ids, drafted), draw="point")

    def _target_tokens(self, seq: list[int], ids: list[int], drafted: list[int]) -> list[int]:
        """The draft's continuation as target tokens after seq (none where the boundary does not line up)."""
        base = self.draft_tok.decode(ids)
        text = self.draft_tok.decode(ids + drafted)
        if not text.startswith(base):
            return []
        tail = seq[-BOUNDARY:]
        out = self.target_tok.encode(self.target_tok.decode(tail) + text[len(base):], add_special_tokens=False)
        if out[:len(tail)] != tail:
            return []
        return out[len(tail):][:2 * self.k]


def _common(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n
