"""Rows on the llama.cpp backend for tests/test_llama.py: a prompt, a tree below it and
its paths, a prompt filled and kept, a sequence decoded a token a call."""

from __future__ import annotations

from speculor.runtime.backend import forward1

PROMPT = [785, 3974, 13876, 38835, 34208, 916, 279, 15678, 5562, 13, 576]
# a tree below the root: a, b; a's children c, d; b's child e (region parents; the root is row 0)
TREE = [100, 200, 300, 400, 500]
PARENTS = [-1, 0, 0, 1, 1, 2]
PATHS = {1: [100], 2: [200], 3: [100, 300], 4: [100, 400], 5: [200, 500]}
PREFIX = len(PROMPT) - 1


def prefilled(model, tokens):
    cache = model.new_cache()
    forward1(model, cache, tokens)
    cache.keep(list(range(len(tokens))))
    return cache


def alone(model, seq, prefix=PREFIX):
    """The last row's logits of seq, decoded one token a call after its prefix."""
    cache = prefilled(model, seq[:prefix])
    for t in seq[prefix:]:
        logits = forward1(model, cache, [t]).logits[0]
        cache.keep([0])
    return logits
