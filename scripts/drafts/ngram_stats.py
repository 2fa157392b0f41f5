"""Usage: ngram_stats.py TOK QUESTIONS records... ([TEMP=0.7] [K=8]).

ngram (k=8, n=3) drafting its whole continuation at every match: per matched length m, the conditional acceptance
a = accepted / reached (a token reaches verification iff the ones before passed), replayed on plain answers."""

import collections
import os
import sys

from replay import COST, AutoTokenizer, CostModel, Path, plain_runs, replay

from speculor.drafters import lookup

cost = CostModel.load(Path(COST))
TEMP = float(os.environ.get("TEMP", "0"))
K = int(os.environ.get("K", "8"))
st = collections.defaultdict(lambda: [0, 0, 0, 0])  # (set, m) -> steps, reached, accepted, first accepted
for run in plain_runs(AutoTokenizer.from_pretrained(sys.argv[1]), sys.argv[2], sys.argv[3:], TEMP):
    for pid, prompt, out in run:
        s = pid.split("/")[0].lower()
        s = "specbench" if s not in ("mtbench", "humaneval", "summarize", "code-edit") else s
        d = lookup.NgramDrafter(k=K, cost=None)
        # track m via a wrapper around propose
        orig = d.propose

        def propose(seq, cfg, gen, d=d, orig=orig):
            found = d.index.matches(seq, d.k, d.branches)
            d._m = found[0][0] if found else 0
            return orig(seq, cfg, gen)

        d.propose = propose

        def on_step(dr, toks, path, s=s):
            if toks:
                for key in ((s, dr._m), ("all", dr._m)):
                    x = st[key]
                    x[0] += 1
                    x[1] += min(len(toks), len(path) + 1)
                    x[2] += len(path)
                    x[3] += len(path) > 0

        replay(d, prompt, out, cost, on_step=on_step)
for key in sorted(st):
    n, r, a, f = st[key]
    print(f"{key[0]:<10} m={key[1]}: {n:5d} steps, a = {a / r:.2f}, first token {f / n:.2f}")
