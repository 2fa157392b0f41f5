"""One request's grammar state while decoding: the tokens it allows, at the root and at every node of a draft tree.

Glossary:
    allowed   the tokens the grammar admits next: a bool mask [V] (llguidance's bitmask, unpacked)
    forced    a state that admits exactly one token: that token has probability 1 under the masked target, so it
              is emitted without a decision (`forced_run`); its row is still computed, by the engine's fill calls,
              the same way in plain and speculative decoding (engine/steps.py `emit`)
    fast-forward  the bytes every continuation starts with, as the tokenizer writes them (llguidance's ff tokens):
              a point-mass draft the target verifies (the grammar as a drafter); the model may write those bytes
              with other tokens, so they are drafted, never forced

`walk(tree)` advances the matcher along every root-to-node path (consume, then roll back) and gives each block row
its mask. At temperature 0 it also cuts, with their subtrees, the nodes the grammar forbids (never the argmax of
the masked p) and the nodes after which the grammar forces a token (the row of such a node is computed by the fill
that follows it in plain decoding: verifying it in a tree would give it other bits). Cutting a node is exact at
T = 0 only; under sampling the tree is verified whole: a forbidden node has p = 0 and is rejected, its residual
taken as drawn (core/verify.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from speculor.core.tree import DraftTree, children_lists
from speculor.errors import SpeculorError

MAX_FORCED = 4096  # a forced run longer than this is a grammar that loops on one token


@dataclass(frozen=True)
class Walk:
    """A draft tree as the grammar sees it: the nodes verified (the drafted tree's, a subset at T = 0), where each
    came from, and the mask of every block row."""

    tree: DraftTree
    origin: list[int]  # origin[i]: the drafted tree's index of node i
    masks: torch.Tensor  # [1 + len(tree), V] bool: row 0 the root's, row i + 1 node i's
    drafted: bool = True  # whether the request's drafter drafted the tree (False: the grammar's fast-forward)


class GrammarState:
    """A request's llguidance matcher (grammar/compile.py `Grammars.matcher`) over a vocabulary of `vocab_size`."""

    def __init__(self, matcher: Any, vocab_size: int, eos_ids: frozenset[int] = frozenset()) -> None:
        self.matcher, self.vocab_size, self.eos_ids = matcher, vocab_size, eos_ids

    def allowed(self) -> torch.Tensor:
        """[V] bool: the tokens the grammar admits now."""
        bits = np.unpackbits(np.frombuffer(self.matcher.compute_bitmask(), dtype=np.uint8), bitorder="little")
        return torch.from_numpy(bits[:self.vocab_size].astype(bool))

    def advance(self, token: int) -> None:
        """Consume an emitted token (the engine only emits tokens the mask allowed)."""
        if not self.matcher.consume_token(token):
            raise SpeculorError(f"the grammar refused token {token}: {self.matcher.get_error()}")

    @property
    def done(self) -> bool:
        """Whether the grammar admits nothing but the end of the sequence."""
        return self.matcher.is_stopped()

    def forced_run(self, limit: int) -> list[int]:
        """The tokens forced from here (each the one token its state admits), at most `limit`, consumed; it stops
        after an end token."""
        run: list[int] = []
        while len(run) < min(limit, MAX_FORCED):
            only = torch.nonzero(self.allowed()).flatten()
            if only.numel() != 1:
                break
            run.append(int(only[0]))
            self.advance(run[-1])
            if run[-1] in self.eos_ids or self.done:
                break
        return run

    def fast_forward(self, limit: int) -> list[int]:
        """Up to `limit` tokens of the bytes every continuation starts with, as the tokenizer writes them (a draft)."""
        return [] if self.done else list(self.matcher.compute_ff_tokens())[:limit]

    def walk(self, tree: DraftTree, greedy: bool) -> Walk:
        """The tree's masks row by row (module docstring); at T = 0 without forbidden and forcing nodes."""
        kids = children_lists(tree.parents)
        root = self.allowed()
        masks: dict[int, torch.Tensor] = {}

        def visit(node: int, mask: torch.Tensor) -> None:  # mask: the rows of node's children are allowed by it
            for c in kids.get(node, []):
                t = int(tree.tokens[c])
                if not bool(mask[t]):
                    if not greedy:  # verified (and rejected) whole; its row, never read, admits all
                        masks[c] = torch.ones_like(mask)
                    continue
                self.advance(t)
                m = self.allowed()
                if not (greedy and int(m.sum()) <= 1):
                    masks[c] = m
                    visit(c, m)
                self.matcher.rollback(1)

        visit(-1, root)
        keep = sorted(masks)
        return Walk(tree if len(keep) == len(tree) else subtree(tree, keep), keep,
                    torch.stack([root] + [masks[i] for i in keep]))


def subtree(tree: DraftTree, keep: list[int]) -> DraftTree:
    """The nodes `keep` (ascending, closed under parents) of `tree`, in its order, with their draws."""
    at = {old: new for new, old in enumerate(keep)}
    idx = torch.tensor(keep, dtype=torch.long)
    parents = torch.tensor([at[int(p)] if p >= 0 else -1 for p in tree.parents[idx].tolist()], dtype=torch.long)
    return DraftTree(tree.tokens[idx], parents, None if tree.q is None else tree.q[idx], tree.draw,
                     None if tree.kinds is None else tuple(tree.kinds[i] for i in keep),
                     None if tree.groups is None else tree.groups[idx])


def masked(logits: torch.Tensor, masks: torch.Tensor) -> torch.Tensor:
    """The logits [n, V] with the tokens each row's mask forbids at -inf (zero probability; argmax over the rest)."""
    return logits.masked_fill(~masks, float("-inf"))
