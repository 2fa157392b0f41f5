"""Every strategy on every device this machine has (the CPU always, a CUDA GPU where one is present): greedy output
equal to the target's own greedy tokens in fp32, batched output equal to each request's output alone, and a seed that
fixes a sampled answer, with the models' weights, caches and random draws on that device."""

from __future__ import annotations

import pytest
import torch
from support.tiny import WORDS, perturbed, reference_greedy, tiny_model, word_tokenizer

from speculor import Model, Pair, SamplingConfig, Speculor
from speculor.engine import batch as batched_engine

pytestmark = pytest.mark.usefixtures("one_thread")
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
ACC = [0.6, 0.15, 0.1, 0.05, 0.03, 0.02, 0.01, 0.01]
STRATEGIES = {  # every strategy whose shared part fits a tiny pair (specdecpp's packaged head is the embedded pair's)
    "chain": dict(k=3),
    "specinfer": {},
    "sequoia": dict(budget=8, depth=4, width=3, acc=ACC),
    "dyspec": dict(budget=8),
    "topk-tree": dict(budget=8, depth=3, k=2),
    "gsd": dict(budget=8),
    "ngram": dict(k=3),
    "suffix": dict(budget=8),
}
PROMPTS = [[1, 2, 3, 4, 5], [42], [99, 0, 13, 56, 21, 8, 3, 71, 30]]
N = 16


@pytest.fixture(scope="module", params=DEVICES)
def device_pair(request) -> tuple[str, Pair]:
    target = tiny_model(0, vocab=len(WORDS), context=64).to(request.param)
    draft = perturbed(tiny_model(0, vocab=len(WORDS), context=64), 0.1, seed=2).to(request.param)
    # the draft through lean.py's forward, as load_pair runs it
    return request.param, Pair(Model(target), Model(draft, lean=True), word_tokenizer(WORDS), "tiny-t", "tiny-d")


@pytest.fixture(scope="module")
def references(device_pair) -> list[list[int]]:
    _, pair = device_pair
    return [reference_greedy(pair.target.model, p, N) for p in PROMPTS]  # on the model's device


def test_reference_is_the_cpu_reference(device_pair, references):
    """The device's own greedy tokens (what every strategy must match there) are the CPU model's too."""
    cpu = tiny_model(0, vocab=len(WORDS), context=64)
    assert references == [reference_greedy(cpu, p, N) for p in PROMPTS]


@pytest.mark.parametrize("name", ["plain", *STRATEGIES])
def test_greedy_equals_the_targets_greedy(device_pair, references, name):
    device, pair = device_pair
    sp = Speculor(pair, strategy=name, **STRATEGIES.get(name, {}))
    cfg = SamplingConfig(max_new_tokens=N, stop_on_eos=False)
    taus = []
    for prompt, ref in zip(PROMPTS, references, strict=True):
        out = sp.generate(prompt, cfg)
        assert out.token_ids == ref, f"{name} on {device}, prompt {prompt}"
        taus.append(out.tau)
    assert name in ("plain", "ngram", "suffix") or max(taus) > 1  # the draft was used: a step accepted a draft token


def _entries(sp: Speculor, names: list[str], cfgs: list[SamplingConfig]):
    out = []
    for name, prompt, cfg in zip(names, PROMPTS, cfgs, strict=True):
        shared = sp.strategy_for(name, **STRATEGIES.get(name, {}))
        out.append((shared.drafter() if shared is not None else None, prompt, cfg))
    return out


def _batched(sp: Speculor, names: list[str], cfgs: list[SamplingConfig]) -> list[list[int]]:
    got: list[list[int]] = [[] for _ in names]
    for i, toks in batched_engine.generate(sp.pair.target, _entries(sp, names, cfgs)):
        got[i].extend(t.id for t in toks)
    return got


@pytest.mark.parametrize("names", [["chain", "dyspec", "plain"], ["sequoia", "specinfer", "topk-tree"],
                                   ["suffix", "ngram", "suffix"]])
def test_batched_greedy_is_each_alone(device_pair, references, names):
    _, pair = device_pair
    sp = Speculor(pair, strategy="plain")
    cfgs = [SamplingConfig(max_new_tokens=N, stop_on_eos=False)] * len(names)
    assert _batched(sp, names, cfgs) == references


def test_a_seed_fixes_a_sampled_answer_alone_and_in_a_batch(device_pair):
    device, pair = device_pair
    sp = Speculor(pair, strategy="chain", k=3)
    cfgs = [SamplingConfig(temperature=0.9, seed=7 + i, max_new_tokens=N, stop_on_eos=False) for i in range(3)]
    alone = [sp.generate(p, c).token_ids for p, c in zip(PROMPTS, cfgs, strict=True)]
    assert alone == [sp.generate(p, c).token_ids for p, c in zip(PROMPTS, cfgs, strict=True)]
    assert _batched(sp, ["chain"] * 3, cfgs) == alone, device
    other = sp.generate(PROMPTS[0], SamplingConfig(temperature=0.9, seed=8, max_new_tokens=N, stop_on_eos=False))
    assert other.token_ids != alone[0]  # the seed matters (negative control: a fixed stream would pass above)


def test_offloaded_target_decodes_the_same_tokens(references, device_pair):
    """Weights kept in CPU memory and copied in for each module's forward (accelerate's hooks): the parameters are
    meta tensors, the forward runs on the device given, and every strategy's greedy output is unchanged."""
    from speculor.runtime.load import offload_to

    device, pair = device_pair
    target = tiny_model(0, vocab=len(WORDS), context=64)
    offload_to(target, device)
    assert {p.device.type for p in target.parameters()} == {"meta"}
    offloaded = Pair(Model(target, device=device), pair.draft, pair.tokenizer)
    cfg = SamplingConfig(max_new_tokens=N, stop_on_eos=False)
    for name in ("plain", "chain", "sequoia", "dyspec"):
        sp = Speculor(offloaded, strategy=name, **STRATEGIES.get(name, {}))
        assert [sp.generate(p, cfg).token_ids for p in PROMPTS] == references, name


def test_bad_device_gets_a_clear_error():
    from speculor import SpeculorError
    from speculor.runtime.plan import check_device

    for bad in ("gpu", "cuda:99") + (() if torch.cuda.is_available() else ("cuda",)):
        with pytest.raises(SpeculorError, match="device"):
            check_device(bad)
    with pytest.raises(SpeculorError, match="--offload"):
        check_device("cpu", offload=True)
    check_device("cpu")
