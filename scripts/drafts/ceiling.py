"""How fast can any exact draft be on the copy sets at this machine's curve? Two oracles replayed on plain answers.

    perfect   the drafter knows the answer: every step may draft any number of the next tokens, all accepted.
    copy      the drafter knows the answer but only drafts tokens that some suffix trie could hold: the next L
              tokens where they occurred before (in the prompt, the answer so far or an earlier answer of the run)
              right after the context's last token, L <= 12 (a suffix draft holds at most max_spec_factor · match
              <= 1 · max_depth // 2 = 12 nodes at the defaults). Every suffix tree's paths are among those
              continuations, so no suffix draft of any size, trust or cut accepts more.

Each oracle's steps are chosen by dynamic programming for the least time over the answer (a step of d drafts costs
t_target(d + 1) of the cached exact curve: calls of at most 3 rows), against plain's t_target(1) a token: decode ÷
plain. End to end (prefill in): 1 / (f + (1 - f) / decode), f = plain's prefill share of its time in the records.

    [RHO=t2,t3] python ceiling.py TARGET_TOKENIZER_DIR SPEC_BENCH_QUESTIONS records.jsonl

RHO: price the calls by these t(2)/t(1), t(3)/t(1) instead of the cached curve's (a block of n rows: q calls of 3
rows and one of r, n = 3q + r). SPEC_BENCH_QUESTIONS: a JSONL prompt file (any one prompt where the records hold
only the embedded sets).
"""

from __future__ import annotations

import json
import os
import sys

from replay import COST, AutoTokenizer, CostModel, Path, plain_runs  # scripts/drafts/replay.py

MAX_COPY = int(os.environ.get("MAX_COPY", "12"))  # longer: a suffix draft under a larger max_spec_factor


def copy_lengths(prompt: list[int], out: list[int], before: list[list[int]]) -> list[int]:
    """L_i: the most tokens out[i:] copies from the text known at i, right after an occurrence of its last token."""
    lengths = []
    for i in range(len(out)):
        seq = prompt + out[:i]
        best = 0
        for text in [*before, seq]:
            for j in range(1, len(text)):
                if text[j - 1] != seq[-1]:
                    continue
                n = 0
                while n < MAX_COPY and i + n < len(out) and j + n < len(text) and text[j + n] == out[i + n]:
                    n += 1
                best = max(best, n)
        lengths.append(best)
    return lengths


def least_time(lengths: list[int], t) -> float:
    """min over step plans of Σ t(d + 1), a step at i drafting d <= lengths[i] tokens and committing d + 1."""
    n = len(lengths)
    best = [0.0] * (n + 1)
    for i in range(n - 1, -1, -1):
        best[i] = min(t(d + 1) + best[min(n, i + d + 1)] for d in range(lengths[i] + 1))
    return best[0]


def main() -> None:
    tok = AutoTokenizer.from_pretrained(sys.argv[1])
    cost = CostModel.load(Path(COST))
    t = cost.t_target
    if os.environ.get("RHO"):
        rho = [0.0, 1.0, *map(float, os.environ["RHO"].split(","))]
        t = lambda n: cost.t_target(1) * ((n // 3) * rho[3] + rho[n % 3])  # noqa: E731
    records = [json.loads(line) for line in open(sys.argv[3])]
    plain = [r for r in records if r["strategy"] == "plain" and r["temperature"] == 0]
    set_of = {r["prompt_id"]: r["set"] for r in plain}
    share: dict[str, list[float]] = {}
    for r in plain:
        s = share.setdefault(r["set"], [0.0, 0.0])
        s[0] += r["prefill_s"]
        s[1] += r["wall_s"]
    print(
        f"t(n)/t(1), n = 1..9: {[round(t(n) / t(1), 2) for n in range(1, 10)]}; best n / t(n): "
        f"{max(n * t(1) / t(n) for n in range(1, 64)):.3f}"
    )
    per: dict[str, list[float]] = {}
    for run in plain_runs(tok, sys.argv[2], [sys.argv[3]]):
        before: list[list[int]] = []
        for pid, prompt, out in run:
            row = per.setdefault(set_of[pid], [0.0, 0.0, 0.0])
            row[0] += len(out) * t(1)
            row[1] += least_time([len(out)] * len(out), t)
            row[2] += least_time(copy_lengths(prompt, out, before), t)
            before.append(out)
    print("set: prefill share | decode ÷ plain: perfect, copy | end to end: perfect, copy")
    per["all"] = [sum(v[i] for v in per.values()) for i in range(3)]
    share["all"] = [sum(v[i] for v in share.values()) for i in range(2)]
    for name, (p, perfect, copy) in per.items():
        f = share[name][0] / share[name][1]
        d1, d2 = p / perfect, p / copy
        print(f"{name}: {f:.2f} | {d1:.3f}x {d2:.3f}x | {1 / (f + (1 - f) / d1):.3f}x {1 / (f + (1 - f) / d2):.3f}x")


if __name__ == "__main__":
    main()
