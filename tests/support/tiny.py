"""Tiny random transformers models (fp32, CPU, no download) and their references: the model builder, a near draft, a
word-level tokenizer, logits and greedy tokens from plain full forwards, and the fixtures `target`, `draft` and `pair`
of the tree-drafting modules (import them where used: `from support.tiny import draft, pair, target`)."""

from __future__ import annotations

import copy

import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

from speculor import Model, Pair
from speculor.runtime.kernels import can_pack, pack_linears

VOCAB = 64  # the builder's default vocabulary, that of the fixtures below
PROMPTS = [[1, 2, 3, 4, 5], [42], [7, 8, 7, 8, 7, 8, 7], [9, 0, 13, 56, 21, 8, 3, 13, 56]]
WORDS = ["<unk>", "<eos>"] + [f"w{i}" for i in range(2, 100)]  # word_tokenizer(WORDS) for the 100-token models


def tiny_model(seed: int, hidden: int = 32, layers: int = 2, *, vocab: int = VOCAB, context: int = 1024,
               family: str = "qwen2", heads: int = 4, kv_heads: int = 2, pack: bool = False):
    """A random Qwen2 (or Llama) model in fp32, eval mode, its weights drawn after `torch.manual_seed(seed)`;
    `context` is its max_position_embeddings. pack=True packs its linears with the engine's kernels where the
    machine can (oneDNN's multi-row GEMM gives every row the same bits in any batch)."""
    torch.manual_seed(seed)
    config, cls = (Qwen2Config, Qwen2ForCausalLM) if family == "qwen2" else (LlamaConfig, LlamaForCausalLM)
    cfg = config(vocab_size=vocab, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
                 num_key_value_heads=kv_heads, intermediate_size=2 * hidden, max_position_embeddings=context)
    model = cls(cfg).float().eval()
    if pack and can_pack(model):
        pack_linears(model)
    return model


def perturbed(model, noise: float, seed: int):
    """A copy with every weight matrix moved by `noise` times its own spread: a draft that is often right."""
    near = copy.deepcopy(model)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in near.parameters():
            if p.numel() > 1:
                p.add_(noise * p.std() * torch.randn(p.shape, generator=g))
    return near


def word_tokenizer(words: list[str]) -> PreTrainedTokenizerFast:
    """A word-level tokenizer built offline: token i is words[i]."""
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token="<eos>")


def near_pair(*names: str) -> Pair:
    """The 100-token tiny target (context 64), a draft near it (weights moved by 0.1 of their spread) and the word
    tokenizer; `names` are the pair's target and draft names, if any."""
    target = tiny_model(0, vocab=len(WORDS), context=64)
    return Pair(Model(target), Model(perturbed(target, 0.1, seed=2)), word_tokenizer(WORDS), *names)


def reference_logits(model, tokens: list[int]) -> torch.Tensor:
    """Logits of the last position from a plain full forward (no cache, no mask, no speculor), on the model's
    device."""
    device = next(model.parameters()).device
    with torch.no_grad():
        return model(input_ids=torch.tensor([tokens], device=device)).logits[0, -1].float()


def reference_greedy(model, prompt: list[int], n: int) -> list[int]:
    """The model's greedy continuation of n tokens, by plain full forwards."""
    seq = list(prompt)
    for _ in range(n):
        seq.append(int(torch.argmax(reference_logits(model, seq))))
    return seq[len(prompt):]


# ---------------------------------------------------------------- the fixtures of the tree-drafting modules


@pytest.fixture(scope="module")
def target() -> Qwen2ForCausalLM:
    return tiny_model(0, context=128)


@pytest.fixture(scope="module")
def draft(target) -> Qwen2ForCausalLM:
    """A copy of the target with every weight matrix moved by 0.15 of its spread: often right, not always."""
    return perturbed(target, 0.15, seed=2)


@pytest.fixture(scope="module")
def pair(target, draft) -> Pair:
    words = {f"w{i}": i for i in range(VOCAB)}
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel(words, unk_token="w0")))
    return Pair(Model(target), Model(draft), tokenizer, "tiny-target", "tiny-draft")
