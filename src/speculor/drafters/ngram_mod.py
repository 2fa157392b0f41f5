"""llama.cpp's `--spec-type ngram-mod` (common/ngram-mod.cpp, common/speculative.cpp; llama.cpp PR 19164) as a
strategy, `ngram-mod`, so that its drafts can be compared with ours on our verifier (docs/algorithms.md §15.4).

One table of `size` entries, shared by every request of the strategy: entry h(x_{i..i+n-1}) holds the token x_{i+n}
that last followed those n tokens, where

    h(t_1..t_n) = (((t_1·K + t_2)·K + ...)·K + t_n) mod 2^64 mod size,    K = 6364136223846793005

A request's prompt is added when it starts, the tokens it generates in chunks of 32; its draft is the chain of
lookups from its last n tokens (each token found extends the key), up to n_max tokens, and none unless n_min were
found. The table is emptied when a quarter of it is used, at a request's start, and after five steps in a row whose
draft had under a quarter accepted. Drafts are deterministic (point masses): exact at any temperature."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from speculor.config import SamplingConfig, check_int
from speculor.core.tree import DraftTree
from speculor.core.verify import Verdict
from speculor.drafters.base import Drafter, Proposal
from speculor.errors import SpeculorError
from speculor.runtime.backend import Pair

K = 6364136223846793005  # llama.cpp's multiplier
MASK = (1 << 64) - 1
EMPTY = -1
FULL = 0.25  # occupancy at which a request's start empties the table
CHUNK = 32  # generated tokens added at a time
LOW, STREAK = 0.25, 5  # a draft under LOW accepted, STREAK times in a row: the table is emptied


class Table:
    """The shared hash table of n-gram -> next token (module docstring)."""

    def __init__(self, n: int, size: int) -> None:
        self.n, self.entries, self.used = n, np.full(size, EMPTY, dtype=np.int32), 0

    def index(self, tokens: list[int]) -> int:
        h = 0
        for t in tokens:
            h = (h * K + t) & MASK
        return h % len(self.entries)

    def add(self, seq: list[int], start: int, end: int) -> None:
        """Every n-gram of seq starting in [start, end) with the token after it."""
        for i in range(start, end):
            j = self.index(seq[i:i + self.n])
            self.used += int(self.entries[j] == EMPTY)
            self.entries[j] = seq[i + self.n]

    def get(self, tokens: list[int]) -> int:
        return int(self.entries[self.index(tokens)])

    def reset(self) -> None:
        self.entries.fill(EMPTY)
        self.used = 0


@dataclass
class NgramModDrafter(Drafter):
    """One request's state over the shared `table`: how far its sequence was added, its last draft's length and its
    run of poorly accepted drafts (module docstring)."""

    table: Table
    n_max: int
    n_min: int
    added: int = -1  # seq[:added] has its n-grams in the table (-1: the request has not started)
    drafted: int = 0
    low: int = 0
    stats: dict[str, float] | None = field(default=None)

    def propose(self, seq: list[int], cfg: SamplingConfig, generator: torch.Generator | None) -> Proposal:
        n, t = self.table.n, self.table
        if self.added < 0:  # the request's start: its prompt (the sequence but its root)
            self.added = max(len(seq) - 1 - n, 0)
            t.add(seq, 0, self.added)
            if t.used > FULL * len(t.entries):
                t.reset()
        elif self.added + CHUNK < len(seq) - 1:  # llama.cpp's history is the sequence but its root
            t.add(seq, self.added, len(seq) - 1 - n)
            self.added = len(seq) - 1 - n
        key, draft = seq[-n:], []
        if len(seq) >= n:
            while len(draft) < self.n_max and (tok := t.get(key)) != EMPTY:
                draft.append(tok)
                key = key[1:] + [tok]
        if len(draft) < self.n_min:
            draft = []
        self.drafted = len(draft)
        self.stats = {"drafted": float(len(draft))}
        return DraftTree.chain(draft, draw="point")
        yield  # asks for nothing

    def observe(self, n_committed: int, verdict: Verdict) -> None:
        if not self.drafted:
            return
        if len(verdict.path) / self.drafted < LOW:
            self.low += 1
            if self.low >= STREAK:
                self.table.reset()
                self.low, self.added = 0, 0
        else:
            self.low = 0


class NgramMod:
    """The strategy's shared part: its options and the one table of its requests."""

    def __init__(self, n: int, n_max: int, n_min: int, size: int) -> None:
        self.table, self.n_max, self.n_min = Table(n, size), n_max, n_min

    def drafter(self) -> NgramModDrafter:
        return NgramModDrafter(self.table, self.n_max, self.n_min)

    def forget(self) -> None:
        self.table.reset()


def make_ngram_mod(pair: Pair, n: int = 24, n_max: int = 64, n_min: int = 48, size: int = 4 * 1024 * 1024) -> NgramMod:
    """Builder of `ngram-mod` with llama-server's defaults (--spec-ngram-mod-n-match 24, n-max 64, n-min 48, a table
    of 4 Mi entries)."""
    check_int("n", n, 1, 1024)
    check_int("n_max", n_max, 1, 256)
    check_int("n_min", n_min, 0, 256)
    check_int("size", size, 1, 1 << 26)
    if n_min > n_max:
        raise SpeculorError(f"n_min ({n_min}) must not exceed n_max ({n_max})")
    return NgramMod(n, n_max, n_min, size)
