"""A generation's types: a `Request` holds everything that belongs to one generation (the committed sequence, the
target's cache, the drafter with its own draft cache and adaptive state, the sampling config, the random generator
seeded from the request's seed, its grammar's state); a `Token` is one emitted token, a `Step` one target forward's
numbers, `Stats` a request's prefill time and steps. The target model is shared and holds no request state.

Glossary:
    seq       prompt + tokens emitted so far; seq[-1] is the root of the next draft tree
    fill      the prompt tokens the prefill puts in the target's cache: all, or all but the root (engine/steps.py)
    unfilled  of those, the ones not yet in the cache (a prompt filled chunk by chunk, or a forced run)
    chunk     the grid a prompt filled by batched steps is cut on (engine/batch.py)
    root_result  the root's result from the prompt's last call, where the backend scores it there: the first
                 step's
    forced    a token the grammar allows alone: emitted with no decision, its row filled like prompt text
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from speculor.config import SamplingConfig
from speculor.drafters.base import Drafter
from speculor.errors import SpeculorError
from speculor.grammar.state import GrammarState, Walk
from speculor.runtime.backend import Backend, Cache, Rows

PREFILL_CHUNK = 32  # prompt tokens a joining request adds to one batched forward (its rows cost ~ one step's)


@dataclass(frozen=True)
class Token:
    id: int
    from_draft: bool  # an accepted draft token (else the recovered/bonus token of its step)
    logprob: float | None = None  # with cfg.logprobs: its log-probability under the distribution it was chosen from
    top: tuple[tuple[int, float], ...] = ()  # and the cfg.logprobs most likely tokens there, with theirs


@dataclass(frozen=True)
class Step:
    accepted: int  # draft tokens accepted
    drafted: int  # draft tokens sent to the target (tree size)
    draft_forwards: int
    draft_s: float
    verify_s: float  # target forward
    overhead_s: float  # acceptance and bookkeeping
    drafter_stats: dict[str, float] | None = None  # the drafter's own numbers of the step (its `stats` dict, if any)


@dataclass
class Stats:
    prefill_s: float = 0.0
    steps: list[Step] = field(default_factory=list)
    forced: int = 0  # tokens a grammar forced: emitted with no decision, their rows filled (`refill`)

    @property
    def tau(self) -> float:
        """Mean tokens emitted per target forward (bonus included; plain decoding has 1)."""
        return sum(s.accepted + 1 for s in self.steps) / max(len(self.steps), 1)


def check_prompt(prompt: list[int], cfg: SamplingConfig, target: Backend) -> None:
    if not prompt:
        raise SpeculorError("the prompt is empty")
    for t in prompt:  # numpy's ints are not ints
        if not (isinstance(t, int) and 0 <= t < target.vocab_size):
            raise SpeculorError(f"the prompt holds {t!r} ({type(t).__name__}): token ids are ints in "
                                f"[0, {target.vocab_size}) (a tokenizer's output object is not a list of ids)")
    if len(prompt) + cfg.max_new_tokens > target.context_length:
        raise SpeculorError(
            f"prompt ({len(prompt)} tokens) + max_new_tokens ({cfg.max_new_tokens}) exceeds the model's "
            f"context length ({target.context_length})")
    if any(t >= target.vocab_size for t, _ in cfg.logit_bias):
        raise SpeculorError(f"logit_bias names token ids outside the vocabulary [0, {target.vocab_size})")


@dataclass
class Request:
    """One generation's state (module docstring's glossary)."""

    seq: list[int]
    cfg: SamplingConfig
    cache: Cache
    drafter: Drafter | None
    generator: torch.Generator | None
    stats: Stats
    produced: int = 0
    fill: int = 0
    unfilled: int = 0
    chunk: int = PREFILL_CHUNK
    root_result: Rows | None = None
    scores: list | None = None  # the last step's (logprob, top) per emitted token, with cfg.logprobs (`settle`)
    grammar: GrammarState | None = None  # its constraint's state (grammar/state.py), None: unconstrained
    walk: Walk | None = None  # this step's tree as the grammar sees it: its masks, and the drafter's node indices
    pending: list[Token] = field(default_factory=list)  # forced tokens not yet emitted (the ones before the first)
    root_in_prompt: bool = False  # the target's: whether a fill's last call scores its last token (`refill`)

    @property
    def prompt(self) -> list[int]:
        """The prompt tokens a prefill puts in the cache (seq is the prompt while it fills)."""
        return self.seq[:self.fill]
