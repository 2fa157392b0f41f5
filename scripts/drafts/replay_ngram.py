"""Replay ngram (k=8, n=3, budget auto; a request learns alone from the prior of its match length) on plain answers:
Spec-Bench's (QUESTIONS, SB_RECORDS) and the embedded sets' (the records named below), greedy and at T = 0.7, decode ÷
plain on the cached curve.

    [PRIORS="a1,b1/a2,b2/a3,b3;..."] python scripts/drafts/replay_ngram.py TARGET_TOKENIZER_DIR QUESTIONS SB_RECORDS

The embedded sets' records are runs that have left the tree; bring them back from the archive tag first:

    git checkout bench-archive-2026-11 -- docs/bench/cpu-never-slower/plain12-root \
        docs/bench/cpu-never-slower/must36-index docs/bench/cpu-suffix/must-show/t0-copy \
        docs/bench/cpu-never-slower/t07-refresh
"""

import os
import sys

from replay import COST, AutoTokenizer, CostModel, Path, plain_runs, replay

from speculor.drafters import lookup

DEFAULT = lookup.PRIOR
cost = CostModel.load(Path(COST))
tok = AutoTokenizer.from_pretrained(sys.argv[1])
B = os.path.join(os.path.dirname(os.path.abspath(__file__)), "../../docs/bench")  # restore them first (docstring)
for temp in (0.0, 0.7):
    runs = plain_runs(tok, sys.argv[2], [sys.argv[3]], temp)
    runs += plain_runs(
        tok,
        sys.argv[2],
        [
            f"{B}/cpu-never-slower/plain12-root/records.jsonl",
            f"{B}/cpu-never-slower/must36-index/records.jsonl",
            f"{B}/cpu-suffix/must-show/t0-copy/records.jsonl",
        ]
        if temp == 0
        else [f"{B}/cpu-never-slower/t07-refresh/records.jsonl"],
        temp,
    )
    for spec in [None] + [p for p in os.environ.get("PRIORS", "").split(";") if p]:
        lookup.PRIOR = DEFAULT if not spec else tuple(tuple(map(float, x.split(","))) for x in spec.split("/"))
        per = {}
        for run in runs:
            for pid, prompt, out in run:
                d = lookup.NgramDrafter(cost=cost)
                s = pid.split("/")[0].lower()
                s = "SB" if s not in ("mtbench", "humaneval", "summarize", "code-edit") else s
                a = per.setdefault(s, [0.0, 0.0])
                a[0] += replay(d, prompt, out, cost)
                a[1] += len(out) * cost.t_target(1)
        tot = [sum(v[0] for v in per.values()), sum(v[1] for v in per.values())]
        print(
            f"T={temp} prior {spec or lookup.PRIOR}: "
            + " ".join(f"{s} {b / a:.3f}" for s, (a, b) in per.items())
            + f" all {tot[1] / tot[0]:.3f}",
            flush=True,
        )
