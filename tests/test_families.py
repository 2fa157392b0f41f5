"""The architecture matrix: a tiny random model of every supported family (support/families.py; fp32, CPU, no
download), sliding-window variants decoded well past their window. On each: plain and speculative decoding equal the
model's own greedy `generate`; a batch of three requests with mixed strategies and sampling settings gives each the
tokens it gets alone; a model with recurrent layers is refused by name."""

from __future__ import annotations

import warnings

import pytest
import torch
from support.batch import run_batch
from support.families import FAMILIES, WINDOW, family_model
from support.tiny import perturbed
from transformers import AutoConfig

from speculor import Model, SamplingConfig, SpeculorError, engine
from speculor.drafters.chain import ChainDrafter
from speculor.drafters.ngram import NgramDrafter
from speculor.drafters.static_tree import TreeDrafter
from speculor.runtime import model as model_module
from speculor.runtime.backend import Block
from speculor.runtime.layers import layer_windows

N = 5 * WINDOW  # tokens decoded: well past the sliding window
PROMPTS = [[3, 4, 5, 6, 7], [9], list(range(11, 11 + 2 * WINDOW))]  # the last prompt alone is longer than a window

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module", params=FAMILIES)
def family(request):
    """(name, target, draft): the draft is the target with its weights moved by 0.1 of their spread."""
    target = family_model(request.param)
    target.generation_config.eos_token_id = None  # decode all N tokens
    return request.param, target, perturbed(target, 0.1, seed=1)


def own_generate(model, prompt: list[int], n: int) -> list[int]:
    ids = torch.tensor([prompt])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                         do_sample=False)
    return out[0, len(prompt):].tolist()


def test_windows_are_read_from_the_config(family):
    name, target, _ = family
    windows = Model(target).windows
    assert len(windows) == target.config.num_hidden_layers
    assert (WINDOW in windows) == ("window" in name or name.startswith("gemma") and name != "gemma")


@pytest.mark.parametrize("prompt", PROMPTS)
def test_one_request_equals_the_models_own_generate(family, prompt):
    _, target, draft = family
    want = own_generate(target, prompt, N)
    model, draft_model = Model(target), Model(draft)
    greedy = SamplingConfig(temperature=0, max_new_tokens=N)
    for drafter in (None, ChainDrafter(draft_model, 3), TreeDrafter(draft_model, [-1, -1, 0, 1, 2], "swor")):
        got = [t.id for t in engine.stream(model, drafter, prompt, greedy)]
        assert got == want, f"{type(drafter).__name__}: {got} != {want}"


def test_a_batch_of_mixed_strategies_equals_each_alone(family):
    _, target, draft = family
    model, draft_model = Model(target), Model(draft)
    makers = [lambda: ChainDrafter(draft_model, 3), lambda: None,
              lambda: TreeDrafter(draft_model, [-1, -1, 0, 1], "swor")]
    cfgs = [SamplingConfig(temperature=0, max_new_tokens=N), SamplingConfig(temperature=0.8, seed=5, max_new_tokens=N),
            SamplingConfig(temperature=1.0, top_p=0.9, seed=7, max_new_tokens=N - 3)]
    alone = [[t.id for t in engine.stream(model, make(), p, c)] for make, p, c in zip(makers, PROMPTS, cfgs,
                                                                                          strict=True)]
    assert run_batch(model, makers, PROMPTS, cfgs) == alone
    ngram = [lambda: NgramDrafter(k=4)] * 2
    assert run_batch(model, ngram + makers[:1], PROMPTS[::-1], cfgs[::-1]) == [
        [t.id for t in engine.stream(model, make(), p, c)] for make, p, c in zip(ngram + makers[:1], PROMPTS[::-1],
                                                                                  cfgs[::-1], strict=True)]


def test_the_forward_gives_the_models_own_logits(family):
    """Every row of a block, a prompt and a tree beside it, has the logits the model's own forward gives at the end
    of that row's path, to fp32 rounding: a difference in the forward path (not rounding) shows here before it
    flips an argmax."""
    _, target, _ = family
    prompt = PROMPTS[0]
    n = len(prompt)
    tree = [(20, n - 1), (21, n - 1), (22, n), (23, n + 2)]  # (token, parent row): two branches, one of depth 3
    parents = list(range(-1, n - 1)) + [p for _, p in tree]
    model = Model(target)
    got = model.forward([Block(model.new_cache(), prompt + [t for t, _ in tree], torch.tensor(parents))])[0].logits
    tokens = prompt + [t for t, _ in tree]
    for row in range(len(tokens)):
        path, at = [], row
        while at >= 0:
            path.append(tokens[at])
            at = parents[at]
        want = target(torch.tensor([path[::-1]])).logits[0, -1]
        assert torch.allclose(got[row], want, atol=1e-4, rtol=0), f"row {row}: {(got[row] - want).abs().max()}"


@pytest.mark.parametrize("seed", [1, 2, 3])
@pytest.mark.parametrize("name", ["mixtral", "qwen2_moe"])
def test_mixture_of_experts_equals_its_own_generate_over_seeds(name, seed):
    """An expert router's top-k is discontinuous: a path that computes a row otherwise than the model's own forward
    shows as a different expert, then a different token. Several seeds, the size of a reported Mixtral case
    (vocab 256, hidden 64, 2 layers, 4 experts, top 2, prompt 5..21, 24 tokens)."""
    target = family_model(name, seed, layers=2, hidden=64, vocab=256)
    target.generation_config.eos_token_id = None
    prompt = list(range(5, 22))
    want = own_generate(target, prompt, 24)
    model = Model(target)
    for drafter in (None, ChainDrafter(Model(perturbed(target, 0.1, seed=seed)), 3)):
        assert [t.id for t in engine.stream(model, drafter, prompt,
                                            SamplingConfig(temperature=0, max_new_tokens=24))] == want


@pytest.mark.parametrize("kind, layer_types", [("mamba", None), ("qwen3_next", None),
                                               ("qwen2", ["full_attention", "linear_attention"])])
def test_models_that_cannot_branch_are_refused_by_name(kind, layer_types):
    config = AutoConfig.for_model("qwen2", num_hidden_layers=2)
    config.model_type = kind  # the refusal reads the config only
    if layer_types:
        config.layer_types = layer_types
    with pytest.raises(SpeculorError, match=kind if layer_types is None else "linear_attention"):
        layer_windows(config)


def test_no_deprecated_argument_reaches_transformers(family):
    """transformers 5.24 renamed `past_key_values` to `cache` (the old name goes in 5.40): a forward, alone and
    batched, must not use a deprecated argument."""
    _, target, draft = family
    model = Model(target)
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        assert run_batch(model, [lambda: None, lambda: ChainDrafter(Model(draft), 2)], PROMPTS[:2],
                         [SamplingConfig(temperature=0, max_new_tokens=4)] * 2)


@pytest.mark.parametrize("name", ["qwen2-window", "gemma2"])
def test_a_long_prompt_is_filled_in_chunks(name, monkeypatch):
    """A chain longer than PREFILL_ROWS runs PREFILL_ROWS rows a forward (masks of at most that many rows), with
    the output of the model's own generate, for a batching model and one that runs blocks one at a time."""
    target = family_model(name)
    target.generation_config.eos_token_id = None
    prompt = list(range(3, 3 + 3 * WINDOW + 1))
    want = own_generate(target, prompt, N)
    monkeypatch.setattr(model_module, "PREFILL_ROWS", WINDOW - 3)
    shapes = []
    forward = target.forward
    monkeypatch.setattr(target, "forward", lambda *a, **k: shapes.append(k["input_ids"].shape[1]) or forward(*a, **k))
    model = Model(target)
    assert [t.id for t in engine.stream(model, ChainDrafter(Model(target), 2), prompt,
                                        SamplingConfig(temperature=0, max_new_tokens=N))] == want
    assert shapes[:4] == [WINDOW - 3] * 4 and max(shapes) == WINDOW - 3
