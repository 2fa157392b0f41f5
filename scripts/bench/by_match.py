"""A model-free strategy's drafting steps in a bench run's records, by the match length they were drafted after
(suffix) and by set and draft size: steps, tokens accepted a step, tokens drafted a step.

    python by_match.py records.jsonl [strategy ...]
"""

import collections
import json
import sys

records = [json.loads(line) for line in open(sys.argv[1])]
for strategy in sys.argv[2:] or ["suffix", "ngram"]:
    by_size, by_match = collections.defaultdict(lambda: [0, 0]), collections.defaultdict(lambda: [0, 0, 0])
    for r in records:
        if r["strategy"] != strategy:
            continue
        matches = r.get("match") or [None] * len(r["drafted"])
        for d, a, m in zip(r["drafted"], r["accepted"], matches, strict=False):
            if d:
                by_size[(r["set"], d)][0] += 1
                by_size[(r["set"], d)][1] += a
            if d and m is not None:
                row = by_match[min(m, 12)]
                row[0], row[1], row[2] = row[0] + 1, row[1] + a, row[2] + d
    print(strategy)
    for (s, d), (n, a) in sorted(by_size.items()):
        print(f"  {s} drafted {d}: {n} steps, {a / n:.2f} accepted a step")
    for m, (n, a, d) in sorted(by_match.items()):
        print(f"  match {m}{'+' if m == 12 else ''}: {n} steps, {a / n:.2f} accepted, {d / n:.2f} drafted a step")
