"""DySpec's drafter (docs/algorithms.md §5): a dynamic token tree grown greedily at run time by the estimated value of
each draw. Shared by the strategies that draft it: `dyspec` (a draft model, drafters/dyspec.py) and `eagle` (a head
on the target's features, drafters/eagle.py).

Glossary (the paper's names; q is the draft distribution, p the target's):
    v(u)        value of node u = Π q(token | context) along the path root -> u (v(root) = 1): under DySpec's
                Hypothesis 1 (acceptance rises with q) an estimate of the probability that verification reaches u.
    R_u         q(·|ctx(u)) with the tokens of u's children drawn so far removed (unnormalised); m_u = Σ R_u.
    draw value  the value of u's *next* draw, v(u) · m_u = Π q(ancestors) × (1 - Σ q(earlier siblings)). It is
                known before the token is seen; the drawn child y gets v(u) · q(y).
Both variants make the decision to draw from the draw value alone (the past), then draw y ~ R_u / m_u, i.e.
siblings are sampled without replacement (SWOR) in draw order, and verification is Sequoia's SWOR rule (§2:
"number of siblings decided online from earlier siblings: exact"). Pruning a child *after* seeing its token
(by v(u)·q(y)) is biased and never done.

    heap       §5.1 (Alg. 1), fixed budget: a max-heap of draw values; pop the best draw, sample it, push the
               node's next draw and the child's first draw. The child's q needs a draft forward on it; forwards
               are made lazily when a node's first draw is popped, batching up to `batch` of the best heap
               entries still lacking q into one forward (the tree is the same as with one row per forward:
               forwards consume no randomness). Draft forwards ≈ internal nodes / batch.
    threshold  §5.2 (Alg. 2), layer by layer: one batched draft forward over the nodes of a depth, then their
               draws in decreasing draw value while the value is >= t, capped at `budget` nodes. Draft forwards
               = depth. With t = the last draw value the heap variant takes, and the same budget, both build the
               same tree (given the same draws). A binding cap is spent on shallow draws first, so by default t
               is steered between steps to keep the tree under the cap (`steer`); a given threshold stays fixed.
At temperature 0 the draws are deterministic (the most likely remaining token; values from softmax(logits /
GREEDY_VALUE_TEMPERATURE)) and verification is greedy matching. `budget="auto"` (threshold or heap) grows while this
machine's cost model (runtime.cost.CostModel) says a draw or a layer raises the estimated tokens per second,
estimated tokens = 1 + Σ v.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Generator
from dataclasses import dataclass
from typing import Any, Literal

import torch

from speculor.config import SamplingConfig, check_int, is_int, is_num
from speculor.core import goodput, priors
from speculor.core.goodput import MARGIN, BatchLedger
from speculor.core.tree import EMPTY, DraftTree
from speculor.core.verify import Verdict
from speculor.drafters.base import BatchAware, Proposal, behind, catch_up, feed, keep_fed_path
from speculor.drafters.values import Growth, Slot, expected_gain, steer, value_distribution, worth
from speculor.errors import SpeculorError
from speculor.runtime.backend import Backend
from speculor.runtime.cost import CostModel

Variant = Literal["heap", "threshold"]
AUTO_CAP = 64  # most draft tokens per step with budget="auto"
AUTO_THRESHOLD = 1e-3  # smallest draw value with budget="auto" (the cost model decides above it)
# prior of the share of steps whose first draft token is accepted (batch-aware auto budget): data/priors.json
# "dyspec.first_rate" (no fit recorded)
FIRST_RATE = priors.value("dyspec.first_rate")


# ---------------------------------------------------------------- options


@dataclass(frozen=True)
class DySpecOptions:
    """variant: "threshold" (default: `depth` draft forwards per step) or "heap"; budget: most draft tokens per
    step, or "auto" (at most AUTO_CAP, grown while the machine's cost model says it pays); threshold: smallest
    draw value drawn (threshold variant), fixed; by default it starts at 1 / budget (the paper's t ≈ 1/n) and is
    steered between steps so that the cap rarely binds (`steer`; AUTO_THRESHOLD, fixed, with auto);
    depth: most draft tokens on a path; temperature: the draft's sampling temperature (default: the target's;
    the paper fixes 0.6), at temperature 0 the values' (default GREEDY_VALUE_TEMPERATURE); batch: most rows per
    lazy draft forward of the heap variant."""

    variant: Variant = "threshold"
    budget: int | str = 16
    threshold: float | None = None
    depth: int = 8
    temperature: float | None = None
    batch: int = 4

    def __post_init__(self) -> None:
        if self.variant not in ("heap", "threshold"):
            raise SpeculorError(f"variant must be 'heap' or 'threshold', got {self.variant!r}")
        if self.budget != "auto" and (not is_int(self.budget) or not 1 <= self.budget <= 1024):
            raise SpeculorError(f"budget must be an integer in [1, 1024] or 'auto', got {self.budget!r}")
        if self.threshold is not None and (not is_num(self.threshold) or not 0 <= self.threshold <= 1):
            raise SpeculorError(f"threshold must be a number in [0, 1], got {self.threshold!r}")
        check_int("depth", self.depth, 1, 64)
        if self.temperature is not None and (not is_num(self.temperature) or not 0 < self.temperature < 1e6):
            raise SpeculorError(f"temperature must be a number > 0, got {self.temperature!r}")
        check_int("batch", self.batch, 1, 64)

    @property
    def cap(self) -> int:
        return AUTO_CAP if self.budget == "auto" else int(self.budget)

    @property
    def t(self) -> float:
        """The threshold to start from (fixed unless `adaptive`)."""
        if self.threshold is not None:
            return float(self.threshold)
        return AUTO_THRESHOLD if self.budget == "auto" else 1.0 / self.cap

    @property
    def adaptive(self) -> bool:
        """Threshold variant, fixed budget, no threshold given: t is steered between steps (`steer`)."""
        return self.variant == "threshold" and self.threshold is None and self.budget != "auto"




# ---------------------------------------------------------------- the drafter


class DySpecDrafter(BatchAware):
    """DySpec's dynamic tree from a draft model (module docstring): the heap or the threshold variant.

    After `propose`: `values[i]` = v(node i), `draw_values[i]` = the value of the draw that made node i, `rows`
    = node -> pending row of the draft cache (fed nodes), `stats` = numbers of the step; forwards = draft
    forwards of the step (the catch-up forward included)."""

    def __init__(self, model: Backend, opts: DySpecOptions | None = None, cost: CostModel | None = None) -> None:
        self.model, self.opts, self.cost = model, opts or DySpecOptions(), cost
        self.cache = model.new_cache()
        if self.opts.budget == "auto" and cost is None:
            raise SpeculorError("dyspec with budget='auto' needs the machine's cost model")
        self.forwards = 0
        self.rows: dict[int, int] = {}
        self.values: list[float] = []
        self.draw_values: list[float] = []
        self.stats: dict[str, float] = {}
        self.t = self.opts.t  # the threshold variant's current threshold
        self.batch_aware = self.auto  # sized for the batch when run in one (`ledger`, set by the batched engine)
        self.ledger: BatchLedger | None = None
        self.expected_tokens = 1.0  # 1 + Σ v of the last proposal
        self.first_rate = FIRST_RATE  # moving average of steps whose first draft token was accepted
        self.first_len = 0  # len(seq) at its first proposal
        self.skipped = False  # the last step drafted nothing (the batch is better off decoding this request plainly)
        self.estimate = (1, 1.0)  # (rows, tokens) of the last tree (none: a root): what the batch counts this
        # request as while its tree is still growing

    @property
    def auto(self) -> bool:
        return self.opts.budget == "auto"

    def reset(self) -> None:
        self.cache = self.model.new_cache()
        self.t = self.opts.t

    def propose(self, seq: list[int], cfg: SamplingConfig, generator: torch.Generator | None) -> Proposal:
        self.skipped = self.auto and (not self.can_pay if self.ledger is None
                                      else not (yield from self._speculation_pays(seq, cfg)))
        if self.skipped:  # decided from earlier steps and the batch alone: exact; the draft cache catches up later
            return self.decline()
        growth = Growth(draft_s=self._t_draft(1))
        self._publish(growth)
        logits = yield from catch_up(self.model, self.cache, seq)
        self.forwards = 1
        root = Slot(1.0, 0)
        root.fill(value_distribution(logits, cfg, self.opts.temperature))
        if self.opts.variant == "heap":
            yield from self._grow_heap(growth, root, cfg, generator)
        else:
            yield from self._grow_layers(growth, root, cfg, generator)
        self.rows, self.values, self.draw_values = growth.rows, growth.values, growth.draw_values
        self.expected_tokens = 1 + sum(growth.values)
        self.stats = {"nodes": len(growth), "value_sum": sum(growth.values), "fed_rows": len(growth.rows),
                      "threshold": self.t}
        self.estimate = (1 + len(growth), self.expected_tokens)
        self._publish(growth, grown=True)
        if self.opts.adaptive:
            self.t = steer(self.t, len(growth), self.opts.cap)
        return growth.tree(cfg.greedy)

    def decline(self) -> DraftTree:
        """This step drafts nothing (`skipped`): the empty tree, and the batch counts the request as its root."""
        self.skipped = True
        self.forwards, self.rows, self.values, self.draw_values, self.expected_tokens = 0, {}, [], [], 1.0
        self.stats = {"nodes": 0, "value_sum": 0.0, "fed_rows": 0, "threshold": self.t}
        self.estimate = (1, 1.0)  # no tree is its last tree: the batch counts it as its root from now on
        if self.ledger is not None:
            self.ledger.publish(*self.estimate)
        return EMPTY

    def observe(self, n_committed: int, verdict: Verdict) -> None:
        if self.skipped:
            return
        assert self.cache.length == n_committed, "the draft cache must hold exactly the committed tokens"
        keep_fed_path(self.cache, self.rows, verdict.path)
        if self.auto:
            self.first_rate = 0.9 * self.first_rate + 0.1 * bool(verdict.path)

    @property
    def can_pay(self) -> bool:
        """Alone: could a chain of k <= depth draft tokens pay even if every one were accepted, by more than the cost
        model's error band (MARGIN; core/goodput.chain_can_pay)?"""
        return goodput.chain_can_pay(self.cost, self.opts.depth, MARGIN)

    def _speculation_pays(self, seq: list[int], cfg: SamplingConfig) -> Generator[Any, Any, bool]:
        """In a batch: is a first draft token worth its row, at the rate first tokens were accepted so far? Its
        catch-up (the whole prompt at first) is charged over the steps left (§11.1). Never beside a prompt chunk."""
        if self.ledger.filling:
            return False
        self.first_len = self.first_len or len(seq)
        left = max(cfg.max_new_tokens - (len(seq) - self.first_len + 1), 1)  # tokens still to generate
        once = (self._t_draft(behind(self.cache, seq)) - self._t_draft(1)) * (1 + self.first_rate) / left
        return (yield from self._round_pays(Growth(), self.first_rate, 1, 1, once))

    # -------------------------------------------------------- §5.1: fixed budget, a heap of draw values

    def _grow_heap(self, growth: Growth, root: Slot, cfg: SamplingConfig,
                   generator: torch.Generator | None) -> Generator[Any, Any, None]:
        """Alg. 1: pop the best draw; draw it; push the node's next draw and the child's first draw."""
        t = self.opts.threshold if self.opts.threshold is not None else (AUTO_THRESHOLD if self.auto else 0.0)
        slots, order = {-1: root}, itertools.count()
        heap = [(-1.0, next(order), -1)]
        while heap and len(growth) < self.opts.cap:
            neg_value, _, node = heapq.heappop(heap)
            slot = slots[node]
            if -neg_value < t or not self._draw_pays(growth, slot):
                break  # draw values only fall from here on
            if slot.r is None:
                yield from self._fetch(growth, [node] + self._lacking(heap, slots), slots, cfg)
            child = growth.draw(node, slot, cfg.greedy, generator)
            if float(slot.r.sum()) > 0:
                heapq.heappush(heap, (-slot.draw_value(), next(order), node))
            if slot.depth + 1 < self.opts.depth:
                slots[child] = Slot(growth.values[child], slot.depth + 1, float(slot.q[growth.tokens[child]]))
                heapq.heappush(heap, (-growth.values[child], next(order), child))

    def _lacking(self, heap: list, slots: dict[int, Slot]) -> list[int]:
        """Up to batch - 1 of the best heap entries whose q is still unknown (fed along in the same forward)."""
        waiting = [e for e in heap if slots[e[2]].r is None]
        return [e[2] for e in heapq.nsmallest(self.opts.batch - 1, waiting)]

    # -------------------------------------------------------- §5.2: threshold, layer by layer

    def _grow_layers(self, growth: Growth, root: Slot, cfg: SamplingConfig,
                     generator: torch.Generator | None) -> Generator[Any, Any, None]:
        """Alg. 2: per depth, draw from the layer's nodes while the draw value is >= t, then feed the new nodes
        that will draw (value >= t, depth left) in one batched draft forward."""
        layer = {-1: root}
        while layer:
            new = self._draw_layer(growth, layer, cfg, generator)
            expand = {c: s for c, s in new.items() if s.depth < self.opts.depth and s.v >= self.t}
            if not expand or len(growth) >= self.opts.cap or not (yield from self._layer_pays(growth, expand)):
                return
            yield from self._fetch(growth, list(expand), expand, cfg)
            layer = expand

    def _draw_layer(self, growth: Growth, layer: dict[int, Slot], cfg: SamplingConfig,
                    generator: torch.Generator | None) -> dict[int, Slot]:
        """The draws of one depth, best draw value first across the layer's nodes; the new children's slots."""
        order = itertools.count()
        heap = [(-s.draw_value(), next(order), u) for u, s in layer.items()]
        heapq.heapify(heap)
        new: dict[int, Slot] = {}
        while heap and len(growth) < self.opts.cap:
            neg_value, _, u = heapq.heappop(heap)
            slot = layer[u]
            if -neg_value < self.t or not self._draw_pays(growth, slot):
                break
            child = growth.draw(u, slot, cfg.greedy, generator)
            new[child] = Slot(growth.values[child], slot.depth + 1, float(slot.q[growth.tokens[child]]))
            if float(slot.r.sum()) > 0:
                heapq.heappush(heap, (-slot.draw_value(), next(order), u))
        return new

    # -------------------------------------------------------- draft forwards and the auto budget

    def _fetch(self, growth: Growth, nodes: list[int], slots: dict[int, Slot],
               cfg: SamplingConfig) -> Generator[Any, Any, None]:
        """One batched draft forward over `nodes` (each a drafted node whose parent was fed): their q."""
        parent_rows = [growth.rows.get(growth.parents[n], -1) for n in nodes]
        growth.draft_s += self._t_draft(len(nodes))
        self._publish(growth)  # in a batch the other requests take their turns while this forward waits for theirs
        logits, rows = yield from feed(self.model, self.cache, [growth.tokens[n] for n in nodes], parent_rows)
        self.forwards += 1
        for i, n in enumerate(nodes):
            growth.rows[n] = rows[i]
            slots[n].fill(value_distribution(logits[i], cfg, self.opts.temperature))

    def _t_draft(self, rows: int) -> float:  # a draft forward of `rows` rows alone (`settle` prices shared rounds)
        return self.cost.t_draft(rows) if self.cost is not None else 0.0

    def _publish(self, growth: Growth, grown: bool = False) -> None:
        """Tell the batch this request's rows and expected tokens: the tree so far, at least its last tree's until
        it is `grown` (so that the requests after it do not take it for a root it will outgrow)."""
        if self.ledger is not None:
            rows, tokens = 1 + len(growth), 1 + sum(growth.values)
            if not grown:
                rows, tokens = max(rows, self.estimate[0]), max(tokens, self.estimate[1])
            self.ledger.publish(rows, tokens)

    def _draw_pays(self, growth: Growth, slot: Slot) -> bool:
        """auto: is the next draw worth its target time? Its expected value is known before the draw (with an
        unknown q, the node's own confidence stands in for it and the draft forward is charged)."""
        if not self.auto or not len(growth):
            return True  # a fixed budget; or the first draw, which speculation always makes
        if slot.r is None:
            return worth(self.cost, len(growth), sum(growth.values), growth.draft_s, slot.v * slot.conf, 1,
                         self._t_draft(1), self.ledger)
        return worth(self.cost, len(growth), sum(growth.values), growth.draft_s, expected_gain(slot.v, slot.r),
                     batch=self.ledger)

    def _layer_pays(self, growth: Growth, expand: dict[int, Slot]) -> Generator[Any, Any, bool]:
        """auto: is one more depth worth a draft forward over `expand`? Each fed node's first draw is estimated
        at v(u) · q(u's token) (the draft's confidence persists)."""
        if not self.auto:
            return True
        return (yield from self._round_pays(growth, sum(s.v * s.conf for s in expand.values()), len(expand),
                                            len(expand)))

    def _round_pays(self, growth: Growth, gain: float, nodes: int, draft_rows: int,
                    once: float = 0.0) -> Generator[Any, Any, bool]:
        """Does a draft forward of `draft_rows` rows (and `once` seconds charged this step) adding `nodes` nodes worth
        `gain` pay? In a batch all bids for a round are weighed together, the round priced once (`settle`)."""
        if self.ledger is not None:
            self._publish(growth, grown=True)  # what it commits to now, for the joint weighing
            if (joint := (yield from self.ledger.round(self.cost, gain, nodes, draft_rows, once))) is not None:
                return joint
        return worth(self.cost, len(growth), sum(growth.values), growth.draft_s, gain, nodes,
                     self._t_draft(draft_rows) + once, self.ledger)
