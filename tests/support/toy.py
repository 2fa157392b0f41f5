"""A hand-made toy causal LM that plugs into `speculor.runtime.model.Model` like a transformers model, and its exact
law.

The toy is a second-order Markov chain over a small vocabulary V:

    logits(next | ..., x_{t-2}, x_{t-1}) = A[x_{t-1}] + B[x_{t-2}]      (B_start instead when x_{t-2} does not exist)

It keeps its context in the request's KV cache (a `speculor.runtime.cache.KVCache`; token ids stored as float
keys/values of shape [1, 1, S, 1]) and reads the 4-D additive attention mask to find, for every query row, the entries
it attends to (in index order: the cached prefix, then the row's ancestors, then the row itself). A token tree is
therefore scored in each node's true context, and any mask, position or cache bug in the engine changes the toy's
output. The toy also asserts that every row's position id equals its context length - 1, so a flat (non-depth)
position is caught at once.

Also here: the setting of the toy law tests (V, N, PROMPT, T1), toys built from tables (`random_toy`, `first_order`,
the crafted draft `CRAFTED`, a `perturbed` copy), the exact law of the first n tokens, plain greedy decoding, and
`Watched`, a drafter wrapper that shows each proposed tree to a test.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch
from transformers import PretrainedConfig
from transformers.cache_utils import Cache

from speculor.config import SamplingConfig
from speculor.core.sampling import greedy, warp
from speculor.drafters.base import Drafter

V = 6  # the toy vocabulary of the law tests (random_toy's default)
N = 3  # tokens whose joint law is tested (V**N = 216 cells)
PROMPT = [1, 2]
T1 = SamplingConfig(temperature=1.0)


class ToyConfig(PretrainedConfig):
    model_type = "speculor-toy"

    def __init__(self, vocab_size: int = 6, max_position_embeddings: int = 4096, **kwargs) -> None:
        self.vocab_size = vocab_size
        self.max_position_embeddings = max_position_embeddings
        self.num_hidden_layers = 1  # one cache layer
        self.hidden_size = vocab_size  # its hidden state at a position: the one-hot of the position's token
        super().__init__(**kwargs)


@dataclass
class ToyOutput:
    logits: torch.Tensor  # [1, n, V]
    hidden_states: tuple[torch.Tensor, ...] | None = None


class _Head(torch.nn.Module):
    def __init__(self, v: int) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(v, 1))


class ToyLM(torch.nn.Module):
    """logits(next | ctx) = A[ctx[-1]] + (B[ctx[-2]] if len(ctx) >= 2 else B_start)."""

    def __init__(self, a: torch.Tensor, b: torch.Tensor, b_start: torch.Tensor, max_len: int = 4096,
                 nan: bool = False) -> None:
        super().__init__()
        v = a.shape[0]
        assert a.shape == (v, v) and b.shape == (v, v) and b_start.shape == (v,)
        self.config = ToyConfig(vocab_size=v, max_position_embeddings=max_len)
        self.a = torch.nn.Parameter(a.float().clone(), requires_grad=False)
        self.b = torch.nn.Parameter(b.float().clone(), requires_grad=False)
        self.b_start = torch.nn.Parameter(b_start.float().clone(), requires_grad=False)
        self.head = _Head(v)
        self.nan = nan
        self.calls = 0  # forward passes made (lets a test count target calls)

    @property
    def vocab_size(self) -> int:
        return self.a.shape[0]

    def get_output_embeddings(self) -> torch.nn.Module:
        return self.head

    def next_logits(self, ctx: list[int]) -> torch.Tensor:
        """Logits [V] (fp32) of the next token after the context `ctx` (non-empty)."""
        assert ctx, "the toy needs at least one context token"
        second = self.b[ctx[-2]] if len(ctx) >= 2 else self.b_start
        return self.a[ctx[-1]] + second

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor | None = None,
                attention_mask: torch.Tensor | None = None, cache: Cache | None = None,
                use_cache: bool = True, output_hidden_states: bool = False, **kwargs) -> ToyOutput:
        self.calls += 1
        n = input_ids.shape[1]
        new = input_ids[0].float()[None, None, :, None]
        if cache is not None:
            keys, _ = cache.update(new, new.clone(), layer_idx=0)
        else:
            keys = new
        everything = keys[0, 0, :, 0].long().tolist()  # cached prefix + this block
        past = len(everything) - n
        if attention_mask is None:
            allowed = torch.ones(n, past + n, dtype=torch.bool).tril(past)
        else:
            assert attention_mask.shape == (1, 1, n, past + n), f"mask shape {tuple(attention_mask.shape)}"
            allowed = attention_mask[0, 0] == 0
        rows = []
        for i in range(n):
            assert bool(allowed[i, past + i]), "a row must attend to itself"
            assert not bool(allowed[i, past + i + 1:].any()), "a row attends to a later block entry"
            ctx = [tok for tok, ok in zip(everything, allowed[i].tolist(), strict=True) if ok]
            if position_ids is not None:
                assert int(position_ids[0, i]) == len(ctx) - 1, "position id != context length - 1"
            rows.append(self.next_logits(ctx))
        logits = torch.stack(rows)[None]
        if self.nan:
            logits = torch.full_like(logits, float("nan"))
        hidden = None
        if output_hidden_states:
            h = torch.nn.functional.one_hot(input_ids[0], self.vocab_size).float()[None]
            hidden = (h, h)
        return ToyOutput(logits=logits, hidden_states=hidden)


def random_toy(v: int = 6, seed: int = 0, scale: float = 1.5, **kwargs) -> ToyLM:
    """A toy with random tables (normal, times `scale`)."""
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(v, v, generator=g) * scale
    b = torch.randn(v, v, generator=g) * scale * 0.7
    b_start = torch.randn(v, generator=g) * scale * 0.7
    return ToyLM(a, b, b_start, **kwargs)


def first_order(q: list[list[float]]) -> ToyLM:
    """A toy whose next-token law depends on the last token only: q(·|x) = q[x] (B tables zero)."""
    v = len(q)
    a = torch.tensor(q, dtype=torch.float64).log()
    return ToyLM(a, torch.zeros(v, v), torch.zeros(v))


# q(·|last token); no two draw values below tie
CRAFTED = first_order([[0.10, 0.55, 0.35, 0.00],
                       [0.45, 0.15, 0.40, 0.00],
                       [0.20, 0.10, 0.30, 0.40],
                       [0.25, 0.25, 0.25, 0.25]])


def perturbed(model: ToyLM, seed: int, noise: float) -> ToyLM:
    """A draft for `model`: the same tables plus normal noise of scale `noise` (0 gives an identical copy)."""
    g = torch.Generator().manual_seed(seed)
    tables = [model.a, model.b, model.b_start]
    a, b, b_start = (t.detach() + noise * torch.randn(t.shape, generator=g) for t in tables)
    return ToyLM(a, b, b_start, max_len=model.config.max_position_embeddings)


def next_distribution(model: ToyLM, ctx: list[int], cfg: SamplingConfig) -> torch.Tensor:
    """p(.|ctx) after the sampling transform, fp64 [V]; a point mass on the argmax when greedy."""
    logits = model.next_logits(ctx).detach()
    if cfg.greedy:
        return torch.nn.functional.one_hot(torch.tensor(greedy(logits)), model.vocab_size).double()
    p = warp(logits, cfg).double()  # fp32 like the engine, renormalised in fp64
    return p / p.sum()


def exact_law(model: ToyLM, prompt: list[int], cfg: SamplingConfig, n: int) -> torch.Tensor:
    """Exact law of the first n generated tokens, fp64 tensor of shape [V] * n (V**n cells, by enumeration)."""
    v = model.vocab_size
    law = torch.zeros([v] * n, dtype=torch.float64)
    # enumerate every sequence; contexts repeat, so memoise the conditional distributions
    cache: dict[tuple[int, ...], torch.Tensor] = {}

    def cond(seq: tuple[int, ...]) -> torch.Tensor:
        if seq not in cache:
            cache[seq] = next_distribution(model, list(prompt) + list(seq), cfg)
        return cache[seq]

    for cell in itertools.product(range(v), repeat=n):
        prob = 1.0
        for i, tok in enumerate(cell):
            prob *= float(cond(cell[:i])[tok])
            if prob == 0.0:
                break
        law[cell] = prob
    return law


def plain_greedy(model: ToyLM, prompt: list[int], n: int) -> list[int]:
    """Reference greedy decoding straight from the toy's tables (no engine, no cache)."""
    seq = list(prompt)
    for _ in range(n):
        seq.append(greedy(model.next_logits(seq)))
    return seq[len(prompt):]


class Watched(Drafter):
    """A drafter wrapped for a test: proposes through `inner`, then hands each tree to `seen(seq, cfg, tree)` (a
    subclass records or checks it there); everything else is the inner drafter's."""

    def __init__(self, inner) -> None:
        self.inner, self.proposals = inner, 0

    @property
    def forwards(self) -> int:
        return self.inner.forwards

    def reset(self) -> None:
        self.inner.reset()

    def propose(self, seq, cfg, generator):
        tree = yield from self.inner.propose(seq, cfg, generator)
        self.seen(seq, cfg, tree)
        self.proposals += 1
        return tree

    def seen(self, seq, cfg, tree) -> None:
        pass

    def observe(self, n_committed, verdict) -> None:
        self.inner.observe(n_committed, verdict)
