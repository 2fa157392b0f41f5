"""Acceptance over Σ P per match bucket for suffix drafts of at most K nodes, drafting at every match (no cost
model: no selection by trust), replayed on plain greedy outputs. Usage: trust_stats.py TOK QUESTIONS records..."""

import collections
import os
import sys

from replay import COST, AutoTokenizer, CostModel, Path, plain_runs, replay

from speculor.drafters import suffix

K = int(os.environ.get("K", "2"))
TEMP = float(os.environ.get("TEMP", "0"))  # sampled answers: a draft token is "accepted" where the sample took it
cost = CostModel.load(Path(COST))  # replay prices the steps; only the counts are read here
stats = collections.defaultdict(lambda: [0, 0.0, 0])  # (set, bucket) -> steps, ΣP, accepted
for run in plain_runs(AutoTokenizer.from_pretrained(sys.argv[1]), sys.argv[2], sys.argv[3:], TEMP):
    strategy = suffix.SuffixStrategy(suffix.SuffixOptions(budget=K, max_spec_factor=1), None)
    for pid, prompt, out in run:
        s = pid.split("/")[0].lower()

        def count(d, toks, path, s=s):
            if toks:
                b = suffix._bucket(d.candidate.match)
                for key in ((s, b), ("all", b)):
                    st = stats[key]
                    st[0] += 1
                    st[1] += d.candidate.score
                    st[2] += len(path)

        replay(strategy.drafter(), prompt, out, cost, on_step=count)
print(f"K={K}; buckets from {suffix.MATCH_EDGES}: steps, accepted / ΣP")
for key in sorted(stats, key=lambda k: (k[0] != "all", k)):
    n, p, a = stats[key]
    print(
        f"  {key[0]:<14} bucket {suffix.MATCH_EDGES[key[1]]}+: {n:4d} steps, ΣP {p / n:.2f}/step, "
        f"acc {a / n:.2f}/step, acc/ΣP {a / p:.2f}"
    )
