"""A draft with another tokenizer (drafters/cross_vocab.py): its proposals go through text and are verified as point
masses. On tiny transformers models whose tokenizers number the same words differently: greedy output identical to
the target's, most proposals accepted (the text round trip lines up); on toys: the exact law at temperature 1
through the engine, and a biased verifier caught by the same harness."""

from __future__ import annotations

import pytest
import torch
from support.stats import goodness_of_fit
from support.tiny import WORDS, perturbed, reference_greedy, tiny_model, word_tokenizer
from support.toy import PROMPT, N, ToyLM, V, exact_law, random_toy

import speculor.core.verify
from speculor import Model, SamplingConfig, engine
from speculor.drafters.cross_vocab import CrossVocabDrafter

pytestmark = pytest.mark.usefixtures("one_thread")


def renumbered(model, perm: torch.Tensor):
    """The model over another numbering of its tokens: draft id i is target id perm[i] (rows of the embedding and
    the head permuted)."""
    with torch.no_grad():
        model.get_input_embeddings().weight.copy_(model.get_input_embeddings().weight[perm])
        model.get_output_embeddings().weight.copy_(model.get_output_embeddings().weight[perm])
    return model


@pytest.fixture(scope="module")
def words():
    """(target, draft model, target tokenizer, draft tokenizer): the draft is the target nudged and renumbered."""
    target = tiny_model(0, vocab=len(WORDS), context=128)
    perm = torch.randperm(len(WORDS), generator=torch.Generator().manual_seed(3))
    draft = renumbered(perturbed(target, 0.05, seed=2), perm)
    return target, draft, word_tokenizer(WORDS), word_tokenizer([WORDS[i] for i in perm.tolist()])


@pytest.mark.parametrize("prompt", [[5, 7, 9, 11], [42], [3, 3, 3, 3, 3]])
def test_greedy_output_is_the_targets_and_proposals_are_accepted(words, prompt):
    target, draft, t_tok, d_tok = words
    stats = engine.Stats()
    drafter = CrossVocabDrafter(Model(draft), d_tok, t_tok, 4)
    cfg = SamplingConfig(max_new_tokens=40, stop_on_eos=False)
    got = [t.id for t in engine.stream(Model(target), drafter, prompt, cfg, stats=stats)]
    assert got == reference_greedy(target, prompt, 40)
    assert stats.tau > 2  # the text round trip maps the draft's words onto the target's ids


def test_a_draft_that_cannot_line_up_proposes_nothing(words):
    target, draft, t_tok, d_tok = words
    drafter = CrossVocabDrafter(Model(draft), d_tok, t_tok, 3)
    drafter.draft_tok = word_tokenizer(["<unk>", "<eos>"] + [f"x{i}" for i in range(2, 100)])  # no common words
    got = [t.id for t in engine.stream(Model(target), drafter, [5, 7], SamplingConfig(max_new_tokens=8,
                                                                                      stop_on_eos=False))]
    assert got == reference_greedy(target, [5, 7], 8)


TOY_WORDS = [f"t{i}" for i in range(V)]


def toy_pair() -> tuple[ToyLM, ToyLM, object, object]:
    """A toy target, a toy draft over a reversed numbering of the same words, and both word tokenizers."""
    target = random_toy(seed=5)
    near = random_toy(seed=6, scale=0.5)
    perm = torch.arange(V - 1, -1, -1)
    draft = ToyLM((target.a.detach() + near.a.detach())[perm][:, perm], target.b.detach()[perm][:, perm],
                  target.b_start.detach()[perm])
    return target, draft, word_tokenizer(TOY_WORDS), word_tokenizer([TOY_WORDS[i] for i in perm.tolist()])


def toy_counts(m: int) -> tuple[torch.Tensor, torch.Tensor]:
    target, draft, t_tok, d_tok = toy_pair()
    t_model, d_model = Model(target), Model(draft)
    counts = torch.zeros([V] * N, dtype=torch.float64)
    for i in range(m):
        drafter = CrossVocabDrafter(d_model, d_tok, t_tok, 2)
        cfg = SamplingConfig(temperature=1.0, seed=3000 + i, max_new_tokens=N, stop_on_eos=False)
        counts[tuple(t.id for t in engine.stream(t_model, drafter, PROMPT, cfg))] += 1
    return counts, exact_law(target, PROMPT, SamplingConfig(temperature=1.0), N)


def test_sampling_through_text_follows_the_exact_law():
    counts, law = toy_counts(3000)
    pvalue, tv, floor = goodness_of_fit(counts, law)
    assert pvalue > 1e-3 and tv < 2 * floor, f"p-value {pvalue:.2e}, TV {tv:.4f}, floor {floor:.4f}"


def test_chi_square_catches_a_point_mass_rule_without_its_residual(monkeypatch):
    monkeypatch.setattr(speculor.core.verify, "residual", lambda r, d: r)
    counts, law = toy_counts(1500)
    pvalue, tv, _ = goodness_of_fit(counts, law)
    assert pvalue < 1e-6, f"biased verifier not detected: p-value {pvalue:.2e}, TV {tv:.4f}"
