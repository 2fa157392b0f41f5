"""Sequoia (ALGORITHMS.md §4): the DP-optimal static tree, its hardware-aware size, and the acceptance vector.

Glossary (the paper's names):
    acc[k]   acceptance vector, k = 1..B: the *marginal* probability that the k-th child (in draw order) of an
             accepted node is the one accepted, so Σ_k acc[k] <= 1 (§4.1). Measured by `calibrate`.
    f(v)     Π acc[rank] along the path root -> v, f(root) = 1.
    F(T)     Σ_{v ∈ T} f(v): expected tokens emitted per step of tree T (the root term is the recovered or
             bonus token) under the positional acceptance assumption.
    N, D, B  nodes including the root, levels including the root (a path holds at most D - 1 draft tokens),
             branching factor.
    shape    a static tree as a parents list in creation order: node i has parent shape[i] < i (-1 = the root),
             nodes listed depth by depth, a node's children in rank order (child k is drawn k-th and uses acc[k]).

Pure parts (no model): `optimal_trees` (the §4.2 DP), `TreeTable.shape`, `CostModel` and `choose_tree`
(maximise F / step time). Model parts: `profile_cost` (time the target per block size and the draft per
depth width), `calibrate` (measure acc through the engine), and `SequoiaDrafter`, the `sequoia` strategy.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import platform
import re
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace
from importlib import resources
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tqdm import tqdm

from speculor import engine
from speculor.assets import cache_dir
from speculor.config import SamplingConfig
from speculor.errors import SpeculorError
from speculor.kernels import linear_kinds
from speculor.models import LM, Pair
from speculor.verify import Verdict

logger = logging.getLogger("speculor")
NEG = -math.inf


# ---------------------------------------------------------------- the dynamic program (§4.2)


@dataclass(frozen=True)
class TreeTable:
    """Result of the DP for one acceptance vector.

    best  [N + 1, D + 1] f64  Tmax[n, d]: max F over trees of exactly n nodes (root included), at most d levels,
                              at most B children per node; -inf where no such tree exists (n = 0, d = 0, or
                              n beyond the capacity of depth d and branching B)
    kids  [N + 1, D + 1] i64  b*: number of root children of an optimal tree
    split [N + 1, D + 1, B + 1] i64  m*: nodes in the subtree of child b when the root has children 1..b
    """

    acc: np.ndarray
    best: np.ndarray
    kids: np.ndarray
    split: np.ndarray

    @property
    def n_max(self) -> int:
        return self.best.shape[0] - 1

    @property
    def d_max(self) -> int:
        return self.best.shape[1] - 1

    def feasible(self, n: int, d: int) -> bool:
        return 1 <= n <= self.n_max and 1 <= d <= self.d_max and self.best[n, d] > NEG

    def largest_feasible(self, n: int, d: int) -> int:
        """The largest n' <= n with a tree of n' nodes in d levels (Tmax is nondecreasing in n where finite)."""
        while not self.feasible(n, d):
            n -= 1
        return n

    def nested(self, n: int, d: int) -> list:
        """An optimal tree for (n, d) as nested lists: a node is the list of its children in rank order.

        Reconstruction of §4.2: b* = kids[n, d]; for b = b*, ..., 1 child b gets an optimal subtree of
        m* = split[n, d, b] nodes and depth d - 1, and n <- n - m*.
        """
        if not self.feasible(n, d):
            raise ValueError(f"no tree of {n} nodes within {d} levels and branching {len(self.acc)}")
        children = []
        for b in range(int(self.kids[n, d]), 0, -1):
            m = int(self.split[n, d, b])
            children.append(self.nested(m, d - 1))
            n -= m
        assert n == 1
        return children[::-1]

    def shape(self, n: int, d: int) -> list[int]:
        """An optimal tree for (n, d) as a parents list (depth by depth, children in rank order); len = n - 1."""
        return nested_to_shape(self.nested(n, d))


def optimal_trees(acc: Sequence[float], n_max: int, d_max: int) -> TreeTable:
    """The DP of §4.2 for every n <= n_max nodes and d <= d_max levels (root included), B = len(acc).

        T[1][d][0] = 1                                                   (the root alone)
        T[n][d][b] = max_{1<=m<=n-1} T[n-m][d][b-1] + acc[b] · Tmax[m][d-1]   (child b's subtree has m nodes)
        Tmax[n][d] = max_b T[n][d][b]

    Vectorised over d and m: O(N·B) numpy operations of size O(N·D). Time O(N²·D·B), memory O(N·D·B).
    """
    a = np.asarray(acc, dtype=np.float64)
    if a.ndim != 1 or len(a) == 0 or (a < 0).any() or not np.isfinite(a).all():
        raise ValueError(f"acc must be a non-empty vector of probabilities, got {acc!r}")
    if n_max < 1 or d_max < 1:
        raise ValueError(f"n_max and d_max must be >= 1, got {n_max}, {d_max}")
    nb = len(a)
    t = np.full((n_max + 1, d_max + 1, nb + 1), NEG)
    split = np.zeros((n_max + 1, d_max + 1, nb + 1), dtype=np.int64)
    best = np.full((n_max + 1, d_max + 1), NEG)
    t[1, 1:, 0] = 1.0
    best[1, 1:] = 1.0
    for n in range(2, n_max + 1):
        sub = best[1:n, 1:d_max]  # Tmax[m][d-1] for m = 1..n-1, d = 2..d_max   [n-1, d_max-1]
        for b in range(1, nb + 1):
            rest = t[n - 1:0:-1, 2:, b - 1]  # T[n-m][d][b-1] for the same m and d     [n-1, d_max-1]
            total = rest + np.where(sub > NEG, a[b - 1] * np.where(sub > NEG, sub, 0.0), NEG)
            arg = np.argmax(total, axis=0)
            t[n, 2:, b] = total[arg, np.arange(d_max - 1)]
            split[n, 2:, b] = arg + 1
        best[n, 2:] = t[n, 2:, 1:].max(axis=1)
    kids = np.argmax(t, axis=2)
    kids[best == NEG] = 0
    return TreeTable(a, best, kids, split)


def nested_to_shape(root: list) -> list[int]:
    """Nested children lists -> parents list in breadth-first order (so parents[i] < i and depths ascend)."""
    parents: list[int] = []
    frontier = [(-1, root)]
    while frontier:
        nxt = []
        for index, children in frontier:
            for child in children:
                parents.append(index)
                nxt.append((len(parents) - 1, child))
        frontier = nxt
    return parents


def expected_tokens(acc: Sequence[float], shape: Sequence[int]) -> float:
    """F(T) = Σ_v f(v) of a shape; the k-th child of a node (in the order listed) uses acc[k]."""
    f = [1.0]  # f of the root, then of every node (index i + 1)
    seen: dict[int, int] = {}
    for p in shape:
        rank = seen.get(p, 0)
        seen[p] = rank + 1
        f.append(f[p + 1] * (acc[rank] if rank < len(acc) else 0.0))
    return float(sum(f))


def level_widths(shape: Sequence[int]) -> list[int]:
    """Number of nodes at depth 1, 2, ... of a shape."""
    depth: list[int] = []
    for p in shape:
        depth.append(0 if p < 0 else depth[p] + 1)
    return [depth.count(k) for k in range(max(depth) + 1)] if depth else []


def feed_widths(shape: Sequence[int]) -> list[int]:
    """Per depth 1, 2, ...: the nodes that have children, i.e. the rows of each batched draft forward of
    `TreeDrafter` (the last depth is never fed); [] for a depth-1 tree."""
    has_kids = set(p for p in shape if p >= 0)
    depth: list[int] = []
    for p in shape:
        depth.append(0 if p < 0 else depth[p] + 1)
    widths = [0] * (max(depth) if depth else 0)
    for node in has_kids:
        widths[depth[node]] += 1
    return widths


# ---------------------------------------------------------------- hardware-aware size (§4.2)


@dataclass(frozen=True)
class CostModel:
    """Seconds of one forward pass, measured at a few block sizes and interpolated linearly.

    t_target(n): the target verifying a block of n tokens (root + n - 1 draft nodes) after a ~200-token prefix.
    t_draft(w):  one draft forward over w tokens (one depth of the tree, or the catch-up block).
    A step drafting shape T costs  t_target(|T| + 1) + t_draft(1) + Σ_{depth k < depth(T)} t_draft(w_k), w_k =
    nodes at depth k that have children: the catch-up forward gives q at the root, then `TreeDrafter` feeds
    those nodes of each depth but the last as one block (`feed_widths`).
    """

    target_n: tuple[int, ...]
    target_s: tuple[float, ...]
    draft_n: tuple[int, ...]
    draft_s: tuple[float, ...]
    meta: tuple[tuple[str, str], ...] = ()  # machine and model pair it was measured for

    def __post_init__(self) -> None:
        for n, s in ((self.target_n, self.target_s), (self.draft_n, self.draft_s)):
            if len(n) != len(s) or not n or list(n) != sorted(set(n)) or min(s) < 0:
                raise ValueError("a cost curve needs ascending distinct sizes and as many non-negative times")

    def t_target(self, n: int) -> float:
        return _interp(n, self.target_n, self.target_s)

    def t_draft(self, w: int) -> float:
        return _interp(w, self.draft_n, self.draft_s)

    def step_s(self, shape: Sequence[int]) -> float:
        """Seconds of one speculative step with this tree shape (plain decoding for an empty shape)."""
        draft = (self.t_draft(1) + sum(self.t_draft(w) for w in feed_widths(shape))) if shape else 0.0
        return self.t_target(len(shape) + 1) + draft

    def to_json(self) -> str:
        return json.dumps({**asdict(self), "meta": dict(self.meta)}, indent=1)

    @staticmethod
    def from_json(text: str) -> CostModel:
        d = json.loads(text)
        return CostModel(tuple(d["target_n"]), tuple(d["target_s"]), tuple(d["draft_n"]), tuple(d["draft_s"]),
                         tuple(sorted(d.get("meta", {}).items())))

    def save(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(self.to_json())

    @staticmethod
    def load(path: Path) -> CostModel:
        return CostModel.from_json(path.read_text())


def _interp(x: float, xs: Sequence[int], ys: Sequence[float]) -> float:
    """Piecewise-linear interpolation; linear extrapolation from the last two points beyond the largest x."""
    if len(xs) >= 2 and x > xs[-1]:
        slope = (ys[-1] - ys[-2]) / (xs[-1] - xs[-2])
        return float(ys[-1] + slope * (x - xs[-1]))
    return float(np.interp(x, xs, ys))


@dataclass(frozen=True)
class Choice:
    """The tree chosen for a machine: n nodes (root included), d levels, its shape, F and seconds per step."""

    n: int
    d: int
    shape: tuple[int, ...]
    expected_tokens: float
    step_s: float

    @property
    def tokens_per_s(self) -> float:
        return self.expected_tokens / self.step_s


def choose_tree(acc: Sequence[float], cost: CostModel, n_max: int, d_max: int, n_min: int = 2) -> Choice:
    """argmax over n_min <= n <= n_max, d <= d_max of G(n, d) / step time, G = Tmax[n][d] (§4.2):
    expected tokens per second, with the step time of the DP's own tree for (n, d) (`CostModel.step_s`)."""
    table = optimal_trees(acc, n_max, d_max)
    best: Choice | None = None
    for n in range(max(n_min, 1), n_max + 1):
        for d in range(1, d_max + 1):
            if not table.feasible(n, d) or (d > 1 and table.best[n, d] == table.best[n, d - 1]):
                continue  # a deeper limit that changes nothing gives the same tree
            shape = tuple(table.shape(n, d))
            c = Choice(n, d, shape, float(table.best[n, d]), cost.step_s(shape))
            if best is None or c.tokens_per_s > best.tokens_per_s:
                best = c
    if best is None:
        raise ValueError(f"no tree with {n_min}..{n_max} nodes within {d_max} levels")
    return best


# ---------------------------------------------------------------- profiling the machine

SIZES = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128)  # block sizes timed; others are interpolated


def _sync(lm: LM) -> None:
    if lm.device.type == "cuda":
        torch.cuda.synchronize(lm.device)


def time_forwards(lm: LM, sizes: Sequence[int], *, prefix: int = 200, repeats: int = 3,
                  bar: tqdm | None = None) -> list[float]:
    """Median seconds of one `lm.forward` over a block of n tokens after `prefix` committed tokens, per n.

    The repeats run in rounds over all sizes (not back to back), so a burst of load from another process
    spreads over sizes instead of inflating one. Uses its own cache on the same weights (`LM(lm.model)`),
    so a generation running with `lm` is untouched.
    """
    probe = LM(lm.model, vocab_size=lm.vocab_size)
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, min(lm.vocab_size, 1000), (prefix + max(sizes),), generator=g)
    probe.forward(tokens[:prefix])
    probe.commit(list(range(prefix)))
    probe.forward(tokens[prefix:prefix + 2])  # warm-up
    times: list[list[float]] = [[] for _ in sizes]
    for _ in range(repeats):
        for i, n in enumerate(sizes):
            _sync(probe)
            t0 = time.perf_counter()
            probe.forward(tokens[prefix:prefix + n])
            _sync(probe)
            times[i].append(time.perf_counter() - t0)
            if bar is not None:
                bar.update()
    return [statistics.median(t) for t in times]


def implausible(ns: Sequence[int], seconds: Sequence[float], slack: float = 1.5) -> bool:
    """True when a bigger block was timed much faster than a smaller one (a busy machine, not the model)."""
    return any(seconds[j] * slack < seconds[i] for i in range(len(ns)) for j in range(i + 1, len(ns)))


def machine_key(pair: Pair) -> dict[str, str]:
    """What a cost model depends on: the machine, its CPU or GPU, torch's threads, device, dtype, the pair and
    the matmul kernels its models run."""
    lm = pair.target
    if lm.device.type == "cuda":
        chip = torch.cuda.get_device_name(lm.device)
    else:
        chip = _cpu_model()
    return {"node": platform.node(), "chip": chip, "threads": str(torch.get_num_threads()),
            "device": str(lm.device), "dtype": str(lm.dtype).removeprefix("torch."),
            "target": pair.target_name, "draft": pair.draft_name,
            "kernels": f"{linear_kinds(lm.model)} / {linear_kinds(pair.draft.model) if pair.draft else '-'}"}


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def profile_cost(pair: Pair, sizes: Sequence[int] = SIZES, *, repeats: int = 3, progress: bool = True) -> CostModel:
    """Time the target on blocks of n tokens and the draft on blocks of w tokens, after a 200-token prefix."""
    if pair.draft is None:
        raise SpeculorError("profiling a tree's cost needs a draft model")
    with tqdm(total=2 * len(sizes) * repeats, desc="profile target+draft", unit="fwd", disable=not progress) as bar:
        t = time_forwards(pair.target, sizes, repeats=repeats, bar=bar)
        d = time_forwards(pair.draft, sizes, repeats=repeats, bar=bar)
    if implausible(sizes, t) or implausible(sizes, d):
        logger.warning("sequoia: forward times do not grow with the block size (%s); the machine looks busy: "
                       "run `speculor profile --force` when it is idle", [round(x, 3) for x in t])
    return CostModel(tuple(sizes), tuple(t), tuple(sizes), tuple(d), tuple(sorted(machine_key(pair).items())))


def cost_path(pair: Pair) -> Path:
    key = machine_key(pair)
    digest = hashlib.sha1(json.dumps(key, sort_keys=True).encode()).hexdigest()[:12]
    return cache_dir() / "sequoia" / f"cost--{_slug(pair.target_name)}--{_slug(pair.draft_name)}--{digest}.json"


_COSTS: dict[Path, CostModel] = {}


def machine_cost(pair: Pair, *, progress: bool = True) -> CostModel:
    """The cached cost model of this machine and pair; profiles once (a minute or two) if there is none."""
    path = cost_path(pair)
    if path not in _COSTS:
        if path.exists():
            _COSTS[path] = CostModel.load(path)
        else:
            print(f"speculor: profiling forward times on this machine for --budget auto (once; cached in {path})",
                  file=sys.stderr)
            cost = profile_cost(pair, progress=progress)
            cost.save(path)
            _COSTS[path] = cost
    return _COSTS[path]


def _slug(name: str) -> str:
    """A file-name-safe label for a model spec (a folder or file path keeps its last part and a hash)."""
    if not name:
        return "unnamed"
    label = re.sub(r"[^A-Za-z0-9._-]+", "_", Path(name).name)[:60]
    if "/" in name or "\\" in name:
        label += "-" + hashlib.sha1(name.encode()).hexdigest()[:8]
    return label


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
    name = f"acc--{_slug(target)}--{_slug(draft)}--T{temperature:g}--p{top_p:g}.json"
    return cache_dir() / "sequoia" / name


class AcceptanceRecorder:
    """A drafter wrapper that counts, per step, which child of the root was accepted (node i = rank i + 1)."""

    def __init__(self, inner: Any, width: int) -> None:
        self.inner, self.counts, self.steps = inner, [0] * width, 0

    @property
    def forwards(self) -> int:
        return self.inner.forwards

    def reset(self) -> None:
        self.inner.reset()

    def propose(self, seq: list[int], cfg: SamplingConfig, generator: torch.Generator | None):
        return self.inner.propose(seq, cfg, generator)

    def observe(self, n_committed: int, verdict: Verdict) -> None:
        self.steps += 1
        if verdict.path:
            self.counts[verdict.path[0]] += 1
        self.inner.observe(n_committed, verdict)


def calibrate(pair: Pair, prompts: Sequence[list[int]], cfg: SamplingConfig, *, width: int = 16, steps: int = 16,
              eos_ids: frozenset[int] = frozenset(), progress: bool = True, sets: str = "") -> Calibration:
    """Measure the acceptance vector of §4.1 for pair at cfg's temperature and top-p.

    Per step the engine drafts a depth-1 tree of `width` children drawn without replacement from q (the
    top-`width` tokens at temperature 0), verifies it (SWOR rule, or greedy matching at temperature 0) and
    commits the verdict, so contexts are those of real generation; `steps` steps per prompt (fewer if the
    prompt's generation ends). counts[k - 1] = steps where the k-th child was accepted.
    """
    from speculor.drafters import TreeDrafter

    if pair.draft is None:
        raise SpeculorError("calibration needs a draft model")
    recorder = AcceptanceRecorder(TreeDrafter(pair.draft, [-1] * width, draw="swor"), width)
    with tqdm(total=len(prompts) * steps, desc=f"calibrate T={cfg.temperature:g}", unit="step",
              disable=not progress) as bar:
        for i, ids in enumerate(prompts):
            run = replace(cfg, max_new_tokens=2 * steps, seed=None if cfg.seed is None else cfg.seed + i)
            start, done = recorder.steps, 0
            for _ in engine.stream(pair.target, recorder, ids, run, eos_ids):
                bar.update(recorder.steps - start - done)
                done = recorder.steps - start
                if done >= steps:
                    break
            bar.update(steps - done)  # a generation that ended early counts as done
    return Calibration(pair.target_name, pair.draft_name, cfg.temperature, cfg.top_p, tuple(recorder.counts),
                       recorder.steps, len(prompts), sets)


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
        if self.budget != "auto" and (not _is_int(self.budget) or not 1 <= self.budget <= 1024):
            raise SpeculorError(f"budget must be an integer in [1, 1024] or 'auto', got {self.budget!r}")
        if not _is_int(self.depth) or not 1 <= self.depth <= 64:
            raise SpeculorError(f"depth must be an integer in [1, 64], got {self.depth!r}")
        if not _is_int(self.width) or not 1 <= self.width <= 64:
            raise SpeculorError(f"width must be an integer in [1, 64], got {self.width!r}")
        if isinstance(self.acc, str) and not Path(self.acc).expanduser().is_file():
            raise SpeculorError(f"no calibration file at {self.acc!r}; run `speculor calibrate`")
        if self.acc is not None and not isinstance(self.acc, str):
            object.__setattr__(self, "acc", tuple(float(a) for a in self.acc))
            if not self.acc or min(self.acc) < 0 or sum(self.acc) > 1 + 1e-6:
                raise SpeculorError(f"acc must be non-negative with a sum <= 1, got {self.acc!r}")


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


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


class SequoiaDrafter:
    """Sequoia's static tree drafted from a draft model: children drawn without replacement (exponential keys)
    and verified with the SWOR rule; deterministic top-k children and greedy matching at temperature 0.

    The tree depends on the acceptance vector, which depends on the sampling settings known only at
    `propose`, so a plan is made per (temperature, top-p) and kept.
    """

    def __init__(self, lm: LM, target_name: str, draft_name: str, opts: SequoiaOptions,
                 cost: CostModel | None = None) -> None:
        self.lm, self.names, self.opts, self.cost = lm, (target_name, draft_name), opts, cost
        self.plans: dict[tuple[float, float], Plan] = {}
        self.inner: Any = None  # the TreeDrafter of the current shape
        self.inner_shape: list[int] | None = None
        self.forwards = 0

    def plan(self, cfg: SamplingConfig) -> Plan:
        key = (cfg.temperature, cfg.top_p)
        if key not in self.plans:
            acc, source = resolve_acc(self.opts.acc, *self.names, cfg)
            shape, expected, choice = plan_tree(acc, self.opts, self.cost)
            self.plans[key] = Plan(shape, expected, source, choice)
        return self.plans[key]

    def reset(self) -> None:
        self.lm.reset()

    def propose(self, seq: list[int], cfg: SamplingConfig, generator: torch.Generator | None):
        from speculor.drafters import TreeDrafter

        shape = list(self.plan(cfg).shape)
        if shape != self.inner_shape:
            self.inner, self.inner_shape = TreeDrafter(self.lm, shape, draw="swor"), shape
        tree = self.inner.propose(seq, cfg, generator)
        self.forwards = self.inner.forwards
        return tree

    def observe(self, n_committed: int, verdict: Verdict) -> None:
        self.inner.observe(n_committed, verdict)


def make_sequoia(pair: Pair, budget: int | str = 16, depth: int = 8, width: int = 8,
                 acc: str | Sequence[float] | None = None) -> SequoiaDrafter:
    """Builder of the `sequoia` strategy (see `SequoiaOptions`); budget='auto' profiles the machine once."""
    if pair.draft is None:
        raise SpeculorError("strategy 'sequoia' needs a draft model")
    opts = SequoiaOptions(budget, depth, width, acc)  # type: ignore[arg-type]
    cost = machine_cost(pair) if budget == "auto" else None
    return SequoiaDrafter(pair.draft, pair.target_name, pair.draft_name, opts, cost)
