"""The request's logit transforms (logit_bias, repetition / frequency / presence penalties, min_p) and reported
log-probabilities (core/logits.py), against a reference written here from the definitions: plain and speculative
greedy decoding choose the transformed argmax at every tree node; sampling follows the exact law of the transformed
distribution through the engine (chi-square, trees whose branches see different histories), with a negative control
that scores every node with its root's history."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from support.stats import goodness_of_fit
from support.toy import PROMPT, N, V, perturbed, random_toy

import speculor.core.logits
from speculor import engine
from speculor.config import SamplingConfig
from speculor.core.sampling import warp
from speculor.drafters.chain import ChainDrafter
from speculor.drafters.static_tree import TreeDrafter
from speculor.errors import SpeculorError
from speculor.runtime.model import Model

PENALTIES = dict(repetition_penalty=1.6, frequency_penalty=0.7, presence_penalty=1.2, logit_bias={2: 1.5, 4: -0.8})


@pytest.fixture(scope="module")
def target():
    return random_toy(seed=3)


@pytest.fixture(scope="module")
def draft(target):
    return perturbed(target, seed=4, noise=0.6)


def reference_z(model, prompt: list[int], out: list[int], cfg: SamplingConfig) -> torch.Tensor:
    """The transformed logits after prompt + out, from the definitions (fp64)."""
    z = model.next_logits(prompt + out).detach().double()
    for t, b in cfg.logit_bias:
        z[t] += b
    r = cfg.repetition_penalty
    for t in set(prompt + out):
        z[t] = z[t] / r if z[t] > 0 else z[t] * r
    for t in set(out):
        z[t] -= cfg.frequency_penalty * out.count(t) + cfg.presence_penalty
    return z


def reference_greedy(model, prompt: list[int], cfg: SamplingConfig, n: int) -> list[int]:
    out: list[int] = []
    for _ in range(n):
        out.append(int(torch.argmax(reference_z(model, prompt, out, cfg))))
    return out


def reference_law(model, prompt: list[int], cfg: SamplingConfig, n: int) -> torch.Tensor:
    """The exact law [V] * n of the first n tokens under the transforms, by enumeration."""
    import itertools

    law = torch.zeros([V] * n, dtype=torch.float64)
    for cell in itertools.product(range(V), repeat=n):
        prob = 1.0
        for i, tok in enumerate(cell):
            p = warp(reference_z(model, prompt, list(cell[:i]), cfg).float(), cfg).double()
            prob *= float(p[tok] / p.sum())
        law[cell] = prob
    return law


def drafters(draft):
    d = Model(draft)
    return {"chain": lambda: ChainDrafter(d, 3), "tree": lambda: TreeDrafter(d, [-1, -1, 0, 0, 1, 2], "swor")}


@pytest.mark.parametrize("kind", ["chain", "tree"])
@pytest.mark.parametrize("prompt", [PROMPT, [5, 5, 0, 1]])
def test_greedy_with_transforms_equals_the_reference(target, draft, kind, prompt):
    cfg = SamplingConfig(temperature=0, max_new_tokens=12, **PENALTIES)
    want = reference_greedy(target, prompt, cfg, 12)
    model = Model(target)
    assert [t.id for t in engine.stream(model, None, prompt, cfg)] == want
    assert [t.id for t in engine.stream(model, drafters(draft)[kind](), prompt, cfg)] == want
    assert want != reference_greedy(target, prompt, SamplingConfig(temperature=0), 12)  # the transforms matter


def test_logit_bias_bans_and_forces(target):
    model = Model(target)
    first = [t.id for t in engine.stream(model, None, PROMPT, SamplingConfig(max_new_tokens=1))][0]
    banned = [t.id for t in engine.stream(model, None, PROMPT, SamplingConfig(max_new_tokens=6,
                                                                                logit_bias={first: -100}))]
    assert banned[0] != first
    forced = SamplingConfig(temperature=1.0, seed=1, max_new_tokens=8, logit_bias={3: 100})
    assert [t.id for t in engine.stream(model, ChainDrafter(Model(target), 2), PROMPT, forced)] == [3] * 8


@pytest.mark.parametrize("kind", ["chain", "tree"])
def test_sampling_with_transforms_follows_the_exact_law(target, draft, kind):
    cfg = SamplingConfig(temperature=1.0, min_p=0.05, **PENALTIES)
    law = reference_law(target, PROMPT, cfg, N)
    pvalue, tv, floor = goodness_of_fit(counts(target, drafters(draft)[kind], cfg, 2000), law)
    assert pvalue > 1e-3, f"chi-square p-value {pvalue:.2e} (TV {tv:.4f}, noise floor {floor:.4f})"
    assert tv < 2 * floor


def test_chi_square_catches_nodes_scored_with_the_roots_history(target, draft, monkeypatch):
    """Negative control: penalties from the committed history only (a tree's own path ignored) are biased."""
    monkeypatch.setattr(speculor.core.logits, "path_to", lambda parents, node: [])
    cfg = SamplingConfig(temperature=1.0, **PENALTIES)
    pvalue, tv, _ = goodness_of_fit(counts(target, drafters(draft)["chain"], cfg, 600),
                                    reference_law(target, PROMPT, cfg, N))
    assert pvalue < 1e-6, f"root-history penalties not detected: p-value {pvalue:.2e}, TV {tv:.4f}"


def counts(target, make, cfg: SamplingConfig, m: int) -> torch.Tensor:
    model = Model(target)
    out = torch.zeros([V] * N, dtype=torch.float64)
    for i in range(m):
        run = replace(cfg, max_new_tokens=N, seed=2000 + i)
        out[tuple(t.id for t in engine.stream(model, make(), PROMPT, run))] += 1
    return out


def test_logprobs_are_the_transformed_distributions(target, draft):
    for temperature in (0, 0.8):
        cfg = SamplingConfig(temperature=temperature, seed=9, max_new_tokens=10, logprobs=3, top_p=0.95,
                             **PENALTIES)
        toks = list(engine.stream(Model(target), drafters(draft)["tree"](), PROMPT, cfg))
        out: list[int] = []
        for tok in toks:
            z = reference_z(target, PROMPT, out, cfg)
            lp = torch.log_softmax(z, -1) if temperature == 0 else torch.log(warp(z.float(), cfg).double())
            assert tok.logprob == pytest.approx(float(lp[tok.id]), abs=1e-5)
            top = torch.topk(lp, 3)
            assert [t for t, _ in tok.top] == top.indices.tolist()
            assert [v for _, v in tok.top] == pytest.approx(top.values.tolist(), abs=1e-5)
            out.append(tok.id)
    assert all(t.logprob is None and t.top == () for t in engine.stream(Model(target), None, PROMPT,
                                                                          SamplingConfig(max_new_tokens=3)))


@pytest.mark.parametrize("field, value", [("presence_penalty", 2.5), ("frequency_penalty", float("nan")),
                                          ("repetition_penalty", 0), ("min_p", 1.5), ("logit_bias", {-1: 1.0}),
                                          ("logit_bias", {3: 101}), ("logprobs", 21)])
def test_bad_values_are_refused(field, value):
    with pytest.raises(SpeculorError, match=field):
        SamplingConfig(**{field: value})


def test_a_bias_outside_the_vocabulary_is_refused(target):
    with pytest.raises(SpeculorError, match="logit_bias"):
        list(engine.stream(Model(target), None, PROMPT, SamplingConfig(logit_bias={V: 1.0})))
