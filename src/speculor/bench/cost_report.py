"""What `speculor profile` prints for a pair: its cost curve t(n), the host time of a plain step, the ceiling a
free drafter could reach, and per temperature the predicted rates of a chain and of sequoia's planned tree."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from speculor.bench.host import host_line
from speculor.config import SamplingConfig
from speculor.core.sequoia_dp import level_widths
from speculor.drafters.sequoia import SequoiaOptions, plan_tree, resolve_acc
from speculor.runtime.backend import Pair
from speculor.runtime.choice import predicted
from speculor.runtime.cost import CostModel


def report(pair: Pair, cost: CostModel, path: Path, temperatures: list[float], depth: int, width: int) -> None:
    t1 = cost.t_target(1)
    print(f"backend {pair.backend}: cost model {path}\n  n   target_s  t(n)/t(1)  draft_s  d(n)/d(1)")
    for n in range(1, 17):
        t, d = cost.t_target(n), cost.t_draft(n)
        print(f"{n:4d}  {t:8.3f}  {t / t1:8.2f}  {d:8.3f}  {d / max(cost.t_draft(1), 1e-12):8.2f}")
    ceiling = max(n * t1 / cost.t_target(n) for n in range(1, 17))
    print(f"{host_line(pair, t1)}\nceiling: a free drafter always right gives at most {ceiling:.2f}x plain decoding "
          f"({1 / t1:.2f} tokens/s plain)")
    opts = SequoiaOptions("auto", depth, width)
    for temp in temperatures:
        acc, source = resolve_acc(None, pair.target_name, pair.draft_name, SamplingConfig(temperature=temp))
        free = predicted(replace(cost, draft_s=tuple(0.0 for _ in cost.draft_s)), acc[0])
        rate, k = predicted(cost, acc[0])
        print(f"T={temp:g} (acc: {source}): a free chain drafter with top-1 acceptance {acc[0]:.2f}: at most "
              f"{free[0] * t1:.2f}x (k={free[1]}); this draft's chain: {rate * t1:.2f}x (k={k})")
        c = plan_tree(acc, opts, cost)[2]
        print(f"  sequoia: n = {c.n} nodes with the root, {c.d} levels, widths "
              f"{level_widths(c.shape)}, F = {c.expected_tokens:.2f} tokens/step, {c.step_s:.3f} s/step, "
              f"{c.tokens_per_s:.2f} tokens/s predicted (plain {1 / t1:.2f})")
        print(f"    shape = {list(c.shape)}")
