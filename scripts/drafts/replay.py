"""Replay model-free drafters on plain greedy outputs, priced by this machine's measured t(n).

At T = 0 a strategy's output is plain decoding's, token for token, so each step of a model-free drafter (its tree
depends only on the committed tokens) and what the target accepts of it can be recomputed offline from the plain
records of a bench run: the accepted path is the tree's longest chain equal to the next plain tokens. A step of n
draft rows costs t_target(n + 1) of the cached exact cost curve; plain decoding costs t_target(1) a token. The
ratio is decode speed alone (prefill out), free of the machine's noise, with host time left out.

    [COST=cost.json] [PRICE=cost.json [TIMED=1]] python replay.py TARGET_TOKENIZER_DIR SPEC_BENCH_QUESTIONS \
        records.jsonl [records.jsonl ...]

PRICE: the curve the drafters decide by (default COST's), as when the machine's curve moved after its profile;
TIMED=1: that curve corrected by the calls as they are replayed (runtime/cost.Measured, as on llama.cpp), each call
of k <= 3 rows timed at COST's t(k).

Records files are bench outputs (`speculor bench --out`); each file is replayed as one run (suffix's shared trie and
trust start empty for each, as a bench round does), prompts in the file's order.
"""

from __future__ import annotations

import json
import os
import sys
from functools import partial
from pathlib import Path

from transformers import AutoTokenizer

from speculor.bench import prompts as sets
from speculor.drafters import lookup, suffix
from speculor.drafters.base import Shared
from speculor.drafters.refit import replay as steps
from speculor.runtime.call_times import CallTimes
from speculor.runtime.cost import CostModel, Measured

COST = os.environ.get("COST") or next(
    (Path.home() / ".cache/speculor/sequoia").glob("cost--qwen2.5-coder-1.5b-instruct--*b9efb519b46c.json")
)  # the embedded pair's exact llama.cpp curve


def prompt_ids(tok, p) -> list[int]:
    if not p.chat:
        return tok(p.text)["input_ids"]
    out = tok.apply_chat_template([{"role": "user", "content": p.text}], add_generation_prompt=True, tokenize=True)
    return list(out["input_ids"] if hasattr(out, "keys") else out)


def plain_runs(tok, questions: str, files: list[str], temperature: float = 0.0) -> list[list[tuple]]:
    """Each records file's plain answers of its first round at `temperature`, as (prompt id, prompt's token ids,
    answer's token ids); prompts from the embedded sets and from the `questions` file."""
    known = {p.id: p for name in ("mtbench", "humaneval", "summarize", "code-edit") for p in sets.load([name])}
    known |= {p.id: p for p in sets.file_set(Path(questions))}
    return [
        [
            (r["prompt_id"], prompt_ids(tok, known[r["prompt_id"]]), r["token_ids"])
            for r in map(json.loads, open(f))
            if r["strategy"] == "plain" and r.get("round", 0) == 0 and r["temperature"] == temperature
        ]
        for f in files
    ]


def replay(drafter, prompt: list[int], out: list[int], cost, calls: CallTimes | None = None, on_step=None) -> float:
    """Seconds of the drafter's steps over `out` (module docstring; the steps: speculor.drafters.refit.replay);
    `calls`: each step's calls timed there; `on_step(drafter, tokens, path)` sees each step's tree and its accepted
    path."""
    seconds = 0.0

    def timed(d, toks: list[int], path: list[int]) -> None:
        nonlocal seconds
        if on_step is not None:
            on_step(d, toks, path)
        seconds += cost.t_target(1 + len(toks))
        if calls is not None:
            q, r = divmod(1 + len(toks), 3)
            for k in [3] * q + [r] * (r > 0):
                calls.add(k, cost.t_target(k))

    steps(drafter, prompt, out, timed)
    return seconds


def main() -> None:
    tok = AutoTokenizer.from_pretrained(sys.argv[1])
    cost = CostModel.load(Path(COST))
    profile = CostModel.load(Path(os.environ.get("PRICE") or COST))  # what the drafters decide by
    timed = bool(os.environ.get("TIMED"))
    runs = plain_runs(tok, sys.argv[2], sys.argv[3:])
    variants = {
        f"suffix max_spec_factor={f}": (
            lambda price, f=f: suffix.SuffixStrategy(suffix.SuffixOptions(budget="auto", max_spec_factor=f), price)
        )
        for f in (1024, 2, 1, 0.5)
    }
    variants["ngram (k=8, n=3, auto)"] = lambda price: Shared(partial(lookup.NgramDrafter, cost=price))
    print(f"t(n)/t(1), n = 1..8: {[round(cost.t_target(n) / cost.t_target(1), 2) for n in range(1, 9)]}")
    for name, make in variants.items():
        per: dict[str, list[float]] = {}
        for run in runs:
            calls = CallTimes(3) if timed else None  # a fresh process a run
            strategy = make(Measured(profile, calls) if calls else profile)
            for pid, prompt, out in run:
                drafter = strategy.drafter()  # a request's own, as the engine makes it
                s = pid.split("/")[0].lower()
                per.setdefault(s, [0.0, 0.0])
                per[s][0] += replay(drafter, prompt, out, cost, calls)
                per[s][1] += len(out) * cost.t_target(1)
        print(f"{name}: " + ", ".join(f"{s} {b / a:.3f}x" for s, (a, b) in per.items()), flush=True)


if __name__ == "__main__":
    main()
