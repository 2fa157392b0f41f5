"""Acceptance over Σ P per match bucket for suffix drafts of at most K nodes, drafting at every match (no cost
model: no selection by trust), replayed on plain greedy outputs. Usage: trust_stats.py TOK QUESTIONS records..."""
import collections, json, os, sys
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "../factor"))
from replay import COST, AutoTokenizer, CostModel, Path, prompt_ids, replay, sets
from speculor.drafters import suffix

K = int(os.environ.get("K", "2"))
TEMP = float(os.environ.get("TEMP", "0"))  # sampled answers: a draft token is "accepted" where the sample took it
tok = AutoTokenizer.from_pretrained(sys.argv[1])
known = {p.id: p for name in ("mtbench", "humaneval", "summarize", "code-edit") for p in sets.load([name])}
known |= {p.id: p for p in sets.file_set(Path(sys.argv[2]))}
cost = CostModel.load(Path(COST))  # replay prices the steps; only the counts are read here
stats = collections.defaultdict(lambda: [0, 0.0, 0])  # (set, bucket) -> steps, ΣP, accepted
for f in sys.argv[3:]:
    rows = [json.loads(l) for l in open(f)]
    strategy = suffix.SuffixStrategy(suffix.SuffixOptions(budget=K, max_spec_factor=1), None)
    for r in rows:
        if r["strategy"] != "plain" or r.get("round", 0) != 0 or r["temperature"] != TEMP:
            continue
        s = r["prompt_id"].split("/")[0].lower()

        def count(d, toks, path, s=s):
            if toks:
                b = suffix._bucket(d.candidate.match)
                for key in ((s, b), ("all", b)):
                    st = stats[key]; st[0] += 1; st[1] += d.candidate.score; st[2] += len(path)

        replay(strategy.drafter(), prompt_ids(tok, known[r["prompt_id"]]), r["token_ids"], cost, on_step=count)
print(f"K={K}; buckets from {suffix.MATCH_EDGES}: steps, accepted / ΣP")
for key in sorted(stats, key=lambda k: (k[0] != "all", k)):
    n, p, a = stats[key]
    print(f"  {key[0]:<14} bucket {suffix.MATCH_EDGES[key[1]]}+: {n:4d} steps, ΣP {p / n:.2f}/step, acc {a / n:.2f}/step, acc/ΣP {a / p:.2f}")
