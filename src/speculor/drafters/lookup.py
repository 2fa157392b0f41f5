"""Prompt lookup's drafter: drafts copied from earlier occurrences of the sequence's last n-gram (model-free). Shared
by the strategies that draft it: `ngram` (drafters/ngram.py) and specinfer's `drafters=ngram`.

With this machine's cost curve (budget "auto") a continuation is cut to the length j that maximizes the step's
expected rate, j = 0 (plain decoding) included, under the acceptance measured so far in the request:

    rate(j) = (1 + a + a^2 + ... + a^j) / t_target(j + 1)      a = P(a copied token is accepted | the ones before)

a is a Beta estimate from the copied tokens that reached verification, kept apart per length of the matched n-gram
(a 3-gram's copy is far likelier right than a 1-gram's), from a prior of that length's (PRIOR, lower after shorter
matches: data/priors.json "ngram.prior" says how it was chosen, docs/bench/cpu-suffix/ngram); its counts decay by
DECAY at every step it is not tried for its own acceptance, so a length given up on is tried again later. On a
flat curve (fp32 torch) the whole continuation pays; on llama.cpp's steep one (a second row costs a good part of a
first: docs/algorithms.md §15) only confident copies do. In a batch the rate is the batch step's
(core/goodput.best_prefix: the other requests' tokens and rows join both sides). t_target follows the target's calls
as they are timed (runtime/cost.Measured), but for a seeded sampled request."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from speculor.config import SamplingConfig, check_int
from speculor.core import priors
from speculor.core.goodput import BatchLedger, Costs, best_prefix
from speculor.core.tree import DraftTree, merge
from speculor.core.verify import Verdict
from speculor.drafters.base import BatchAware, Proposal
from speculor.runtime.cost import steady


def ngram_continuations(seq: Sequence[int], n_max: int, k: int, branches: int) -> list[list[int]]:
    """Prompt lookup: up to `branches` distinct continuations (≤ k tokens each) of earlier occurrences of the
    last n tokens of seq, for n = n_max down to 1, the most recent occurrence first."""
    return [c for _, c in NgramIndex(n_max).matches(seq, k, branches)]


class NgramIndex:
    """The starts of every n-gram (n <= n_max) of a growing sequence, so that a step's `matches` is a lookup rather
    than a scan of the whole sequence (O(n_max) a token indexed, then O(1) a step where the first start serves)."""

    def __init__(self, n_max: int) -> None:
        self.n_max = n_max
        self.tokens: list[int] = []
        self.starts: dict[tuple[int, ...], list[int]] = {}  # n-gram -> its starts, ascending

    def extend(self, seq: Sequence[int]) -> None:
        """Index seq's tokens not yet indexed (from scratch where seq does not extend what was indexed)."""
        seq = seq if isinstance(seq, list) else list(seq)
        if seq[:len(self.tokens)] != self.tokens:
            self.tokens, self.starts = [], {}
        for end in range(len(self.tokens), len(seq)):
            for n in range(1, min(self.n_max, end + 1) + 1):
                self.starts.setdefault(tuple(seq[end - n + 1:end + 1]), []).append(end - n + 1)
        self.tokens.extend(seq[len(self.tokens):])

    def matches(self, seq: Sequence[int], k: int, branches: int) -> list[tuple[int, list[int]]]:
        """`ngram_continuations(seq, n_max, k, branches)` with the length n of the n-gram each was found by, after
        indexing seq."""
        self.extend(seq)
        seq, out = self.tokens, []
        for n in range(min(self.n_max, len(seq) - 1), 0, -1):
            for start in reversed(self.starts.get(tuple(seq[-n:]), ())):
                if start + n < len(seq):  # not the sequence's own last n-gram: something follows it
                    cont = seq[start + n:start + n + k]
                    if all(cont != c for _, c in out):
                        out.append((n, cont))
                    if len(out) >= branches:
                        return out
        return out


# Beta (hit, miss) priors of the acceptance after a match of 1, 2, 3+ tokens, 2 pseudo-tokens each; their value and how
# they were chosen: data/priors.json "ngram.prior"
PRIOR = priors.value("ngram.prior")
DECAY = 0.9  # counts of a matched length kept at each step it is not tried


class NgramDrafter(BatchAware):
    """Model-free prompt lookup: the continuations of `ngram_continuations`, merged by prefix into a tree of
    deterministic drafts (point-mass rule; greedy matching at temperature 0). Zero draft forwards. With a cost
    curve, continuations cut to the length that pays (module docstring), for the batch's step where it runs in one
    (`ledger`: core/goodput.best_prefix)."""

    def __init__(self, k: int = 8, n: int = 3, branches: int = 1, cost: Costs | None = None) -> None:
        for name, value, top in (("k", k, 64), ("n", n, 16), ("branches", branches, 16)):
            check_int(name, value, 1, top)
        self.k, self.n, self.branches, self.forwards, self.cost = k, n, branches, 0, cost
        self.price = cost  # the curve of this step's cut (`steady`: the profile alone for a seeded sampled request)
        # auto: per matched length m, copied tokens that reached verification and tokens accepted
        self.reached, self.accepted = [0.0] * (n + 1), [0.0] * (n + 1)
        self.cut, self.matched = k, 0  # the last step's cut, and the length of the n-gram its copy was found by
        self.index = NgramIndex(n)
        self.batch_aware = cost is not None

    def propose(self, seq: list[int], cfg: SamplingConfig, generator: torch.Generator | None) -> Proposal:
        found = self.index.matches(seq, self.k, self.branches)
        conts = [c for _, c in found]
        self.matched = found[0][0] if found else 0
        if self.cost is not None:
            longest = max((len(c) for c in conts), default=0)
            self.price = steady(self.cost, cfg.seed is not None and not cfg.greedy)
            self.cut = self._best_cut(longest, self.ledger)
            conts = [c[:self.cut] for c in conts if self.cut]
            if not self.cut and self.matched and (self.ledger is None or not self._best_cut(longest)):
                # not tried for its own acceptance (not for the batch's load): what was learned at this length fades
                self.reached[self.matched] *= DECAY
                self.accepted[self.matched] *= DECAY
        chains = [DraftTree.chain(c, draw="point") for c in conts]
        self.stats = {"cut": self.cut} if self.cost is not None else None
        tree = merge(chains).tree
        self.expected_tokens = (1.0 + sum(self._acceptance() ** j for j in range(1, self.cut + 1))
                                if conts and self.cost else 1.0)
        self.estimate = (1 + len(tree), self.expected_tokens)
        if self.ledger is not None:  # the requests after it in the batch see this tree
            self.ledger.publish(*self.estimate)
        return tree
        yield  # asks for nothing

    def _acceptance(self) -> float:
        """The acceptance estimate after a match of length m (module docstring)."""
        hit, miss = PRIOR[min(max(self.matched, 1), len(PRIOR)) - 1]
        return (self.accepted[self.matched] + hit) / (self.reached[self.matched] + hit + miss)

    def _best_cut(self, longest: int, batch: BatchLedger | None = None) -> int:
        """The continuation length with the best expected rate (module docstring), 0 = none; a step's of `batch`."""
        a = self._acceptance()
        return best_prefix(self.price, (a**j for j in range(1, longest + 1)), batch)

    def observe(self, n_committed: int, verdict: Verdict) -> None:
        if self.cost is None:
            return
        got = len(verdict.path)
        self.reached[self.matched] += min(self.cut, got + 1)  # a token reaches verification iff the ones before passed
        self.accepted[self.matched] += min(self.cut, got)
