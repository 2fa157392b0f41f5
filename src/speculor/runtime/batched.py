"""Requests' blocks in ONE forward of a shared model, each request attending to its own cache only.

The rows of all blocks are stacked into one sequence of R rows, so every linear layer (the weight-bound part of a
memory-bound model, what batching saves) runs once over R rows. Attention does not: the forward's keyword argument
`speculor_batch` (transformers hands a forward's extra keywords down to the attention function, registered with its
`AttentionInterface` as "speculor") tells where each request's rows are, and each request's queries attend to its
own `KVCache` with its own mask for the layer's window, through the same `sdpa_attention_forward` call a single
request makes. So a request's attention costs what it costs alone, and its arithmetic is the same as at batch 1.
The model's own mask builders are passed `PREPARED`, a 4-D mask they hand on untouched (transformers' "already
prepared mask" case), so no mask over the stacked rows is ever built. `BatchWriter` is the cache the model writes
through: it splits each layer's new keys and values by request. A model whose attention is not sdpa (e.g. eager
with soft-capping) is run one block at a time. No modeling file is copied or patched: only the attention
implementation's name is switched.
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
PREPARED = torch.zeros(1, 1, 1, 1)  # what the model's mask builders get: the real masks are the segments'


@dataclass(frozen=True)
class Batch:
    """Where each request's rows are in a stacked forward; a segment's mask is {window: [1, 1, rows, kv]}, and
    windows[l] is layer l's window (None: full attention)."""

    segments: tuple[Segment, ...]
    windows: tuple[int | None, ...]


def batched_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      attention_mask: torch.Tensor | None, *, speculor_batch: Batch | None = None,
                      **kwargs) -> tuple[torch.Tensor, None]:
    """sdpa for an ordinary call; for a `Batch`, sdpa per request over its own cache: output [1, R, heads, dim]."""
    if speculor_batch is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    window = speculor_batch.windows[module.layer_idx]
    outs = []
    for s in speculor_batch.segments:
        layer = s.cache.layers[module.layer_idx]
        out, _ = sdpa_attention_forward(module, query[:, :, s.start:s.stop], layer.keys, layer.values,
                                        s.mask[window], **kwargs)
        outs.append(out)
    return torch.cat(outs, dim=1), None


AttentionInterface.register(NAME, batched_attention)
AttentionMaskInterface.register(NAME, sdpa_mask)  # ordinary calls (e.g. transformers' generate) mask as sdpa does


def enable(model: torch.nn.Module) -> bool:
    """Switch an sdpa model to the batch-capable name (identical arithmetic for ordinary calls); True if it can
    batch. Other attention implementations are left as they are."""
    config = getattr(model, "config", None)
    impl = getattr(config, "_attn_implementation", None)
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
