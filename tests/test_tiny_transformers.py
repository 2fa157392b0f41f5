"""Tiny random transformers Qwen2 models (fp32, CPU, no download): tree mask / KV cache / positions, greedy equality,
self-drafting, and bad inputs through the public API."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
from support.tiny import WORDS, perturbed, reference_greedy, reference_logits, tiny_model, word_tokenizer
from transformers import PreTrainedTokenizerFast, Qwen2ForCausalLM

from speculor import Model, Pair, SamplingConfig, Speculor, SpeculorError, engine, load_pair
from speculor.core.tree import block_parents, path_to
from speculor.drafters.chain import ChainDrafter
from speculor.runtime.backend import forward1
from speculor.runtime.load import check_same_vocab, load_model

VOCAB = len(WORDS)  # 100
CONTEXT = 64
PROMPTS = [[1, 2, 3, 4, 5], [42], [7, 7, 7, 7], [99, 0, 13, 56, 21, 8, 3, 71, 30]]


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def target() -> Qwen2ForCausalLM:
    return tiny_model(0, vocab=VOCAB, context=CONTEXT)


@pytest.fixture(scope="module")
def drafts(target) -> dict[str, Qwen2ForCausalLM]:
    return {
        # an unrelated second model: almost nothing accepted
        "random": tiny_model(1, hidden=16, layers=1, vocab=VOCAB, context=CONTEXT),
        "near": perturbed(target, 0.1, seed=2),  # accepts runs of 0..K tokens
    }


@pytest.fixture(scope="module")
def tokenizer() -> PreTrainedTokenizerFast:
    return word_tokenizer(WORDS)


# ---------------------------------------------------------------- (a) tree mask, positions and cache

#        root
#       /  |  \
#      0   1   7
#     / \  |
#    2   3 4
#    |     |
#    5     6
PARENTS = torch.tensor([-1, -1, 0, 0, 1, 2, 4, -1])
TOKENS = torch.tensor([11, 12, 13, 14, 15, 16, 17, 11])  # node 7 repeats node 0's token in another place


@pytest.mark.parametrize("prompt", [[5, 7, 9, 11, 13, 2], [30]])
def test_tree_logits_equal_path_logits(target, prompt):
    model = Model(target)
    cache = model.new_cache()
    if len(prompt) > 1:
        forward1(model, cache, prompt[:-1])
        cache.keep(list(range(len(prompt) - 1)))
    logits = forward1(model, cache, torch.cat([torch.tensor(prompt[-1:]), TOKENS]), block_parents(PARENTS)).logits
    assert logits.shape == (len(TOKENS) + 1, VOCAB) and logits.dtype == torch.float32
    assert (logits[0] - reference_logits(target, prompt)).abs().max() < 1e-4
    for i in range(len(TOKENS)):
        path = [int(TOKENS[j]) for j in path_to(PARENTS, i)]
        diff = (logits[i + 1] - reference_logits(target, prompt + path)).abs().max()
        assert diff < 1e-4, f"node {i} (path {path}): max abs diff {diff:.2e}"


@pytest.mark.parametrize("node", [6, 3, 7, 0])
def test_commit_of_a_non_prefix_path(target, node):
    prompt = [5, 7, 9, 11, 13, 2]
    model = Model(target)
    cache = model.new_cache()
    forward1(model, cache, prompt[:-1])
    cache.keep(list(range(len(prompt) - 1)))
    forward1(model, cache, torch.cat([torch.tensor(prompt[-1:]), TOKENS]), block_parents(PARENTS))
    path = path_to(PARENTS, node)
    cache.keep([0] + [j + 1 for j in path])
    committed = prompt + [int(TOKENS[j]) for j in path]
    assert cache.length == len(committed) and cache.get_seq_length() == len(committed)
    nxt = [40, 41, 42]
    logits = forward1(model, cache, nxt).logits
    for i in range(len(nxt)):
        ref = reference_logits(target, committed + nxt[: i + 1])
        assert (logits[i] - ref).abs().max() < 1e-4


def test_forward_drops_uncommitted_entries_and_returns_hidden(target):
    model = Model(target)
    cache = model.new_cache()
    forward1(model, cache, [3, 4, 5])
    cache.keep([0, 1, 2])
    forward1(model, cache, [6, 7, 8, 9])  # never committed: the next forward must not see it
    out = forward1(model, cache, [10], hidden=True)
    logits, hidden = out.logits, out.hidden
    assert hidden.shape == (1, target.config.hidden_size)
    assert (logits[0] - reference_logits(target, [3, 4, 5, 10])).abs().max() < 1e-4
    cache.trim(2)
    assert cache.length == 2
    assert (forward1(model, cache, [9]).logits[0] - reference_logits(target, [3, 4, 9])).abs().max() < 1e-4


# ---------------------------------------------------------------- (b) speculative greedy == plain greedy


@pytest.mark.parametrize("which", ["random", "near"])
@pytest.mark.parametrize("k", [1, 2, 3, 4])
def test_speculative_greedy_equals_plain_greedy(target, drafts, which, k):
    cfg = SamplingConfig(max_new_tokens=16)
    t_model, d_model = Model(target), Model(drafts[which], vocab_size=VOCAB)
    for prompt in PROMPTS:
        plain = [t.id for t in engine.stream(t_model, None, prompt, cfg)]
        spec = [t.id for t in engine.stream(t_model, ChainDrafter(d_model, k), prompt, cfg)]
        assert spec == plain, f"prompt {prompt}"
        assert plain == reference_greedy(target, prompt, 16)


def test_near_draft_exercises_partial_acceptance(target, drafts):
    stats = engine.Stats()
    list(engine.stream(Model(target), ChainDrafter(Model(drafts["near"]), 3), PROMPTS[0],
                       SamplingConfig(max_new_tokens=40), stats=stats))
    assert {0, 3} <= {s.accepted for s in stats.steps} and len({s.accepted for s in stats.steps}) >= 3


def test_speculor_api_generates_the_greedy_tokens(target, drafts, tokenizer):
    pair = Pair(Model(target), Model(drafts["near"]), tokenizer)
    out = Speculor(pair, strategy="chain", k=3).generate(PROMPTS[0],
                                                         SamplingConfig(max_new_tokens=12, stop_on_eos=False))
    assert out.token_ids == reference_greedy(target, PROMPTS[0], 12)
    assert out.finish_reason == "length" and out.tau >= 1
    plain = Speculor(pair, strategy="plain").generate(PROMPTS[0], SamplingConfig(max_new_tokens=12, stop_on_eos=False))
    assert plain.token_ids == out.token_ids and plain.tau == 1


# ---------------------------------------------------------------- (c) a model drafting for itself


@pytest.mark.parametrize("k", [1, 2, 4])
def test_self_draft_accepts_every_token(target, k):
    stats = engine.Stats()
    n = 15
    model = Model(target)
    drafter = ChainDrafter(model, k)  # the same model, its own cache
    out = list(engine.stream(model, drafter, PROMPTS[0], SamplingConfig(max_new_tokens=n), stats=stats))
    assert [t.id for t in out] == reference_greedy(target, PROMPTS[0], n)
    steps = [s.accepted for s in stats.steps]
    assert steps[:-1] == [k] * (len(steps) - 1), steps  # tau = K + 1 on every full step
    assert len(steps) == -(-n // (k + 1))
    assert stats.tau == pytest.approx(sum(s + 1 for s in steps) / len(steps))


# ---------------------------------------------------------------- (d) bad inputs through the public API


@pytest.fixture(scope="module")
def speculor_pair(target, drafts, tokenizer) -> Pair:
    return Pair(Model(target), Model(drafts["near"]), tokenizer, "tiny-target", "tiny-draft")


@pytest.mark.parametrize("prompt", [[], "", "   \n"])
def test_empty_prompt(speculor_pair, prompt):
    with pytest.raises(SpeculorError, match="empty"):
        Speculor(speculor_pair).generate(prompt, SamplingConfig(max_new_tokens=4))


@pytest.mark.parametrize("prompt", [[3, 10**6], [3, -1], [3, 4.0], [3, "w5"]])
def test_a_prompt_of_other_than_token_ids_is_refused(speculor_pair, prompt):
    with pytest.raises(SpeculorError, match="token ids are ints"):
        Speculor(speculor_pair).generate(prompt, SamplingConfig(max_new_tokens=4))


def test_text_prompt_is_encoded(speculor_pair, target):
    out = Speculor(speculor_pair).generate("w5 w7 w9", SamplingConfig(max_new_tokens=5, stop_on_eos=False))
    assert out.token_ids == reference_greedy(target, [5, 7, 9], 5)


@pytest.mark.parametrize(("prompt_len", "max_new"), [(10, CONTEXT - 9), (CONTEXT, 1), (CONTEXT + 5, 1)])
def test_prompt_plus_max_new_tokens_over_the_context(speculor_pair, prompt_len, max_new):
    with pytest.raises(SpeculorError, match="context length"):
        Speculor(speculor_pair).generate([3] * prompt_len, SamplingConfig(max_new_tokens=max_new))


def test_prompt_filling_the_context_exactly_is_fine(speculor_pair):
    out = Speculor(speculor_pair).generate([3] * (CONTEXT - 4), SamplingConfig(max_new_tokens=4, stop_on_eos=False))
    assert len(out.token_ids) == 4


def test_check_same_vocab():
    check_same_vocab(word_tokenizer(WORDS), word_tokenizer(list(WORDS)))
    with pytest.raises(SpeculorError, match="vocabulary differs"):
        check_same_vocab(word_tokenizer(WORDS), word_tokenizer(WORDS[:-1] + ["other"]))
    with pytest.raises(SpeculorError, match="vocabulary differs"):
        check_same_vocab(word_tokenizer(WORDS), word_tokenizer(WORDS[:50]))


def nan_copy(model):
    bad = copy.deepcopy(model)
    with torch.no_grad():
        bad.lm_head.weight.fill_(float("nan"))
    return bad


@pytest.mark.parametrize("temperature", [0.0, 1.0])
@pytest.mark.parametrize("which", ["target", "draft"])
def test_nan_logits(target, drafts, tokenizer, which, temperature):
    bad, good = Model(nan_copy(target)), Model(drafts["near"])
    pair = Pair(bad, good, tokenizer) if which == "target" else Pair(Model(target), bad, tokenizer)
    cfg = SamplingConfig(temperature=temperature, max_new_tokens=4, seed=0)
    with pytest.raises(SpeculorError, match=f"{which} model produced NaN"):
        Speculor(pair, strategy="chain", k=2).generate([1, 2, 3], cfg)


def test_nan_target_in_plain_decoding(target, tokenizer):
    pair = Pair(Model(nan_copy(target)), None, tokenizer)
    with pytest.raises(SpeculorError, match="NaN"):
        Speculor(pair, strategy="plain").generate([1, 2, 3], SamplingConfig(max_new_tokens=4))


def test_unknown_strategy(speculor_pair):
    with pytest.raises(SpeculorError, match="unknown strategy"):
        Speculor(speculor_pair, strategy="nope")
    sp = Speculor(speculor_pair)
    with pytest.raises(SpeculorError, match="unknown strategy"):
        sp.generate([1, 2], SamplingConfig(max_new_tokens=2), strategy="nope")


@pytest.mark.parametrize("k", [0, -1, 65, 2.5, "3", None])
def test_bad_k(speculor_pair, k):
    with pytest.raises(SpeculorError, match="k must be"):
        Speculor(speculor_pair, strategy="chain", k=k)


def test_bad_option_and_missing_draft(speculor_pair, tokenizer):
    with pytest.raises(SpeculorError, match="takes no option 'depth'"):
        Speculor(speculor_pair, strategy="chain", depth=3)
    with pytest.raises(SpeculorError, match="needs a draft"):
        Speculor(Pair(speculor_pair.target, None, tokenizer), strategy="chain")


def test_drafter_refuses_bad_k(speculor_pair):
    with pytest.raises(ValueError):
        ChainDrafter(speculor_pair.draft, 0)


# ---------------------------------------------------------------- loading from disk


@pytest.fixture(scope="module")
def saved(tmp_path_factory, target, drafts):
    """Folders with tiny models and tokenizers: a good target, a good draft, a draft with another vocabulary."""
    root = tmp_path_factory.mktemp("models")
    out = {}
    for name, model, words in [("target", target, WORDS), ("draft", drafts["near"], WORDS),
                               ("other_vocab", drafts["near"], WORDS[:-1] + ["other"])]:
        model.save_pretrained(root / name)
        word_tokenizer(words).save_pretrained(root / name)
        out[name] = str(root / name)
    return out


def test_load_pair_from_folders(saved, target, capsys):
    pair = load_pair(saved["target"], saved["draft"])  # backend auto: folders, not GGUF files, so torch unmeasured
    said = [line for line in capsys.readouterr().err.splitlines() if line.startswith("speculor:")]  # not loading bars
    assert said == ["speculor: --backend auto chose torch: the llama.cpp backend runs GGUF files (an embedded model or "
                    "a .gguf file), and this pair is not one (nothing measured)"]
    assert pair.backend == "torch" and pair.target.vocab_size == VOCAB and pair.draft is not None
    out = Speculor(pair, strategy="chain", k=2).generate([4, 5, 6], SamplingConfig(max_new_tokens=6, stop_on_eos=False))
    assert out.token_ids == reference_greedy(target, [4, 5, 6], 6)


def test_a_draft_with_another_vocabulary_drafts_through_text(saved, target):
    pair = load_pair(saved["target"], saved["other_vocab"])
    assert pair.draft_tokenizer is not None and pair.draft_tokenizer.get_vocab() != pair.tokenizer.get_vocab()
    out = Speculor(pair, strategy="chain", k=2).generate([4, 5, 6], SamplingConfig(max_new_tokens=6, stop_on_eos=False))
    assert out.token_ids == reference_greedy(target, [4, 5, 6], 6)
    with pytest.raises(SpeculorError, match="needs a draft with the target's tokenizer"):
        Speculor(pair, strategy="dyspec").generate([4, 5, 6], SamplingConfig(max_new_tokens=2))
    with pytest.raises(SpeculorError, match="another tokenizer"):
        load_pair(saved["target"], saved["other_vocab"], draft_vocab=32)


@pytest.mark.parametrize("content", [b"", b"garbage" * 100, b"\x08\x00\x00\x00\x00\x00\x00\x00{}", "truncated"])
def test_corrupt_model_file(saved, tmp_path, content):
    folder = tmp_path / "corrupt"
    folder.mkdir()
    good = Path(saved["target"])
    (folder / "config.json").write_text((good / "config.json").read_text())
    if content == "truncated":
        data = (good / "model.safetensors").read_bytes()
        content = data[: len(data) // 2]
    (folder / "model.safetensors").write_bytes(content)
    with pytest.raises(SpeculorError, match="could not load"):
        load_model(str(folder))
    with pytest.raises(SpeculorError):
        load_pair(str(folder), None)


def test_corrupt_config(tmp_path):
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(SpeculorError):
        load_model(str(tmp_path))


@pytest.mark.parametrize("spec", ["/nonexistent/model/folder", "no-such-model-name", "/tmp/none.gguf"])
def test_missing_model(spec):
    with pytest.raises(SpeculorError, match="no model at"):
        load_model(spec)
