"""Values of a dynamic draft tree (DySpec, docs/algorithms.md §5): the tree as it grows, the value of each draw,
and whether one more draw or depth pays on this machine (the goodput rule, core/goodput.py).

Glossary (q is the draft distribution): v(u) = Π q along the path root -> u; R_u = q(·|ctx(u)) with u's children
drawn so far removed (m_u = Σ R_u); a draw's value v(u) · m_u is known before the token is seen.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch

from speculor.config import SamplingConfig
from speculor.core import goodput, priors
from speculor.core.goodput import BatchLedger
from speculor.core.sampling import check_finite, sample, warp
from speculor.core.tree import DraftTree
from speculor.runtime.cost import CostModel

# At temperature 0 the values come from softmax(logits / GREEDY_VALUE_TEMPERATURE): greedy matching accepts the
# draft's top token more often, and its runners-up less often, than softmax at temperature 1 says. Its value and the
# bench it was picked on: data/priors.json "dyspec.greedy_value_temperature" (docs/bench/README.md, "DySpec's value
# temperature").
GREEDY_VALUE_TEMPERATURE = priors.value("dyspec.greedy_value_temperature")


def value_distribution(logits: torch.Tensor, cfg: SamplingConfig, temperature: float | None) -> torch.Tensor:
    """q [V] fp32 that draws (T > 0) and values use: W(logits) at the drafter's temperature; at temperature 0,
    where draws are deterministic, softmax(logits / temperature) for the values alone (GREEDY_VALUE_TEMPERATURE
    unless given). Any value function is exact at temperature 0: the draws are the top remaining tokens."""
    check_finite(logits, "draft")
    if cfg.greedy:
        return torch.softmax(logits.float() / (temperature or GREEDY_VALUE_TEMPERATURE), dim=-1)
    return warp(logits, cfg if temperature is None else replace(cfg, temperature=temperature))


def pick(r: torch.Tensor, greedy: bool, generator: torch.Generator | None) -> int:
    """The next draw from the remaining mass R (unnormalised): y ~ R / ΣR, or argmax R (lowest id) when greedy."""
    return int(torch.argmax(r)) if greedy else sample(r / r.sum(), generator)


def expected_gain(v: float, r: torch.Tensor) -> float:
    """E[v(child)] of the next draw before it is made: v · Σ_y (R(y)/m) q(y) = v · ΣR² / m (R(y) = q(y) if undrawn)."""
    m = float(r.sum())
    return v * float((r * r).sum()) / m if m > 0 else 0.0


def steer(t: float, size: int, cap: int) -> float:
    """The next step's threshold: up 1.5x when the tree hit the cap, down 1.2x when it used < 3/4 of it, in
    [1e-4, 0.5]. With a binding cap the threshold variant spends it on shallow draws before deeper, better ones;
    with t at the heap's last draw value it builds the heap's tree (§5.2). t depends only on earlier steps, so
    the decision to draw still uses only the past: exact."""
    if size >= cap:
        return min(t * 1.5, 0.5)
    return max(t / 1.2, 1e-4) if size < 0.75 * cap else t


def worth(cost: CostModel, n: int, value_sum: float, draft_s: float, gain: float, extra_nodes: int = 1,
          extra_draft_s: float = 0.0, batch: BatchLedger | None = None) -> bool:
    """Does adding `extra_nodes` draft tokens of estimated value `gain` (and `extra_draft_s` of draft forwards)
    raise the estimated tokens per second of the step (core/goodput.py)? tokens ≈ 1 + Σ v, rows = n + 1:

        (1 + S + gain) / (draft_s + extra + t_target(n + extra_nodes + 1))  >  (1 + S) / (draft_s + t_target(n + 1))

    In a batch (docs/algorithms.md §11) the step is the batch's: the other requests' expected tokens T_o, draft
    seconds D_o and target rows R_o join both sides, so one more row must pay for the whole batch's forward
    growing, and at high load nothing does.
    """
    t_o, r_o, d_o = goodput.rest_of_batch(batch, cost)
    now = goodput.rate(cost, t_o + 1 + value_sum, r_o + n + 1, d_o + draft_s)
    then = goodput.rate(cost, t_o + 1 + value_sum + gain, r_o + n + extra_nodes + 1, d_o + draft_s + extra_draft_s)
    return then > now


@dataclass
class Slot:
    """A node that draws children: v = v(u), conf = q of its own token (v(u) / v(parent); 1 at the root),
    r = remaining mass R_u (None until its draft forward), q = q(·|ctx(u))."""

    v: float
    depth: int
    conf: float = 1.0
    r: torch.Tensor | None = None
    q: torch.Tensor | None = None
    drawn: int = 0  # children drawn so far

    def draw_value(self) -> float:
        """v(u) · m_u; m_u = 1 exactly before the first draw (q sums to 1), so both variants see the same values."""
        return self.v * float(self.r.sum()) if self.drawn else self.v

    def fill(self, q: torch.Tensor) -> None:
        self.q, self.r = q, q.clone()


@dataclass
class Growth:
    """The tree being grown: nodes in creation order (siblings in draw order), their values and q rows."""

    tokens: list[int] = field(default_factory=list)
    parents: list[int] = field(default_factory=list)
    values: list[float] = field(default_factory=list)
    qs: list[torch.Tensor] = field(default_factory=list)
    draw_values: list[float] = field(default_factory=list)  # value of the draw that made each node
    rows: dict[int, int] = field(default_factory=dict)  # node (-1 = root) -> pending row in the draft cache
    draft_s: float = 0.0  # estimated seconds of draft forwards so far (auto budget)

    def __len__(self) -> int:
        return len(self.tokens)

    def draw(self, node: int, slot: Slot, greedy: bool, generator: torch.Generator | None) -> int:
        """Make u's next draw: y from R_u, a child of value v(u)·q(y); R_u loses y. Returns the child."""
        self.draw_values.append(slot.draw_value())
        y = pick(slot.r, greedy, generator)
        self.tokens.append(y)
        self.parents.append(node)
        self.values.append(slot.v * float(slot.q[y]))
        self.qs.append(slot.q)
        slot.r[y] = 0
        slot.drawn += 1
        return len(self.tokens) - 1

    def tree(self, greedy: bool) -> DraftTree:
        tokens = torch.tensor(self.tokens, dtype=torch.long)
        parents = torch.tensor(self.parents, dtype=torch.long)
        if greedy or not self.tokens:
            return DraftTree(tokens, parents, None, "point")
        return DraftTree(tokens, parents, torch.stack(self.qs), "swor")
