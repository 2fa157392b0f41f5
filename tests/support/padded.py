"""Run in a fresh interpreter by tests/test_llama_padded.py: calls="padded" needs ggml's tiled matmul off from the
process's first matmul, which the other llama.cpp tests have done by then. Prints one JSON object of checks."""

from __future__ import annotations

import json
import sys

import torch

from speculor import SamplingConfig, Speculor, load_pair
from speculor.engine import batch as batched_engine
from speculor.runtime.backend import Block, forward1
from speculor.runtime.llama import model as llama
from speculor.runtime.llama import padded
from support.llama_rows import PARENTS, PATHS, PROMPT, TREE, alone, prefilled


def tree_equals_alone(model, context) -> bool:
    """Each row of a 6-row tree after `context` equals its path decoded a token a call (each call padded)."""
    cache = prefilled(model, context[:-1])
    logits = forward1(model, cache, [context[-1]] + TREE, torch.tensor(PARENTS)).logits
    return all(torch.equal(logits[r], alone(model, context + p, len(context) - 1)) for r, p in PATHS.items())


def beside_equals_alone(model) -> bool:
    """Rows packed with another request's tree and a 40-token prompt chunk equal the rows alone."""
    a, b = prefilled(model, PROMPT[:-1]), prefilled(model, PROMPT[3:-1])
    fresh = model.new_cache()
    ra, rb, _ = model.forward([Block(a, [PROMPT[-1], 100]), Block(b, [PROMPT[-1], 200, 300], torch.tensor([-1, 0, 0])),
                               Block(fresh, (PROMPT * 4)[:40], last=True)])
    return (torch.equal(ra.logits[1], alone(model, PROMPT + [100], len(PROMPT) - 1))
            and torch.equal(rb.logits[2], alone(model, PROMPT[3:] + [300], len(PROMPT) - 4)))


def last_equals_all(model) -> bool:
    """A chain's last row asked alone (one output of 4 rows) equals the same row with every row's output."""
    chain = [PROMPT[-1], 100, 200, 300]
    one = model.forward([Block(prefilled(model, PROMPT[:-1]), chain, last=True)])[0].logits[-1]
    return torch.equal(one, forward1(model, prefilled(model, PROMPT[:-1]), chain).logits[-1])


def main() -> None:
    out = {}
    pair = load_pair(backend="llama.cpp", threads=2, calls="padded")
    target, draft = pair.target, pair.draft
    out["draft_calls"] = draft.calls
    out["tree"] = tree_equals_alone(target, PROMPT)
    out["tree_long"] = tree_equals_alone(target, (PROMPT * 60)[:700])
    out["beside"] = beside_equals_alone(target)
    out["last"] = last_equals_all(target)
    sp = Speculor(pair, strategy="plain")
    cfg = SamplingConfig(max_new_tokens=32)
    prompts = [sp.encode(t, chat=True) for t in ("Write a Python function that returns the n-th Fibonacci number.",
                                                 "Name three prime numbers.")]
    plain = [sp.generate(p, cfg, strategy="plain").token_ids for p in prompts]
    out["speculative"] = all(sp.generate(p, cfg, strategy=s, **o).token_ids == want
                             for p, want in zip(prompts, plain, strict=True)
                             for s, o in (("chain", {"k": 3}), ("suffix", {}), ("dyspec", {"budget": 4})))
    strategy = sp.strategy_for("chain", k=2)
    got: list[list[int]] = [[] for _ in prompts]
    for i, toks in batched_engine.generate(target, [(strategy.drafter(), p, cfg) for p in prompts], sp.eos_ids):
        got[i].extend(t.id for t in toks)
    out["batched"] = got == plain
    exact = llama.LlamaModel(target.path, threads=2)  # the other class: its rows are other bits
    n = len(PROMPT) - 1
    out["classes_differ"] = not torch.equal(alone(exact, PROMPT, n), alone(target, PROMPT, n))
    if "--negative" in sys.argv:  # no padding: a lone row by the vector kernels, 4 of a tree's 6 by the block ones
        padded.pad = lambda rows, outputs: (0, 0)
        out["tree_unpadded"] = tree_equals_alone(target, PROMPT)
        padded.pad = lambda rows, outputs: (0, -rows % padded.PAD)  # rows padded, outputs not
        out["last_unpadded"] = last_equals_all(target)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
