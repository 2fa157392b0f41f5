"""Sequoia (docs/algorithms.md §4) as the `sequoia` strategy: the DP-optimal static tree for the pair's acceptance
vector, children drawn without replacement and verified with the SWOR rule (top-k and greedy matching at
temperature 0), sized for this machine with `budget="auto"`.

Shared per pair (`SequoiaPlans`): the acceptance vector, the cost model and the plan (tree) made per (temperature,
top-p). Per request (`SequoiaDrafter`): a `TreeDrafter` of the plan's shape with its own draft cache. The DP lives
in `core/sequoia_dp.py`, the cost model in `runtime/cost.py`, calibration in `methods/sequoia_calibration.py`.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from importlib import resources
from pathlib import Path
from typing import Any

import torch

from speculor.config import SamplingConfig, check_int, is_int
from speculor.core import goodput
from speculor.core.goodput import MARGIN, BatchLedger
from speculor.core.sequoia_dp import Choice, choose_tree, optimal_trees, tree_choices
from speculor.core.tree import EMPTY
from speculor.core.verify import Verdict
from speculor.drafters.base import BatchAware, Proposal
from speculor.drafters.static_tree import TreeDrafter
from speculor.errors import SpeculorError
from speculor.runtime.assets import cache_dir, slug
from speculor.runtime.backend import Backend, Pair
from speculor.runtime.cost import CostModel
from speculor.runtime.profiling import machine_cost

logger = logging.getLogger("speculor")


# ---------------------------------------------------------------- the acceptance vector (§4.1)


@dataclass(frozen=True)
class Calibration:
    """counts[k - 1] = calibration steps whose accepted draft token was the k-th child of the root, out of `steps`;
    acc[k] = counts[k - 1] / steps. At temperature 0, "accepted" means the k-th ranked (top-k) child matched."""

    target: str
    draft: str
    temperature: float
    top_p: float
    counts: tuple[int, ...]
    steps: int
    prompts: int = 0
    sets: str = ""

    @property
    def acc(self) -> list[float]:
        return [c / max(self.steps, 1) for c in self.counts]

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "counts": list(self.counts), "acc": self.acc}

    @staticmethod
    def from_dict(d: dict[str, Any]) -> Calibration:
        fields = ("target", "draft", "temperature", "top_p", "steps", "prompts", "sets")
        return Calibration(**{k: d[k] for k in fields if k in d}, counts=tuple(int(c) for c in d["counts"]))

    def save(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.to_dict(), indent=1))


def calibration_path(target: str, draft: str, temperature: float, top_p: float) -> Path:
    name = f"acc--{slug(target)}--{slug(draft)}--T{temperature:g}--p{top_p:g}.json"
    return cache_dir() / "sequoia" / name


def builtin_calibrations() -> list[Calibration]:
    """Acceptance vectors measured on the embedded pair (package data `data/sequoia_acc.json`)."""
    text = resources.files("speculor").joinpath("data/sequoia_acc.json").read_text()
    return [Calibration.from_dict(d) for d in json.loads(text)["calibrations"]]


def _nearest(cals: list[Calibration], cfg: SamplingConfig) -> Calibration:
    """The built-in calibration closest to cfg: temperature 0 for greedy, else the nearest temperature > 0."""
    pool = [c for c in cals if (c.temperature == 0) == cfg.greedy] or cals
    return min(pool, key=lambda c: (abs(c.temperature - cfg.temperature), abs(c.top_p - cfg.top_p)))


def resolve_acc(spec: str | Sequence[float] | None, target: str, draft: str,
                cfg: SamplingConfig) -> tuple[list[float], str]:
    """(acc, where it came from): a given vector; a calibration JSON file; else the cached calibration of this
    pair at cfg's temperature and top-p (`speculor calibrate`); else the built-in vector of the embedded pair
    at the nearest temperature (documented fallback: the tree is then tuned for that pair, still lossless)."""
    if spec is not None and not isinstance(spec, str):
        return [float(a) for a in spec], "given"
    if spec is not None:
        return _load_acc(Path(spec).expanduser()), spec
    path = calibration_path(target, draft, cfg.temperature, cfg.top_p)
    if path.exists():
        return _load_acc(path), str(path)
    cal = _nearest(builtin_calibrations(), cfg)
    source = f"built-in ({cal.target} / {cal.draft}, T={cal.temperature:g}, top_p={cal.top_p:g})"
    logger.info("sequoia: no calibration at %s; using the %s acceptance vector", path, source)
    return cal.acc, source


def _load_acc(path: Path) -> list[float]:
    try:
        d = json.loads(path.read_text())
        acc = d["acc"] if "acc" in d else Calibration.from_dict(d).acc
        return [float(a) for a in acc]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise SpeculorError(f"cannot read an acceptance vector from {path}: {exc}; run `speculor calibrate`") from exc


# ---------------------------------------------------------------- the `sequoia` strategy

AUTO_NODES = 128  # --budget auto searches trees of up to this many verified tokens (root included)


@dataclass(frozen=True)
class SequoiaOptions:
    """budget: draft tokens per step (root excluded), or "auto" (the best tokens/s on this machine, §4.2);
    depth: most draft tokens on a path (D = depth + 1 levels); width: most children per node (B);
    acc: an acceptance vector, or the path of a calibration JSON (default: see `resolve_acc`)."""

    budget: int | str = 16
    depth: int = 8
    width: int = 8
    acc: str | tuple[float, ...] | None = None

    def __post_init__(self) -> None:
        if self.budget != "auto" and (not is_int(self.budget) or not 1 <= self.budget <= 1024):
            raise SpeculorError(f"budget must be an integer in [1, 1024] or 'auto', got {self.budget!r}")
        check_int("depth", self.depth, 1, 64)
        check_int("width", self.width, 1, 64)
        if isinstance(self.acc, str) and not Path(self.acc).expanduser().is_file():
            raise SpeculorError(f"no calibration file at {self.acc!r}; run `speculor calibrate`")
        if self.acc is not None and not isinstance(self.acc, str):
            object.__setattr__(self, "acc", tuple(float(a) for a in self.acc))
            if not self.acc or min(self.acc) < 0 or sum(self.acc) > 1 + 1e-6:
                raise SpeculorError(f"acc must be non-negative with a sum <= 1, got {self.acc!r}")



@dataclass(frozen=True)
class Plan:
    """The static tree used at one (temperature, top-p): its shape, F(T) and where acc came from."""

    shape: tuple[int, ...]
    expected_tokens: float
    acc_source: str
    choice: Choice | None = None  # set with budget="auto"


def plan_tree(acc: Sequence[float], opts: SequoiaOptions, cost: CostModel | None) -> tuple[tuple[int, ...], float,
                                                                                           Choice | None]:
    """The DP tree for a fixed budget (the largest feasible n <= budget + 1), or the tokens/s-optimal one."""
    acc = list(acc)[: opts.width]
    if opts.budget == "auto":
        assert cost is not None, "budget='auto' needs a cost model"
        choice = choose_tree(acc, cost, AUTO_NODES, opts.depth + 1)
        return choice.shape, choice.expected_tokens, choice
    table = optimal_trees(acc, opts.budget + 1, opts.depth + 1)
    n = table.largest_feasible(opts.budget + 1, opts.depth + 1)
    return tuple(table.shape(n, opts.depth + 1)), float(table.best[n, opts.depth + 1]), None


class SequoiaPlans:
    """What `sequoia` shares across requests: the draft model, the options, the cost model and the plans.

    The tree depends on the acceptance vector, which depends on the sampling settings of a request, so a plan
    is made per (temperature, top-p) on first use and kept (a memo: the same inputs give the same plan).
    """

    def __init__(self, draft: Backend, target_name: str, draft_name: str, opts: SequoiaOptions,
                 cost: CostModel | None = None) -> None:
        self.draft, self.names, self.opts, self.cost = draft, (target_name, draft_name), opts, cost
        self.plans: dict[tuple[float, float], Plan] = {}
        self._choices: dict[tuple[float, float], list[Choice]] = {}
        self._alone: dict[tuple[float, float], Choice | None] = {}

    def plan(self, cfg: SamplingConfig) -> Plan:
        key = (cfg.temperature, cfg.top_p)
        if key not in self.plans:
            acc, source = resolve_acc(self.opts.acc, *self.names, cfg)
            shape, expected, choice = plan_tree(acc, self.opts, self.cost)
            self.plans[key] = Plan(shape, expected, source, choice)
        return self.plans[key]

    def choices(self, cfg: SamplingConfig) -> list[Choice]:
        """budget="auto": the DP's tree for every size and depth it searches (kept per temperature and top-p)."""
        key = (-1.0 - cfg.temperature, cfg.top_p)  # beside the plans, apart from them
        if key not in self._choices:
            acc, _ = resolve_acc(self.opts.acc, *self.names, cfg)
            self._choices[key] = tree_choices(list(acc)[: self.opts.width], self.cost, AUTO_NODES, self.opts.depth + 1)
        return self._choices[key]

    def for_batch(self, cfg: SamplingConfig, ledger: BatchLedger, margin: float = 1.0) -> Choice | None:
        """The tree that maximises the batch's expected tokens per second given what the rest of the batch drafted
        (docs/algorithms.md §11), None when decoding this request plainly does (by `margin`):

            (T_o + F(T)) / (D_o + draft(T) + t_target(R_o + |T| + 1))   against   (T_o + 1) / (D_o + t_target(R_o + 1))
        """
        if ledger.filling:  # prompt chunks in the step: drafting would hold up their requests (dynamic_tree.py)
            return None
        t_o, r_o, d_o = goodput.rest_of_batch(ledger, self.cost)
        best, best_rate = None, margin * goodput.rate(self.cost, t_o + 1, r_o + 1, d_o)
        for c in self.choices(cfg):  # draft(T) as alone: a shared round is mostly paid whoever drafts (dynamic_tree.py)
            draft_s = c.step_s - self.cost.t_target(c.n)
            rate = goodput.rate(self.cost, t_o + c.expected_tokens, r_o + c.n, d_o + draft_s)
            if rate > best_rate:
                best, best_rate = c, rate
        return best

    def alone(self, cfg: SamplingConfig) -> Choice | None:
        """`for_batch` with no other request, by MARGIN: fixed per sampling setting, so decided once (a memo)."""
        key = (cfg.temperature, cfg.top_p)
        if key not in self._alone:
            self._alone[key] = self.for_batch(cfg, BatchLedger(), MARGIN)
        return self._alone[key]

    def drafter(self) -> SequoiaDrafter:
        return SequoiaDrafter(self)

    def forget(self) -> None:
        """Nothing learned across requests (its plans follow from the acceptance vector and the cost curve)."""


class SequoiaDrafter(BatchAware):
    """One request's Sequoia tree: children drawn without replacement (exponential keys) and verified with the
    SWOR rule; deterministic top-k children and greedy matching at temperature 0. A `TreeDrafter` of the plan's
    shape does the drafting (with this request's draft cache)."""

    def __init__(self, plans: SequoiaPlans) -> None:
        self.plans = plans
        self.cache = plans.draft.new_cache()  # this request's draft cache, whatever the tree's shape
        self.inner: TreeDrafter | None = None
        self.forwards = 0
        self.batch_aware = plans.opts.budget == "auto"  # sized for the batch when run in one (`ledger`)
        self.ledger: BatchLedger | None = None
        self.expected_tokens = 1.0  # F of the last tree
        self.skipped = False  # the last step drafted nothing: the batch is better off decoding this request plainly

    def reset(self) -> None:
        self.cache, self.inner = self.plans.draft.new_cache(), None

    def propose(self, seq: list[int], cfg: SamplingConfig, generator: torch.Generator | None) -> Proposal:
        plan = self.plans.plan(cfg)
        shape, self.expected_tokens = list(plan.shape), plan.expected_tokens
        if self.batch_aware:  # decided from the batch (alone: by MARGIN) and the plans: exact; a request that
            # decodes plainly never feeds its draft model
            alone = self.ledger is None
            choice = self.plans.alone(cfg) if alone else self.plans.for_batch(cfg, self.ledger)
            self.skipped = choice is None
            if self.skipped:
                self.forwards, self.expected_tokens = 0, 1.0
                return EMPTY
            shape, self.expected_tokens = list(choice.shape), choice.expected_tokens
            if not alone:
                self.ledger.publish(choice.n, choice.expected_tokens)  # before drafting: the requests after it see it
        if self.inner is None or self.inner.shape != shape:
            self.inner = TreeDrafter(self.plans.draft, shape, draw="swor", cache=self.cache)
        tree = yield from self.inner.propose(seq, cfg, generator)
        self.forwards = self.inner.forwards
        return tree

    def observe(self, n_committed: int, verdict: Verdict) -> None:
        if not self.skipped:
            self.inner.observe(n_committed, verdict)


def make_sequoia(pair: Pair, budget: int | str = 16, depth: int = 8, width: int = 8,
                 acc: str | Sequence[float] | None = None) -> SequoiaPlans:
    """Builder of the `sequoia` strategy (see `SequoiaOptions`); budget='auto' profiles the machine once."""
    if pair.draft is None:
        raise SpeculorError("strategy 'sequoia' needs a draft model")
    opts = SequoiaOptions(budget, depth, width, acc)  # type: ignore[arg-type]
    cost = machine_cost(pair) if budget == "auto" else None
    return SequoiaPlans(pair.draft, pair.target_name, pair.draft_name, opts, cost)
