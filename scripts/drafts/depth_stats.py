"""Acceptance over Σ P per match bucket and node depth for suffix drafts of at most K nodes (F: max_spec_factor),
drafting at every match, replayed on plain answers. Usage: depth_stats.py TOK QUESTIONS records..."""

import collections
import os
import sys

from replay import COST, AutoTokenizer, CostModel, Path, plain_runs, replay

from speculor.drafters import suffix

K = int(os.environ.get("K", "8"))
TEMP = float(os.environ.get("TEMP", "0"))
cost = CostModel.load(Path(COST))
stats = collections.defaultdict(lambda: [0, 0.0, 0])  # (bucket, depth) -> nodes, ΣP, accepted
for run in plain_runs(AutoTokenizer.from_pretrained(sys.argv[1]), sys.argv[2], sys.argv[3:], TEMP):
    strategy = suffix.SuffixStrategy(
        suffix.SuffixOptions(budget=K, max_spec_factor=float(os.environ.get("F", "1"))), None
    )
    for _pid, prompt, out in run:

        def count(d, toks, path):
            c = d.candidate
            b = suffix._bucket(c.match)
            depth = []
            for p in c.parents:
                depth.append(1 if p < 0 else depth[p] + 1)
            on = set(path)
            for i, p in enumerate(c.probs):
                st = stats[(b, min(depth[i], 6))]
                st[0] += 1
                st[1] += p
                st[2] += i in on

        replay(strategy.drafter(), prompt, out, cost, on_step=count)
print(f"K={K} buckets {suffix.MATCH_EDGES}: acc/ΣP (nodes) by depth 1..6+")
for b in range(len(suffix.MATCH_EDGES)):
    cells = [
        f"{stats[(b, d)][2] / stats[(b, d)][1]:.2f} ({stats[(b, d)][0]})" if stats[(b, d)][0] else "-"
        for d in range(1, 7)
    ]
    print(f"  bucket {suffix.MATCH_EDGES[b]}+: " + "  ".join(cells))
