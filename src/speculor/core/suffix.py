"""SuffixDecoding's index (Oliaro et al., NeurIPS 2025; Arctic Inference's suffix tree): a trie over every suffix of
some token sequences, cut at `max_depth` tokens, and the draft trees read off it (docs/algorithms.md §15). Pure
Python: no torch, no model.

    count(s)   how often the token string s occurs in the indexed sequences (overlaps included): the count of the
               node that s leads to from the root. Appending a token t to a sequence adds one occurrence of every
               suffix that ends at t, lengths 1..D (D = max_depth): O(D) node visits per token.
    match      the longest tail s of the context with |s| <= D // 2 whose node has children, i.e. s was followed by
               something before. Having children is monotone in |s| (if s·x occurs, so does s[1:]·x): a binary
               search finds it. The cap leaves at least D - D // 2 tokens of continuation below every match.
    P(u)       for a node u below the match m, the empirical probability of its path over the occurrences that
               were followed: P(u) = Π count(child) / followed(parent) along m -> u, followed(v) = Σ count of v's
               children (count(v) less the occurrences that end there: the context's own, unfinished one). A
               continuation seen once after every earlier occurrence is P = 1 (Arctic Inference divides by count(v),
               1/2 there; here the cost curve prices each node by P, and the match-length trust corrects it).
    draft      best-first by P: at most min(budget, ⌈factor · |s|⌉) nodes (Arctic's max_spec_factor: a short match
               drafts little), each with P >= min_prob. P never rises along a path, so a node's parent is always
               taken before it and every prefix of the order is a tree.

`SuffixTrie` indexes the sequences of one owner (a request's prompt and output; no lock). `SuffixCache` keeps the
outputs of many requests in one trie shared across requests, behind a lock, with at most `max_tokens` tokens: when
a sequence grows past that, the oldest other sequences are evicted first (their occurrences counted out again).
"""

from __future__ import annotations

import heapq
import itertools
import math
import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass


class _Node:
    """A trie node: its count and children. Most nodes have at most one child (deep levels are chains), so the
    first child is kept in two slots and only the others in a dict: a node of a chain holds no dict."""

    __slots__ = ("count", "first_token", "first_child", "other_children")

    def __init__(self) -> None:
        self.count = 0
        self.first_token = -1  # the first child's token
        self.first_child: _Node | None = None  # the first child
        self.other_children: dict[int, _Node] | None = None  # the other children

    def get(self, t: int) -> _Node | None:
        if self.first_token == t:
            return self.first_child
        return self.other_children.get(t) if self.other_children else None

    def add(self, t: int) -> _Node:
        child = _Node()
        if self.first_child is None:
            self.first_token, self.first_child = t, child
        elif self.other_children is None:
            self.other_children = {t: child}
        else:
            self.other_children[t] = child
        return child

    def drop(self, t: int) -> None:
        if self.first_token != t:
            del self.other_children[t]
        elif self.other_children:  # another child takes the first slots
            self.first_token, self.first_child = next(iter(self.other_children.items()))
            del self.other_children[self.first_token]
        else:
            self.first_token, self.first_child = -1, None
        if not self.other_children:
            self.other_children = None

    def followed(self) -> int:
        """Occurrences followed by a token: the children's counts."""
        return sum(c.count for _, c in self.kids())

    def kids(self) -> list[tuple[int, _Node]]:
        """(token, child) of every child, the first child first."""
        if self.first_child is None:
            return []
        first = (self.first_token, self.first_child)
        return [first, *self.other_children.items()] if self.other_children else [first]


@dataclass(frozen=True)
class Candidate:
    """A draft tree read off a trie: tokens and parents (-1 = the root) in best-first order, P of every node, and
    the length of the context tail it was matched by (0: no match, nothing drafted)."""

    tokens: list[int]
    parents: list[int]
    probs: list[float]
    match: int = 0

    @property
    def depths(self) -> list[int]:
        """Each node's depth below the match (1: a child of it)."""
        d: list[int] = []
        for parent in self.parents:
            d.append(1 if parent < 0 else d[parent] + 1)
        return d

    @property
    def score(self) -> float:
        """Σ P: the expected number of accepted draft tokens if the counts were the target's law."""
        return sum(self.probs)


NOTHING = Candidate([], [], [], 0)


class SuffixTrie:
    """Every suffix of the indexed sequences, cut at `max_depth` tokens, with occurrence counts (module
    docstring). Several sequences may be indexed, each under its own id; `nodes` counts the trie's nodes."""

    def __init__(self, max_depth: int) -> None:
        assert max_depth >= 2, "a match and its continuation need two levels"
        self.max_depth = max_depth
        self.root = _Node()
        self.nodes = 0
        self._tails: dict[int, list[_Node]] = {}  # sequence id -> nodes of its suffixes of lengths 0.., D - 1

    def extend(self, tokens: Sequence[int], seq: int = 0) -> None:
        """Append `tokens` to sequence `seq` (a new one starts empty): count one more occurrence of every suffix
        ending at each of them."""
        tail = self._tails.get(seq, [self.root])
        depth = self.max_depth
        for t in tokens:
            nxt = [self.root]
            for node in tail[:depth]:
                child = node.first_child if node.first_token == t else node.get(t)
                if child is None:
                    child = node.add(t)
                    self.nodes += 1
                child.count += 1
                nxt.append(child)
            tail = nxt
        self._tails[seq] = tail

    def remove(self, tokens: Sequence[int], seq: int) -> None:
        """Count sequence `seq` out again; `tokens` must be everything it was extended with. Nodes left with no
        occurrence are dropped (a node never counts more than its parent, so none is left orphaned)."""
        tail = [self.root]
        for t in tokens:
            nxt = [self.root]
            for node in tail[:self.max_depth]:
                child = node.get(t)
                child.count -= 1
                if child.count == 0:
                    node.drop(t)
                    self.nodes -= 1
                nxt.append(child)
            tail = nxt
        self._tails.pop(seq, None)

    def find(self, pattern: Sequence[int]) -> _Node | None:
        """The node `pattern` leads to from the root, None if it never occurred."""
        node = self.root
        for t in pattern:
            node = node.get(t)
            if node is None:
                return None
        return node

    def match(self, context: Sequence[int]) -> tuple[int, _Node | None]:
        """(length, node) of the longest tail of `context` (at most max_depth // 2 tokens) that was followed by
        something before; (0, None) if none was."""
        lo, hi, best = 1, min(len(context), self.max_depth // 2), (0, None)
        while lo <= hi:  # having children is monotone in the tail's length (module docstring)
            mid = (lo + hi) // 2
            node = self.find(context[len(context) - mid:])
            if node is not None and node.first_child is not None:
                best, lo = (mid, node), mid + 1
            else:
                hi = mid - 1
        return best

    def propose(self, context: Sequence[int], budget: int, min_prob: float, factor: float = math.inf) -> Candidate:
        """The draft tree after `context`: the longest match's most likely continuations, best-first by P, at most
        min(budget, ⌈factor · match⌉) nodes with P >= min_prob (module docstring)."""
        length, node = self.match(context)
        if factor * length < budget:  # (compared first: ⌈inf⌉ has no int)
            budget = math.ceil(factor * length)
        if node is None or budget < 1:
            return NOTHING
        tokens, parents, probs = [], [], []
        order = itertools.count()  # ties: the earlier pushed (shallower, first seen) first
        heap = [(-c.count / node.followed(), next(order), -1, t, c) for t, c in node.kids()]
        heap = [h for h in heap if -h[0] >= min_prob]
        heapq.heapify(heap)
        while heap and len(tokens) < budget:
            neg, _, parent, t, child = heapq.heappop(heap)
            i = len(tokens)
            tokens.append(t)
            parents.append(parent)
            probs.append(-neg)
            followed = child.followed()
            for t2, c2 in child.kids():
                p = -neg * c2.count / followed
                if p >= min_prob:
                    heapq.heappush(heap, (-p, next(order), i, t2, c2))
        return Candidate(tokens, parents, probs, length)


class SuffixCache:
    """The trie of many requests' outputs, shared by every request of a strategy (thread-safe: one lock). At most
    `max_tokens` tokens are kept: a sequence that would pass the bound evicts the oldest other sequences first, and
    when it alone fills the bound the rest of it is not kept. `open` gives a new sequence id; an id whose sequence
    was evicted starts again, empty, as the newest."""

    def __init__(self, max_depth: int, max_tokens: int) -> None:
        self.trie = SuffixTrie(max_depth)
        self.max_tokens = max_tokens
        self.tokens = 0  # tokens kept, all sequences together
        self._seqs: OrderedDict[int, list[int]] = OrderedDict()  # id -> its tokens, oldest first
        self._full: set[int] = set()  # sequences cut at the bound: the rest of them is not kept
        self._ids = itertools.count()
        self._lock = threading.Lock()

    def open(self) -> int:
        with self._lock:
            return next(self._ids)

    def extend(self, seq: int, tokens: Sequence[int]) -> None:
        """Append `tokens` to sequence `seq`, evicting the oldest other sequences while the bound is passed."""
        with self._lock:
            if seq in self._full:
                return
            tokens = list(tokens)
            kept = self._seqs.setdefault(seq, [])
            for old in list(self._seqs):
                if self.tokens + len(tokens) <= self.max_tokens:
                    break
                if old != seq:
                    gone = self._seqs.pop(old)
                    self.trie.remove(gone, old)
                    self.tokens -= len(gone)
                    self._full.discard(old)
            room = self.max_tokens - self.tokens
            if len(tokens) > room:  # alone past the bound: keep what fits, then nothing more of it
                tokens = tokens[:room]
                self._full.add(seq)
            self.trie.extend(tokens, seq)
            kept += tokens
            self.tokens += len(tokens)

    def propose(self, context: Sequence[int], budget: int, min_prob: float, factor: float = math.inf) -> Candidate:
        with self._lock:
            return self.trie.propose(context, budget, min_prob, factor)

    def clear(self) -> None:
        """Forget every sequence (a running one's later tokens start it again)."""
        with self._lock:
            self.trie = SuffixTrie(self.trie.max_depth)
            self.tokens = 0
            self._seqs.clear()
            self._full.clear()

    def sequences(self) -> dict[int, list[int]]:
        """A copy of the sequences kept, oldest first."""
        with self._lock:
            return {k: list(v) for k, v in self._seqs.items()}
