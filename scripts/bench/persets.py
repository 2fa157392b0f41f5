import collections
import json
import statistics as st
import sys

r = [json.loads(line) for line in open(sys.argv[1])]
d = collections.defaultdict(float)
n = collections.defaultdict(int)
dec = collections.defaultdict(float)
for x in r:
    k = (x["set"], x["round"], x["strategy"], x["temperature"])
    d[k] += x["wall_s"]
    n[k] += x["new_tokens"]
sets = sorted({x["set"] for x in r})
rounds = sorted({x["round"] for x in r})
strats = list(dict.fromkeys(x["strategy"] for x in r))
temps = sorted({x["temperature"] for x in r})
for T in temps:
    print(f"T={T}: ÷ our plain per set, median of rounds (rounds)")
    for s in strats:
        cells = []
        for se in sets:
            rs = [
                (n[(se, i, s, T)] / d[(se, i, s, T)]) / (n[(se, i, "plain", T)] / d[(se, i, "plain", T)])
                for i in rounds
            ]
            cells.append(f"{se} {st.median(rs):.3f} ({' '.join(f'{v:.2f}' for v in rs)})")
        allr = [
            sum(n[(se, i, s, T)] for se in sets)
            / sum(d[(se, i, s, T)] for se in sets)
            / (sum(n[(se, i, "plain", T)] for se in sets) / sum(d[(se, i, "plain", T)] for se in sets))
            for i in rounds
        ]
        print(f"  {s:22s} all {st.median(allr):.3f} | " + " | ".join(cells))
