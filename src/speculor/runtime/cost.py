"""This machine's cost curve: seconds of a target forward per block size and of a draft forward per width.

`CostModel` interpolates measured times (pure); `cost_path` names a pair's profile in the cache folder (the machine,
threads, device, dtype and kernels it depends on: `machine_key`) and `cached_cost` reads it once per process.
Measuring one is runtime/profiling.py's (`profile_cost`, and `machine_cost`: profile once where none is cached).
Sequoia's and DySpec's `budget="auto"` (docs/algorithms.md §4.2, §5) size their trees with it.
"""

from __future__ import annotations

import hashlib
import json
import platform
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch

from speculor.core.sequoia_dp import feed_widths
from speculor.runtime.assets import cache_dir, slug
from speculor.runtime.backend import Pair


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


def cached_cost(path: Path, measure: Callable[[], CostModel]) -> CostModel:
    """The cost model saved at `path`, read once per process; where there is none, `measure()`'s, saved there."""
    if path not in _COSTS:
        if path.exists():
            _COSTS[path] = CostModel.load(path)
        else:
            cost = measure()
            cost.save(path)
            _COSTS[path] = cost
    return _COSTS[path]
