"""What `speculor refit-priors` measures: the model-free drafters replayed on plain answers, and the priors of
data/priors.json (core/priors.py) recomputed from what they drafted and what the answers accepted.

At T = 0 a speculative answer is plain decoding's, token for token, so each step of a model-free drafter (its tree
depends only on the committed tokens) and what the target accepts of it can be recomputed offline from a plain
answer: the accepted path is the tree's longest chain equal to the next tokens of the answer, then one more token is
committed (the recovered or bonus token). On a sampled answer a node counts as accepted where the sample took its
token: the same in expectation as the point-mass rule's p(token). No model, no cost curve: pure Python over token ids
(scripts/drafts/replay.py, without its pricing).

    suffix.trust_0   suffix drafting at every match (budget K nodes, no cost curve, so no selection by trust):
                     accepted / Σ P per match-length bucket and node-depth class (drafters/suffix.py MATCH_EDGES,
                     DEPTH_EDGES), one strategy per run (its shared trie filling across the run's answers), as
                     scripts/drafts/depth_stats.py measured it; the prior is that table rounded to
                     0.05 (TRUST_GRID), a class with no node drafted keeping its value
    ngram.prior      ngram (k tokens, n-grams of n down to 1) drafting its whole continuation at every match: per
                     matched length m, a = accepted / reached (a token reaches verification iff the ones before it
                     passed) and the share of steps whose first token was accepted, as
                     scripts/drafts/ngram_stats.py measured it; measured only (the prior was picked by
                     hand among replayed candidates: data/priors.json says so)
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from speculor.config import SamplingConfig
from speculor.core.verify import Verdict
from speculor.drafters import suffix
from speculor.drafters.base import Drafter
from speculor.drafters.lookup import NgramDrafter

Answer = tuple[Sequence[int], Sequence[int]]  # (the prompt's token ids, the plain answer's token ids)
Run = Sequence[Answer]  # the answers of one bench run, in its order (suffix's shared trie fills across them)

TRUST_GRID = 20  # suffix.trust_0's values: the measured ratios rounded to 1 / TRUST_GRID (0.05)
SUFFIX_BUDGET, SUFFIX_FACTOR = 8, 1.0  # suffix's drafts measured: at most 8 nodes, at most 1 per token of the match
NGRAM_K, NGRAM_N = 8, 3  # ngram's: 8-token continuations of n-grams of 3 down to 1 tokens
MEASURED_TRUST = (f"suffix:budget={SUFFIX_BUDGET},max_spec_factor={SUFFIX_FACTOR:g} drafting at every match, no cost "
                  "curve, replayed on the answers: accepted / Σ P per cell, None where no node was drafted")


def replay(drafter: Drafter, prompt: Sequence[int], answer: Sequence[int],
           on_step: Callable[[Drafter, list[int], list[int]], None]) -> None:
    """Decode `answer` after `prompt` step by step with a model-free `drafter`, as the engine would have: each step's
    tree, its path accepted by the answer's next tokens, then those tokens and one more committed.
    `on_step(drafter, tokens, path)` sees every step's tree tokens and accepted path (tree node indices)."""
    drafter.reset()
    seq, done = list(prompt), 0
    while done < len(answer):
        proposal = drafter.propose(seq, SamplingConfig(), None)
        try:
            next(proposal)
            raise RuntimeError("a model-free drafter asked for a forward")
        except StopIteration as stop:
            tree = stop.value
        tokens, parents = tree.tokens.tolist(), tree.parents.tolist()
        path, node, at = [], -1, done
        while at < len(answer):
            child = next((c for c in range(len(tokens)) if parents[c] == node and tokens[c] == answer[at]), None)
            if child is None:
                break
            path.append(child)
            node, at = child, at + 1
        on_step(drafter, tokens, path)
        drafter.observe(len(seq), Verdict(path, answer[at] if at < len(answer) else 0))
        committed = min(len(path) + 1, len(answer) - done)
        seq += answer[done:done + committed]
        done += committed


@dataclass
class Cell:
    """What one (match bucket, depth class) drafted: nodes, their Σ P and how many were accepted."""

    nodes: int = 0
    mass: float = 0.0
    accepted: int = 0

    @property
    def ratio(self) -> float | None:
        """accepted / Σ P; None where nothing was drafted."""
        return self.accepted / self.mass if self.nodes else None


def suffix_cells(runs: Sequence[Run], budget: int = SUFFIX_BUDGET,
                 max_spec_factor: float = SUFFIX_FACTOR) -> list[list[Cell]]:
    """suffix's drafts at every match over the runs' answers, counted per match bucket and depth class."""
    cells = [[Cell() for _ in suffix.DEPTH_EDGES] for _ in suffix.MATCH_EDGES]

    def count(drafter: Drafter, tokens: list[int], path: list[int]) -> None:
        candidate, accepted = drafter.candidate, set(path)
        row = cells[suffix._bucket(candidate.match)]
        for i, (prob, depth) in enumerate(zip(candidate.probs, candidate.depths, strict=True)):
            cell = row[suffix._depth_class(depth)]
            cell.nodes += 1
            cell.mass += prob
            cell.accepted += i in accepted

    opts = suffix.SuffixOptions(budget=budget, max_spec_factor=max_spec_factor)
    for run in runs:
        strategy = suffix.SuffixStrategy(opts)  # one per run: a bench round's fresh strategy
        for prompt, answer in run:
            replay(strategy.drafter(), prompt, answer, count)
    return cells


def trust_values(cells: Sequence[Sequence[Cell]], current: Sequence[Sequence[float]]) -> tuple[tuple[float, ...], ...]:
    """suffix.trust_0 from the measured cells: each ratio rounded to 1 / TRUST_GRID (n / 20 is the float nearest the
    decimal, as a literal 0.35 is); a cell with nothing drafted keeps its `current` value."""
    return tuple(tuple(old if cell.ratio is None else round(cell.ratio * TRUST_GRID) / TRUST_GRID
                       for cell, old in zip(row, old_row, strict=True))
                 for row, old_row in zip(cells, current, strict=True))


@dataclass
class Copies:
    """What ngram drafted after an m-token match: steps, tokens that reached verification, tokens accepted, steps
    whose first token was accepted."""

    steps: int = 0
    reached: int = 0
    accepted: int = 0
    first: int = 0

    @property
    def acceptance(self) -> float | None:
        """a = accepted / reached; None where nothing was drafted."""
        return self.accepted / self.reached if self.reached else None

    @property
    def first_rate(self) -> float | None:
        return self.first / self.steps if self.steps else None


def ngram_copies(runs: Sequence[Run], k: int = NGRAM_K, n: int = NGRAM_N) -> list[Copies]:
    """ngram's whole continuations at every match over the runs' answers, counted per matched length m = 1..n
    (index m - 1)."""
    copies = [Copies() for _ in range(n)]

    def count(drafter: NgramDrafter, tokens: list[int], path: list[int]) -> None:
        if tokens:
            seen = copies[drafter.matched - 1]
            seen.steps += 1
            seen.reached += min(len(tokens), len(path) + 1)
            seen.accepted += len(path)
            seen.first += bool(path)

    for run in runs:
        for prompt, answer in run:
            replay(NgramDrafter(k=k, n=n), prompt, answer, count)
    return copies


# ---------------------------------------------------------------- the file's entries, refitted


def cell_names() -> list[list[str]]:
    """'match 5-8, depth 2'-style names of suffix.trust_0's cells."""
    return [[f"match {m}, depth {d}" for d in _spans(suffix.DEPTH_EDGES)] for m in _spans(suffix.MATCH_EDGES)]


def _spans(edges: Sequence[int]) -> list[str]:
    """'1', '3-4', '9+' for the classes starting at each of `edges`."""
    out = []
    for lo, nxt in zip(edges, [*edges[1:], None], strict=True):
        out.append(f"{lo}+" if nxt is None else str(lo) if nxt == lo + 1 else f"{lo}-{nxt - 1}")
    return out


def refit_trust(entry: dict, cells: Sequence[Sequence[Cell]], fitted: dict) -> tuple[dict, list[str]]:
    """suffix.trust_0's entry refitted from `cells` (its value as `trust_values` makes it; `fitted`: the set,
    records, machine, command, date and commit to record), and one line per cell whose value changed."""
    old = entry["value"]
    new = trust_values(cells, old)
    names = cell_names()
    kept = [names[b][d] for b, row in enumerate(cells) for d, cell in enumerate(row) if cell.ratio is None]
    changes = [f"{names[b][d]}: {old[b][d]} -> {new[b][d]} (measured {cells[b][d].ratio:.4f}, "
               f"{cells[b][d].nodes} nodes)" for b in range(len(new)) for d in range(len(new[b]))
               if new[b][d] != old[b][d]]
    measured = {"ratio": [[None if c.ratio is None else round(c.ratio, 4) for c in row] for row in cells],
                "nodes": [[c.nodes for c in row] for row in cells], "how": MEASURED_TRUST}
    out = dict(entry)
    out["value"] = [list(row) for row in new]
    out["fitted"] = {**fitted, "measured": measured,
                     "how": "the measured table rounded to 0.05 (speculor refit-priors, drafters/refit.py)",
                     "by_hand": [f"no node drafted, the value of the file before kept: {name}" for name in kept]}
    return out, changes
