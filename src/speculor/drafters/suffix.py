"""SuffixDecoding (Oliaro et al., NeurIPS 2025; docs/algorithms.md §15) as a strategy: model-free draft trees read off
suffix tries (core/suffix.py) of the request's own tokens and of earlier requests' outputs. Zero draft forwards.

Each step both tries are matched against the sequence's tail: the request's own (prompt and output so far) and, with
`shared`, the strategy's `SuffixCache` of outputs (those of earlier requests and the running ones' so far). The one
with the longer match drafts, the request's own on a tie (match length first, then frequency: the counts rank the
continuations). A seeded sampled request reads its own trie only: what others wrote would change which uniforms its
draws meet, and a seed gives the same tokens alone and in any batch or order of requests (README, the server). Its
tree is the continuations best-first by their empirical path probability P(u), every node a point mass on its token:
verified with the point-mass rule (greedy matching at T = 0), exact whatever chose the tokens (§2). No match
followed by anything: the empty tree, a plain step.

Tree size:
    budget = k      the best k nodes with P >= min_prob (fewer where fewer are that likely)
    budget "auto"   the best n of them (n <= AUTO_CAP, 0 included) for the highest expected rate on this machine's
                    cost curve, the step's tokens estimated from the counts:

                        rate(n) = (1 + Σ_{i<n} v_i) / t_target(n + 1)     v_i = min(1, trust(m, d_i) · P(u_i))

                    and in a batch the batch's step: its other requests' tokens and rows join both sides
                    (core/goodput.py `best_prefix`), so under load a row must pay for the whole call it grows, and
                    beside other rows the best cut must beat the plain step by MARGIN (the model's error band)

                    v_i is never above its parent's; trust(m, d) = (accepted + PRIOR · τ₀(m, d)) / (Σ P drafted +
                    PRIOR) over the nodes at a depth in d's class (DEPTH_EDGES) of earlier drafts after a match
                    whose length is in m's bucket (MATCH_EDGES): how far the counts over- or under-state what the
                    target accepts, from the prior TRUST_0 (τ₀, data/priors.json and docs/algorithms.md §15: short
                    matches are followed far less often than their counts say, long ones nearly as often, deeper
                    nodes less) until something was verified there.
                    Learned online by the strategy, across its requests (a seeded sampled request learns its own, as
                    it reads its own trie, from the same prior: its tree still follows from its seed); both sums of a
                    bucket fade by DECAY at each step that has a match in it and drafts nothing, so a bucket given up
                    on returns to its prior. t_target follows the target's calls as they are timed
                    (runtime/cost.Measured; a seeded sampled request's: the profile alone).
Hybrid (`fallback`, built by the registry: dyspec or eagle with budget "auto"): a step where the tries draft nothing
worth its rows asks the fallback, a draft model's or a head's tree sized by the same cost curve, which itself drafts
only where its predicted rate beats a plain step (and catches up over the tokens it missed only then). Suffix first,
since its tree costs no forward: per step, the free draft where it pays, else the priced one, else a plain step.
Exact either way: each tree is verified by the rule of its own draws.

The request's tokens are indexed as the engine commits them (`observe` sees each step's accepted path and its
recovered/bonus token, the last step's too), its output into the shared cache as well, at once: a running request's
output already serves the others. No engine hook is needed for a request's end.
"""

from __future__ import annotations

from bisect import bisect_right
from dataclasses import dataclass

import torch

from speculor.config import SamplingConfig, check_int, is_int, is_num
from speculor.core import priors
from speculor.core.goodput import Costs, best_prefix
from speculor.core.suffix import NOTHING, Candidate, SuffixCache, SuffixTrie
from speculor.core.tree import EMPTY, DraftTree
from speculor.core.verify import Verdict
from speculor.drafters.base import BatchAware, Drafter, Proposal, Strategy
from speculor.errors import SpeculorError
from speculor.runtime.backend import Pair
from speculor.runtime.cost import steady
from speculor.runtime.profiling import live_cost

DEFAULT_BUDGET = 16  # draft tokens per step where the target's rows are cheap (torch); else "auto" (llama.cpp)
AUTO_CAP = 64  # most draft tokens per step with budget "auto"
PRIOR = 2.0  # pseudo-tokens of the prior trust TRUST_0: what steps say outweighs it after a few drafts
DECAY = 0.999  # what a bucket keeps of its sums at each step that matches in it and drafts nothing (half-life ~700)
MATCH_EDGES = (1, 2, 3, 5, 9)  # lower edges of the match-length buckets the trust is learned in
DEPTH_EDGES = (1, 2, 3, 5)  # ... and of the node depths within each
# the prior trust τ₀ per match bucket (rows) and depth class (columns): accepted / Σ P of drafts made at every match,
# replayed on plain answers; its value, the answers, machine and command it was fitted with, and what was set by
# hand: data/priors.json "suffix.trust_0" (`speculor refit-priors` recomputes it)
TRUST_0 = priors.value("suffix.trust_0")
ON_OFF = {"on": True, "off": False, "true": True, "false": False, "yes": True, "no": False, "1": True, "0": False}


@dataclass(frozen=True)
class SuffixOptions:
    """budget: most draft tokens per step, or "auto" (the cost curve decides, at most AUTO_CAP); max_depth: the
    tries' depth, match and continuation together (matches of at most max_depth // 2 tokens); min_prob: smallest
    path probability P drafted; shared: whether requests share a trie of their outputs; max_tokens: most tokens
    that trie keeps (the oldest requests' evicted first); max_spec_factor: most draft tokens per token of the match
    (Arctic Inference's, 1 as there)."""

    budget: int | str = DEFAULT_BUDGET
    max_depth: int = 24
    min_prob: float = 0.1
    shared: bool = True
    max_tokens: int = 16384
    max_spec_factor: float = 1.0

    def __post_init__(self) -> None:
        if self.budget != "auto" and (not is_int(self.budget) or not 1 <= self.budget <= 1024):
            raise SpeculorError(f"budget must be an integer in [1, 1024] or 'auto', got {self.budget!r}")
        check_int("max_depth", self.max_depth, 2, 256)
        if not is_num(self.min_prob) or not 0 < self.min_prob <= 1:
            raise SpeculorError(f"min_prob must be a number in (0, 1], got {self.min_prob!r}")
        if not isinstance(self.shared, bool):
            raise SpeculorError(f"shared must be on or off (a bool), got {self.shared!r}")
        check_int("max_tokens", self.max_tokens, 1, 1 << 26)
        if not is_num(self.max_spec_factor) or not 0 < self.max_spec_factor <= 1024:
            raise SpeculorError(f"max_spec_factor must be a number in (0, 1024], got {self.max_spec_factor!r}")

    @property
    def cap(self) -> int:
        return AUTO_CAP if self.budget == "auto" else int(self.budget)


class Trust:
    """trust(m, d) per match-length bucket and node depth (module docstring): sums of the tokens accepted at that
    depth and of the P drafted there."""

    def __init__(self) -> None:
        self.clear()

    def clear(self) -> None:
        self.accepted = [[0.0] * len(DEPTH_EDGES) for _ in MATCH_EDGES]
        self.drafted = [[0.0] * len(DEPTH_EDGES) for _ in MATCH_EDGES]

    def of(self, match: int, depth: int = 1) -> float:
        return self._row(match)[_depth_class(depth)]

    def _row(self, match: int) -> list[float]:
        """trust(m, d) for every depth class d."""
        b = _bucket(match)
        sums = zip(self.accepted[b], self.drafted[b], TRUST_0[b], strict=True)
        return [(a + PRIOR * t) / (d + PRIOR) for a, d, t in sums]

    def values(self, c: Candidate) -> list[float]:
        """v_i = min(1, trust(m, depth_i) · P_i), never above its parent's (a node is accepted only after it)."""
        row, v = self._row(c.match), []
        for p, parent, depth in zip(c.probs, c.parents, c.depths, strict=True):
            x = min(1.0, row[_depth_class(depth)] * p)
            v.append(x if parent < 0 else min(x, v[parent]))
        return v

    def learn(self, c: Candidate, path: list[int]) -> None:
        """A verified tree: each node's P drafted at its depth, accepted where it is on the path."""
        b, on = _bucket(c.match), set(path)
        for i, (p, depth) in enumerate(zip(c.probs, c.depths, strict=True)):
            d = _depth_class(depth)
            self.drafted[b][d] += p
            self.accepted[b][d] += i in on

    def fade(self, match: int) -> None:
        b = _bucket(match)
        self.accepted[b] = [a * DECAY for a in self.accepted[b]]
        self.drafted[b] = [a * DECAY for a in self.drafted[b]]


def _bucket(match: int) -> int:
    return max(0, bisect_right(MATCH_EDGES, match) - 1)


def _depth_class(depth: int) -> int:
    return bisect_right(DEPTH_EDGES, depth) - 1


class SuffixStrategy:
    """The shared part: options, the machine's cost curve (budget "auto"), the trust learned from its requests'
    drafts, the trie of outputs (`shared`) and the fallback strategy (module docstring), if any."""

    def __init__(self, opts: SuffixOptions, cost: Costs | None = None, fallback: Strategy | None = None) -> None:
        if opts.budget == "auto" and cost is None:
            raise SpeculorError("suffix with budget='auto' needs the machine's cost model")
        self.opts, self.cost, self.fallback = opts, cost, fallback
        self.cache = SuffixCache(opts.max_depth, opts.max_tokens) if opts.shared else None
        self.trust = Trust()

    def drafter(self) -> SuffixDrafter:
        return SuffixDrafter(self.opts, self.cache, self.cost,
                             self.fallback.drafter() if self.fallback is not None else None, self.trust)

    def forget(self) -> None:
        """Empty the trie of outputs and what the trust learned: what follows starts as a fresh server would (a bench
        round)."""
        if self.cache is not None:
            self.cache.clear()
        self.trust.clear()


class SuffixDrafter(BatchAware):
    """One request's drafter (module docstring). After `propose`: `candidate` = the tries' tree (its P's), `tokens`
    = the tokens of the tree proposed (the tries' or the fallback's), stats = {match, nodes, shared (1 if the shared
    trie drafted), trust, and with a fallback: fallback (1 if it was asked) and the fallback's own stats}."""

    def __init__(self, opts: SuffixOptions | None = None, cache: SuffixCache | None = None,
                 cost: Costs | None = None, fallback: Drafter | None = None, trust: Trust | None = None) -> None:
        self.opts, self.cache, self.cost, self.fallback = opts or SuffixOptions(), cache, cost, fallback
        self.price = cost  # the curve of this step's cut (`steady`: the profile alone for a seeded sampled request)
        self.batch_aware = cost is not None or (fallback is not None and fallback.batch_aware)  # sized for the batch
        self.shared_trust = trust or Trust()  # budget "auto": the strategy's (a seeded request's own: `reset`)
        self.reset()

    def reset(self) -> None:
        self.trie = SuffixTrie(self.opts.max_depth)
        self.known = 0  # tokens of the sequence indexed
        self.seq_id = self.cache.open() if self.cache is not None else None
        self.candidate, self.values, self.tokens, self.asked = NOTHING, [], [], False
        self.own_trust, self.trust = Trust(), self.shared_trust
        if self.fallback is not None:
            self.fallback.reset()

    def propose(self, seq: list[int], cfg: SamplingConfig, generator: torch.Generator | None) -> Proposal:
        self._index(seq[self.known:], output=self.known > 0)
        opts = self.opts
        own = self.trie.propose(seq, opts.cap, opts.min_prob, opts.max_spec_factor)
        alone = cfg.seed is not None and not cfg.greedy  # module docstring
        other = NOTHING if self.cache is None or alone else self.cache.propose(seq, opts.cap, opts.min_prob,
                                                                                opts.max_spec_factor)
        best = other if other.match > own.match else own
        self.trust = self.own_trust if alone else self.shared_trust
        self.price = steady(self.cost, alone)
        trust = self.trust.of(best.match)
        values = self.trust.values(best) if self.cost is not None else best.probs
        n = self._cut(values) if self.cost is not None else len(values)
        if values and n == 0 and (self.ledger is None or self._cut(values, alone=True) == 0):
            # a match not tried for its own values (not for the batch's load): what was learned after it fades
            self.trust.fade(best.match)
        self.candidate = Candidate(best.tokens[:n], best.parents[:n], best.probs[:n], best.match if n else 0)
        self.values, self.tokens = values[:n], list(self.candidate.tokens)
        self.expected_tokens, self.forwards = 1.0 + sum(self.values), 0
        self.stats = {"match": float(self.candidate.match), "nodes": float(n),
                      "shared": float(n > 0 and best is other), "trust": trust}
        self.asked = n == 0 and self.fallback is not None
        if self.asked:  # nothing free worth its rows: the priced draft, if it pays (module docstring)
            return (yield from self._ask_fallback(seq, cfg, generator))
        self.estimate = (1 + n, self.expected_tokens)
        if self.ledger is not None:  # the requests after it in the batch see this tree
            self.ledger.publish(*self.estimate)
        if n == 0:
            return EMPTY
        return DraftTree(torch.tensor(self.candidate.tokens, dtype=torch.long),
                         torch.tensor(self.candidate.parents, dtype=torch.long), None, "point")

    def _ask_fallback(self, seq: list[int], cfg: SamplingConfig, generator: torch.Generator | None) -> Proposal:
        fb = self.fallback
        fb.ledger, fb.estimate = self.ledger, self.estimate
        tree = yield from fb.propose(seq, cfg, generator)
        self.tokens, self.forwards, self.expected_tokens = tree.tokens.tolist(), fb.forwards, fb.expected_tokens
        self.estimate = fb.estimate
        self.stats |= {"fallback": 1.0, **{f"fallback_{k}": v for k, v in (fb.stats or {}).items()}}
        return tree

    def _cut(self, values: list[float], alone: bool = False) -> int:
        """The number of best-first nodes with the highest expected rate (module docstring), 0 = none: for the
        batch's step where it runs in one (`ledger`), unless `alone`."""
        return best_prefix(self.price, values, None if alone else self.ledger)

    def observe(self, n_committed: int, verdict: Verdict) -> None:
        if self.asked:
            self.fallback.observe(n_committed, verdict)
        elif self.candidate.tokens and self.cost is not None:
            # over Σ P, not Σ v: v = trust · P would settle trust at √(accepted / Σ P), a bucket's overstated counts
            # half believed
            self.trust.learn(self.candidate, verdict.path)
        if n_committed == self.known:  # the step's tokens, now: the last step of a request is never proposed after
            self._index([self.tokens[i] for i in verdict.path] + [verdict.token], output=True)

    def _index(self, tokens: list[int], output: bool) -> None:
        """Index committed tokens in the request's trie, and an output's in the shared one."""
        if not tokens:
            return
        self.trie.extend(tokens)
        if output and self.cache is not None:
            self.cache.extend(self.seq_id, tokens)
        self.known += len(tokens)


def switch(value: object, name: str) -> bool:
    """An on/off option given as a bool, 0/1 or on/off, true/false, yes/no (any case); SpeculorError otherwise."""
    if isinstance(value, bool):
        return value
    if is_int(value) and value in (0, 1):
        return bool(value)
    if isinstance(value, str) and value.strip().lower() in ON_OFF:
        return ON_OFF[value.strip().lower()]
    raise SpeculorError(f"{name} must be on or off, got {value!r}")


def make_suffix(pair: Pair, budget: int | str | None = None, max_depth: int = 24, min_prob: float = 0.1,
                shared: bool | str = True, max_tokens: int = 16384, fallback: Strategy | None = None,
                max_spec_factor: float = 1.0) -> SuffixStrategy:
    """Builder of the `suffix` strategy (SuffixOptions; shared also as on/off; fallback: a strategy built by the
    registry, module docstring). Default budget: DEFAULT_BUDGET where the target's rows are cheap (torch), else "auto"
    (llama.cpp: t(n) grows with n)."""
    if budget is None:
        budget = DEFAULT_BUDGET if pair.target.traits.cheap_rows else "auto"
    opts = SuffixOptions(budget, max_depth, min_prob, switch(shared, "shared"), max_tokens, max_spec_factor)
    return SuffixStrategy(opts, live_cost(pair) if opts.budget == "auto" else None, fallback)
