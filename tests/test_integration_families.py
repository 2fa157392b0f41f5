"""Real models of other families, from their packages (integration group): Gemma 3 270M (Q4_K_M GGUF, 512-token
sliding windows on 5 of every 6 layers) decoded past its window, and SmolLM2-135M-Instruct (a Llama), each
identical to its own transformers `generate` alone, speculatively (the model drafting for itself, so trees of
several nodes are verified) and in a batch."""

from __future__ import annotations

import pytest
import torch

from speculor import Model, SamplingConfig, engine
from speculor.drafters.chain import ChainDrafter
from speculor.drafters.static_tree import TreeDrafter
from speculor.engine import batch as batched_engine
from speculor.runtime.load import load_model

pytestmark = pytest.mark.integration

TEXT = ("Speculative decoding lets a small draft model propose several tokens that a large target model then "
        "verifies in a single forward pass; the output is exactly the target's own. ")


def own_generate(model, prompt: list[int], n: int) -> list[int]:
    ids = torch.tensor([prompt])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                         do_sample=False)
    return out[0, len(prompt):].tolist()


@pytest.mark.parametrize("name, words, new", [("gemma-3-270m", 560, 40), ("smollm2-135m-instruct", 120, 40)])
def test_a_real_model_of_another_family_equals_its_own_generate(name, words, new):
    torch.set_num_threads(2)
    model, tokenizer = load_model(name)
    model.generation_config.eos_token_id = None  # all `new` tokens
    prompt = tokenizer(TEXT * (words // 30 + 1))["input_ids"][:words]
    if name.startswith("gemma"):
        assert len(prompt) + new >= model.config.sliding_window + 88  # a 600-token context, well past the window
    want = own_generate(model, prompt, new)
    target = Model(model)
    assert [t.id for t in engine.stream(target, None, prompt, SamplingConfig(max_new_tokens=new))] == want
    greedy = SamplingConfig(max_new_tokens=new)
    tree = TreeDrafter(target, [-1, -1, 0, 1], "swor")  # the model drafting for itself: several nodes a step
    assert [t.id for t in engine.stream(target, tree, prompt, greedy)] == want
    other = prompt[len(prompt) // 3:]
    entries = [(ChainDrafter(target, 3), prompt, greedy), (None, other, SamplingConfig(max_new_tokens=new // 2))]
    out: list[list[int]] = [[], []]
    for i, toks in batched_engine.generate(target, entries):
        out[i].extend(t.id for t in toks)
    assert out[0] == want
    assert out[1] == own_generate(model, other, new // 2)
