"""Several requests' blocks in ONE forward of a shared model, each request attending to its own cache only.

The rows of all blocks are stacked into one sequence of R rows, so every linear layer (the weight-bound part of a
memory-bound model, what batching saves) runs once over R rows. Attention does not: a `Batch` passed as the
attention mask tells the attention function (registered with transformers' `AttentionInterface` as "speculor")
where each request's rows are, and each request's queries attend to its own `KVCache` with its own tree mask,
through the same `sdpa_attention_forward` call a single request makes. So a request's attention costs what it
costs alone (its own context, not the batch's), and its attention arithmetic is the same as at batch 1.
`BatchWriter` is the cache the model writes through: it splits each layer's new keys and values by request.
A model whose attention is not the registered one (e.g. eager, or a test double) is run one block at a time.
No modeling file is copied or patched: the model keeps its own code and only its attention dispatch is named.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import AttentionInterface, AttentionMaskInterface
from transformers.cache_utils import Cache
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import sdpa_mask

from speculor.runtime.backend import Segment

NAME = "speculor"  # an "sdpa" model is switched to this name: same masks, same attention, plus batches


@dataclass(frozen=True)
class Batch:
    """Where each request's rows are in a stacked forward; a segment's mask is [1, 1, rows, kv]."""

    segments: tuple[Segment, ...]


def batched_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      attention_mask: torch.Tensor | Batch | None, **kwargs) -> tuple[torch.Tensor, None]:
    """sdpa for an ordinary mask; for a `Batch`, sdpa per request over its own cache: output [1, R, heads, dim]."""
    if not isinstance(attention_mask, Batch):
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    outs = []
    for s in attention_mask.segments:
        layer = s.cache.layers[module.layer_idx]
        out, _ = sdpa_attention_forward(module, query[:, :, s.start:s.stop], layer.keys, layer.values, s.mask,
                                        **kwargs)
        outs.append(out)
    return torch.cat(outs, dim=1), None


AttentionInterface.register(NAME, batched_attention)
AttentionMaskInterface.register(NAME, sdpa_mask)  # ordinary calls (e.g. transformers' generate) mask as sdpa does


def enable(model: torch.nn.Module) -> bool:
    """Switch an sdpa model to the batch-capable name (identical arithmetic for ordinary calls); True if it can
    batch. Other attention implementations are left as they are."""
    config = getattr(model, "config", None)
    impl = getattr(config, "_attn_implementation", None)
    if set(getattr(config, "layer_types", None) or ["full_attention"]) != {"full_attention"}:
        return False  # sliding-window layers would need their own per-request masks
    if impl == "sdpa" and hasattr(model, "set_attn_implementation"):
        model.set_attn_implementation(NAME)
        impl = config._attn_implementation
    return impl == NAME


class BatchWriter(Cache):
    """The cache a batched forward writes through: layer l's new rows of each segment go to its request's cache."""

    def __init__(self, batch: Batch) -> None:
        super().__init__(layers=[])
        self.batch = batch

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        for s in self.batch.segments:
            s.cache.update(key_states[:, :, s.start:s.stop], value_states[:, :, s.start:s.stop], layer_idx)
        return key_states, value_states  # unused: `batched_attention` reads each request's own cache

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return 0
