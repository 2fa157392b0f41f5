"""A draft head restricted to the most frequent tokens (FR-Spec, Zhao et al. 2025; docs/algorithms.md §1.1).

The draft's vocabulary projection W [V, H] (151,936 x 896 for Qwen2.5-Coder-0.5B: docs/bench/README.md, "FR-Spec's
head") is replaced by `VocabSubsetLinear`: logits for the ids S only (rows W[S], through the same
kernel kind as the draft's other linears), scattered into a full row filled with -inf. So q = softmax over S and
exactly 0 elsewhere; every drafter, the verifier and the engine see an ordinary [n, V] logits tensor, and the output
stays exact because verification uses the q the token was drawn from (§1.1).

S = the first N ids of the shipped frequency-ranked list (`speculor/data/fr_vocab.npy`, made by
`python -m speculor.methods.fr_vocab`; its record `fr_vocab.json` says how), with the special / end-of-sequence ids
always in. The list belongs to one tokenizer: `restrict_draft` refuses a tokenizer whose vocabulary differs.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable
from functools import cache
from importlib import resources

import numpy as np
import torch

from speculor.errors import SpeculorError

LIST_FILE, RECORD_FILE = "data/fr_vocab.npy", "data/fr_vocab.json"
SPECIAL_TOKENS = ("<|im_end|>", "<|endoftext|>")  # Qwen's end-of-turn and end-of-text, when the vocabulary has them


def special_ids(tokenizer) -> list[int]:
    """The ids a restricted draft must always be able to propose: the tokenizer's eos, pad and bos ids and
    `SPECIAL_TOKENS` where present (in that order, without repeats)."""
    ids = [getattr(tokenizer, f"{w}_token_id", None) for w in ("eos", "pad", "bos")]
    vocab = tokenizer.get_vocab()
    ids += [vocab.get(t) for t in SPECIAL_TOKENS]
    return list(dict.fromkeys(int(i) for i in ids if i is not None))


def vocab_fingerprint(tokenizer) -> str:
    """sha256 (first 16 hex digits) of the tokenizer's id -> token mapping: a list of ids is only meaningful for it."""
    items = sorted((i, t) for t, i in tokenizer.get_vocab().items())
    return hashlib.sha256("\n".join(f"{i}\t{t}" for i, t in items).encode()).hexdigest()[:16]


@cache
def shipped_list() -> tuple[np.ndarray, dict]:
    """(ranked ids int64, record) of the shipped frequency list; a clear error if the package lacks it."""
    root = resources.files("speculor")
    try:
        with root.joinpath(LIST_FILE).open("rb") as f:
            ids = np.load(f).astype(np.int64)
        record = json.loads(root.joinpath(RECORD_FILE).read_text())
    except (FileNotFoundError, OSError, ValueError) as exc:
        raise SpeculorError(f"the frequency-ranked token list ({LIST_FILE}, {RECORD_FILE}) is missing or corrupt in "
                            f"this install: {exc}; rebuild it with `python -m speculor.methods.fr_vocab`") from exc
    return ids, record


def check_size(n: int) -> None:
    """Refuse a subset size that no vocabulary could take (before any model is loaded)."""
    ranked, _ = shipped_list()
    if not 0 < n <= len(ranked):
        raise SpeculorError(f"--draft-vocab {n}: give 1..{len(ranked)} (the frequency list's length), or 0 for the "
                            "full vocabulary")


def choose(ranked: Iterable[int], n: int, vocab_size: int, always: Iterable[int] = ()) -> torch.Tensor:
    """The first n ids of `ranked` with every id of `always` in (each missing one takes the place of the least
    frequent kept id), as a sorted long tensor of n distinct ids in [0, vocab_size)."""
    ranked = [int(i) for i in ranked]
    always = list(dict.fromkeys(int(i) for i in always))
    if not 0 < n <= vocab_size:
        raise SpeculorError(f"--draft-vocab {n}: give 1..{vocab_size} (the vocabulary size), or 0 for all of it")
    if n < len(always):
        raise SpeculorError(f"--draft-vocab {n} is smaller than the {len(always)} special tokens {always} it must hold")
    if n > len(ranked):
        raise SpeculorError(f"--draft-vocab {n}: the frequency list has only {len(ranked)} ids")
    bad = [i for i in ranked[:n] + always if not 0 <= i < vocab_size]
    if bad:
        raise SpeculorError(f"the frequency list has ids outside the vocabulary [0, {vocab_size}): {bad[:5]}")
    kept = list(dict.fromkeys(ranked[:n]))
    if len(kept) < n:
        raise SpeculorError("the frequency list repeats ids; rebuild it")
    if set(always) <= set(kept):
        return torch.tensor(sorted(kept), dtype=torch.long)
    others = [i for i in kept if i not in set(always)]
    return torch.tensor(sorted(others[:n - len(always)] + always), dtype=torch.long)


class VocabSubsetLinear(torch.nn.Module):
    """logits[..., ids] = x W[ids]ᵀ (+ b[ids]), -inf at every other id: a vocabulary head restricted to `ids`.

    `proj` is an nn.Linear over the selected rows, wrapped in `kind` (the full head's kernel class: Int8Linear,
    PackedLinear, or nn.Linear itself), so the restricted head runs as the draft's other linears do. `weight` and
    `full_bias` stay the full head's, so that a restricted head can be restricted anew: where the head is tied to the
    embedding that costs nothing; an untied head (the embedded 0.5B draft's) stays resident beside the subset's
    rows."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, ids: torch.Tensor,
                 kind: type[torch.nn.Module] = torch.nn.Linear) -> None:
        super().__init__()
        self.weight, self.full_bias = weight, bias  # [V, H], [V] or None: the full head's, shared
        self.out_features, self.in_features = weight.shape
        ids = torch.as_tensor(ids, dtype=torch.long, device=weight.device)
        if ids.numel() == 0 or ids.min() < 0 or ids.max() >= self.out_features or len(ids.unique()) != len(ids):
            raise SpeculorError(f"a vocabulary subset must be distinct ids in [0, {self.out_features})")
        self.register_buffer("ids", ids, persistent=False)  # [n]
        proj = torch.nn.Linear(self.in_features, len(ids), bias=bias is not None, device=weight.device,
                               dtype=weight.dtype).requires_grad_(False)
        with torch.no_grad():
            proj.weight.copy_(weight[ids])
            if bias is not None:
                proj.bias.copy_(bias[ids])
        self.proj = proj if kind is torch.nn.Linear else kind(proj)  # pack_linears may wrap it later, as any Linear

    @property
    def kind(self) -> type[torch.nn.Module]:
        return type(self.proj)

    @property
    def kernel(self) -> str:  # shown by kernels.linear_kinds (and so part of the cost profile's key)
        return f"{len(self.ids)} of {self.out_features} ids"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.proj(x)  # [..., n]
        out = y.new_full((*y.shape[:-1], self.out_features), float("-inf"))  # [..., V]
        return out.index_copy_(out.dim() - 1, self.ids, y)


def restrict_head(model: torch.nn.Module, ids: torch.Tensor) -> VocabSubsetLinear:
    """Replace a transformers causal LM's output head (`get_output_embeddings`, e.g. lm_head) by a
    `VocabSubsetLinear` over `ids` with the head's kernel kind; returns it. A restricted head is restricted anew
    from its full weight."""
    head = model.get_output_embeddings()
    if isinstance(head, VocabSubsetLinear):
        weight, bias, kind = head.weight, head.full_bias, head.kind
    elif isinstance(getattr(head, "weight", None), torch.Tensor) and hasattr(head, "out_features"):
        weight, bias, kind = head.weight, getattr(head, "bias", None), type(head)
    else:
        raise SpeculorError(f"cannot restrict the vocabulary of {type(model).__name__}: it has no linear output head")
    new = VocabSubsetLinear(weight, bias, ids, kind)
    model.set_output_embeddings(new)
    return new


def restrict_draft(model: torch.nn.Module, tokenizer, n: int, vocab_size: int,
                   always: Iterable[int] = ()) -> VocabSubsetLinear:
    """Restrict a draft model's head to the first n ids of the shipped frequency list (kept in: the tokenizer's
    special ids, the model's generation_config eos ids and `always`). Refuses a tokenizer other than the list's."""
    ranked, record = shipped_list()
    made_for = record.get("tokenizer", {}).get("fingerprint")
    if made_for and made_for != vocab_fingerprint(tokenizer):
        raise SpeculorError(f"--draft-vocab: the shipped frequency list was made for another tokenizer "
                            f"({record['tokenizer'].get('name', '?')}); this pair's vocabulary differs")
    eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    eos = [eos] if isinstance(eos, int) else list(eos or [])
    ids = choose(ranked, n, min(vocab_size, model.get_output_embeddings().out_features),
                 [*special_ids(tokenizer), *eos, *always])
    return restrict_head(model, ids)
