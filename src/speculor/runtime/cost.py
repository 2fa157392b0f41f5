"""This machine's cost curve: seconds of a target forward per block size and of a draft forward per width.

`CostModel` interpolates measured times (pure); `profile_cost` measures them on the pair's models with a cache of
its own; `machine_cost` keeps one profile per machine and pair in the cache folder, profiling once if needed.
Sequoia's and DySpec's `budget="auto"` (docs/algorithms.md §4.2, §5) size their trees with it.
"""

from __future__ import annotations

import hashlib
import json
import logging
import platform
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch

from speculor.core.sequoia_dp import feed_widths
from speculor.runtime.assets import cache_dir, slug
from speculor.runtime.backend import forward1
from speculor.runtime.loading import Pair
from speculor.runtime.model import Model

logger = logging.getLogger("speculor")


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


SIZES = (*range(1, 17), 24, 32, 48, 64, 96, 128)  # block sizes timed (every one to 16: llama.cpp's curve is a
# sawtooth, t(n) = t(3) per 3 rows + the rest, runtime/llama.py); others interpolated


def _sync(model: Model) -> None:
    if model.device.type == "cuda":
        torch.cuda.synchronize(model.device)


def time_forwards(model: Model, sizes: Sequence[int], *, prefix: int = 200, repeats: int = 3,
                  tick: Callable[[], object] | None = None) -> list[float]:
    """Median seconds of one `model.forward` over a block of n tokens after `prefix` committed tokens, per n.

    A block is a chain given as a tree (its parents), so it runs in the calls a draft tree of n rows runs in
    (llama.cpp: EXACT_ROWS rows a call, runtime/llama.py), not in a prompt's. Every size is run once untimed
    first; the repeats then run in rounds over all sizes (not back to back), so a burst of load from another
    process spreads over sizes instead of inflating one. Uses a cache of its own;
    `tick()` after every forward.
    """
    cache = model.new_cache()
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, min(model.vocab_size, 1000), (prefix + max(sizes),), generator=g)
    forward1(model, cache, tokens[:prefix])
    cache.keep(list(range(prefix)))
    def block(n: int):
        return forward1(model, cache, tokens[prefix:prefix + n], torch.arange(-1, n - 1))

    for n in sizes:  # warm-up: every block size once, untimed (a cold first forward made t(1) read 0.37 s > t(4))
        block(n)
    times: list[list[float]] = [[] for _ in sizes]
    for _ in range(repeats):
        for i, n in enumerate(sizes):
            _sync(model)
            t0 = time.perf_counter()
            block(n)
            _sync(model)
            times[i].append(time.perf_counter() - t0)
            if tick is not None:
                tick()
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
            "kernels": f"{lm.cost_key} / {pair.draft.cost_key if pair.draft else '-'}", "blocks": "trees"}


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
    from tqdm import tqdm  # only when profiling: the decoding path imports no progress bar

    with tqdm(total=2 * len(sizes) * repeats, desc="profile target+draft", unit="fwd", disable=not progress) as bar:
        t = time_forwards(pair.target, sizes, repeats=repeats, tick=bar.update)
        d = ([0.0] * len(sizes) if pair.draft is None  # model-free drafts (n-gram) cost nothing
             else time_forwards(pair.draft, sizes, repeats=repeats, tick=bar.update))
    if implausible(sizes, t) or implausible(sizes, d):
        logger.warning("sequoia: forward times do not grow with the block size (%s); the machine looks busy: "
                       "run `speculor profile --force` when it is idle", [round(x, 3) for x in t])
    return CostModel(tuple(sizes), tuple(t), tuple(sizes), tuple(d), tuple(sorted(machine_key(pair).items())))


def cost_path(pair: Pair) -> Path:
    key = machine_key(pair)
    digest = hashlib.sha1(json.dumps(key, sort_keys=True).encode()).hexdigest()[:12]
    return cache_dir() / "sequoia" / f"cost--{slug(pair.target_name)}--{slug(pair.draft_name)}--{digest}.json"


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
