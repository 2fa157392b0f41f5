"""Replay suffix (budget auto, factor 1) on plain answers, the prior trust TRUST_0 against trust 1 to start, with the
strategy's trust shared by its requests (greedy, unseeded) and learned by each request alone (a seeded sampled
request: its own trie and trust). Decode ÷ plain on the cached (COST) curve.

    [COST=cost.json] [TEMP=0.7] [PRIORS="0.3,0.4,0.5,0.8,1;..." (a bucket's at every depth)] \
        python replay_prior.py TARGET_TOKENIZER_DIR QUESTIONS records.jsonl ...
"""

import os
import sys

from replay import COST, AutoTokenizer, CostModel, Path, plain_runs, replay

from speculor.drafters import suffix

cost = CostModel.load(Path(COST))
temp = float(os.environ.get("TEMP", "0"))
runs = plain_runs(AutoTokenizer.from_pretrained(sys.argv[1]), sys.argv[2], sys.argv[3:], temp)
print(f"t(n)/t(1), n = 1..4: {[round(cost.t_target(n) / cost.t_target(1), 2) for n in range(1, 5)]}; T = {temp}")


def flat(row):  # one prior a bucket, every depth
    return tuple(tuple([x] * len(suffix.DEPTH_EDGES)) for x in row)


starts = {"1": flat([1.0] * len(suffix.MATCH_EDGES)), "TRUST_0": suffix.TRUST_0}
starts |= {p: flat(map(float, p.split(","))) for p in os.environ.get("PRIORS", "").split(";") if p}
for start, prior in starts.items():
    suffix.TRUST_0 = prior
    for alone in (False, True):
        per = {}
        for run in runs:
            strategy = suffix.SuffixStrategy(suffix.SuffixOptions(budget="auto", shared=not alone), cost)
            for pid, prompt, out in run:
                d = (
                    suffix.SuffixDrafter(strategy.opts, None, cost, None, suffix.Trust())
                    if alone
                    else strategy.drafter()
                )
                s = pid.split("/")[0].lower()
                s = "specbench" if s not in ("mtbench", "humaneval", "summarize", "code-edit") else s
                a = per.setdefault(s, [0.0, 0.0])
                a[0] += replay(d, prompt, out, cost)
                a[1] += len(out) * cost.t_target(1)
        tot = [sum(v[0] for v in per.values()), sum(v[1] for v in per.values())]
        print(
            f"trust from {start:<8} {'each request alone' if alone else 'shared':<18}: "
            + ", ".join(f"{s} {b / a:.3f}x" for s, (a, b) in per.items())
            + f", all {tot[1] / tot[0]:.3f}x",
            flush=True,
        )
