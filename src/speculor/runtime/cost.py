"""This machine's cost curve: seconds of a target forward per block size and of a draft forward per width.

`CostModel` interpolates measured times (pure); `cost_path` names a pair's profile in the cache folder (the machine,
threads, device, dtype and kernels it depends on: `machine_key`) and `cached_cost` reads it once per process.
Measuring one is runtime/profiling.py's (`profile_cost`, and `machine_cost`: profile once where none is cached).
Sequoia's and DySpec's `budget="auto"` (docs/algorithms.md §4.2, §5) size their trees with it. `CallTimes` and
`Measured`: the profile's t_target corrected by the target's own calls as this process times them (the model-free
drafts' cuts: the shape of t(n) moves with the machine's load, docs/algorithms.md §11.1; `CallTimes` in
runtime/call_times.py).
"""

from __future__ import annotations

import hashlib
import json
import platform
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from functools import lru_cache
from pathlib import Path

import numpy as np
import torch

from speculor.core.sequoia_dp import feed_widths
from speculor.runtime.assets import cache_dir, slug
from speculor.runtime.backend import Pair
from speculor.runtime.call_times import CallTimes


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
        for name in ("target_n", "target_s", "draft_n", "draft_s"):  # tuples: _interp's cache keys
            object.__setattr__(self, name, tuple(getattr(self, name)))
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


class Measured:
    """A profile whose target curve follows the calls timed since (`CallTimes`): a block of n rows is q calls of
    L = `limit` rows and one of r (n = q·L + r), and

        t(n) = t_profile(n) · (q ρ_L + ρ_r) / (q π_L + π_r)      ρ_k = c(k) / c(1),  π_k = t_profile(k) / t_profile(1)

    (ρ_0 = π_0 = 0; ρ_k = π_k until size k was timed): t(1) and the draft's curve stay the profile's, a block's rows
    are priced at the ratios the machine gives now. `fixed`: the profile alone (a seeded sampled request's trees
    must follow from its seed, not from timings: `steady`)."""

    def __init__(self, profile: CostModel, calls: CallTimes) -> None:
        self.fixed, self.calls = profile, calls
        self.pi = [0.0] + [profile.t_target(k) / profile.t_target(1) for k in range(1, calls.limit + 1)]

    def t_target(self, n: int) -> float:
        pi, L = self.pi, self.calls.limit
        rho = [0.0] + [self.calls.ratio(k) or pi[k] for k in range(1, L + 1)]
        q, r = divmod(n, L)
        return self.fixed.t_target(n) * (q * rho[L] + rho[r]) / (q * pi[L] + pi[r])

    def t_draft(self, w: int) -> float:
        return self.fixed.t_draft(w)


def steady(cost: CostModel | Measured | None, seeded: bool) -> CostModel | Measured | None:
    """The curve a request's tree is priced by: the profile alone for a seeded sampled request (`Measured`)."""
    return cost.fixed if seeded and isinstance(cost, Measured) else cost


@lru_cache(maxsize=1 << 16)  # the budgets ask for the same few sizes every step (np.interp's cost: algorithms.md §11.1)
def _interp(x: float, xs: tuple[int, ...], ys: tuple[float, ...]) -> float:
    """Piecewise-linear interpolation; linear extrapolation from the last two points beyond the largest x."""
    if len(xs) >= 2 and x > xs[-1]:
        slope = (ys[-1] - ys[-2]) / (xs[-1] - xs[-2])
        return float(ys[-1] + slope * (x - xs[-1]))
    return float(np.interp(x, xs, ys))


def machine_key(pair: Pair) -> dict[str, str]:
    """What a cost model depends on: the machine, its CPU or GPU, torch's threads, device, dtype, the pair and
    the matmul kernels its models run."""
    lm = pair.target
    if lm.device.type == "cuda":
        chip = torch.cuda.get_device_name(lm.device)
    else:
        chip = _cpu_model()
    return {"node": platform.node(), "chip": chip, "threads": str(torch.get_num_threads()),
            "device": str(lm.device), "dtype": lm.weights,
            "target": pair.target_name, "draft": pair.draft_name,
            "kernels": f"{lm.cost_key} / {pair.draft.cost_key if pair.draft else '-'}", "blocks": "trees"}


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def cost_path(pair: Pair) -> Path:
    key = machine_key(pair)
    digest = hashlib.sha1(json.dumps(key, sort_keys=True).encode()).hexdigest()[:12]
    return cache_dir() / "sequoia" / f"cost--{slug(pair.target_name)}--{slug(pair.draft_name)}--{digest}.json"


_COSTS: dict[Path, CostModel] = {}  # the profiles read or measured in this process, by file


def cached_cost(path: Path, measure: Callable[[], CostModel],
                stale: Callable[[CostModel], bool] | None = None) -> CostModel:
    """The cost model saved at `path`, read once per process; where there is none, or `stale(saved)` says the machine
    has moved off it, `measure()`'s, saved there."""
    if path not in _COSTS:
        cost = CostModel.load(path) if path.exists() else None
        if cost is None or (stale is not None and stale(cost)):
            cost = measure()
            cost.save(path)
        _COSTS[path] = cost
    return _COSTS[path]
