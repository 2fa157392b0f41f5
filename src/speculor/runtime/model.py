"""`Model`: the transformers backend (runtime/backend.py): a causal LM shared by every request, run over blocks of
rows against requests' `KVCache`s.

`forward(blocks)` is its one entry. Each block's rows get the tree mask (ancestors only) and depth-based positions;
the cache's `keep` commits the chosen rows and drops the rest. The uncommitted entries after the committed ones
form the *pending region*; a block with `append=True` extends it instead of replacing it, so a draft tree can be
grown one depth per forward, each new row attending to its ancestors among the earlier pending entries. How the
blocks run is this backend's own choice: a lean model (the draft, runtime/lean.py) runs them all in one lean
forward; a model whose attention can batch (runtime/batched.py) runs several requests' plain blocks in one forward,
linear layers over the stacked rows, attention per request; any other runs them one at a time. The model holds
weights only: every request brings its own cache. Masks and positions are arguments of the forward call; no
modeling file is patched.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from speculor.core.tree import attention_mask, position_ids
from speculor.runtime import batched
from speculor.runtime.backend import Block, Rows, Segment, Traits, fit_vocab
from speculor.runtime.cache import KVCache
from speculor.runtime.kernels import linear_kinds
from speculor.runtime.layers import layer_windows
from speculor.runtime.lean import LeanDecoder

PREFILL_ROWS = 512  # the most rows of a chain (a prompt) in one forward: its masks stay PREFILL_ROWS x context


class Model:
    """A transformers causal LM shared by every request: the `Backend` of runtime/backend.py."""

    def __init__(self, model: torch.nn.Module, vocab_size: int | None = None, *,
                 lean: bool = False, device: str | torch.device | None = None) -> None:
        """lean=True: run through lean.py's forward (the same logits up to summation order, less overhead; for a
        draft; one matmul per group of projections `lean.fuse_projections` joined). device: where the forward runs,
        by default where the weights are (offloaded weights are meta tensors: their forward runs on the GPU given)."""
        self.model = model.eval()
        self.device = torch.device(device) if device is not None else next(model.parameters()).device
        self.dtype = next(model.parameters()).dtype
        self.weights = str(self.dtype).removeprefix("torch.")
        head = model.get_output_embeddings()  # an nn.Linear, or a packed one without its fp32 weight (kernels.py)
        self.vocab_size = vocab_size or getattr(head, "out_features", None) or head.weight.shape[0]
        self.context_length = int(getattr(model.config, "max_position_embeddings", 1 << 30))
        ids = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
        self.eos_ids = frozenset([ids] if isinstance(ids, int) else ids or [])  # the model's own end tokens
        self.windows = layer_windows(model.config)  # per layer: None (full attention) or its sliding window
        self.batched = batched.enable(model)  # blocks run through `_stacked` (several requests in one forward)
        self.lean = LeanDecoder(model) if lean else None
        self.traits = Traits()  # own caches, cheap rows, one chunk a step, the first step scores the root
        self.kernel_s = self.call_times = None  # not counted, not timed

    @property
    def hidden_size(self) -> int:
        return self.model.config.hidden_size

    @property
    def shared(self) -> Model:
        return self

    def embedding(self) -> Callable[[torch.Tensor], torch.Tensor]:
        return token_embedding(self.model)

    @staticmethod
    def new_cache() -> KVCache:
        return KVCache()

    @property
    def cost_key(self) -> str:
        """The kernels its cost curve depends on (runtime/cost.py adds the machine, device, dtype and names)."""
        key = linear_kinds(self.model)
        if self.lean is not None:
            key += " / lean draft" + (" (joined)" if any(self.lean.qkv) else "")
        return key

    @torch.inference_mode()
    def forward(self, blocks: Sequence[Block], *, apart: bool = False) -> list[Rows]:
        """Per block its `Rows`: logits [n, V] (fp32, on the host; [1, V], the last row's, with `last`: the
        vocabulary projection, 1/7 of the target's flops, is then made for one row), hidden [n, H] with `hidden`.
        apart=True: each row of the linear layers is computed from that row alone (kernels.py), so a block's result
        does not depend on the blocks beside it (quantized kernels that scale a call's activations together).
        A chain longer than PREFILL_ROWS (a long prompt) runs on its own, PREFILL_ROWS rows a forward, so no mask
        is larger than PREFILL_ROWS x context."""
        long = [i for i, b in enumerate(blocks) if b.parents is None and len(b.tokens) > PREFILL_ROWS]
        if long:
            rest = iter(self.forward([b for i, b in enumerate(blocks) if i not in long], apart=apart))
            return [self._chunked(b, apart) if i in long else next(rest) for i, b in enumerate(blocks)]
        if not blocks:
            return []
        if self.lean is not None:
            return self._lean(blocks, apart)
        if self.batched:
            return self._stacked(blocks)
        return [self._one(b) for b in blocks]

    def _chunked(self, b: Block, apart: bool) -> Rows:
        """A long chain as consecutive appended chunks of PREFILL_ROWS rows: the same rows, the same masks' rows."""
        tokens = torch.as_tensor(b.tokens, dtype=torch.long)
        parts = []
        for i in range(0, len(tokens), PREFILL_ROWS):
            chunk = Block(b.cache, tokens[i:i + PREFILL_ROWS], None, b.hidden, b.append or i > 0, b.last)
            parts.append(self.forward([chunk], apart=apart)[0])
        logits = parts[-1].logits if b.last else torch.cat([p.logits for p in parts])
        return Rows(logits, torch.cat([p.hidden for p in parts]) if b.hidden else None)

    def _masks(self, region: torch.Tensor, past: int, start: int) -> dict[int | None, torch.Tensor]:
        """The additive masks of rows start.. of a region, one per distinct layer window."""
        return {w: attention_mask(region, past, self.dtype, start=start, window=w).to(self.device)
                for w in set(self.windows)}

    def _one(self, b: Block) -> Rows:
        """One block through transformers' own forward and attention (a model that cannot batch, e.g. eager
        attention with soft-capping): one 4-D mask, or one per layer type where the layers' windows differ."""
        tokens, region, start = _open(b)
        masks = self._masks(region, b.cache.length, start)
        if len(masks) == 1:
            mask = next(iter(masks.values()))
        else:  # models that mix windows take a mask per layer type
            mask = {t: masks[w] for t, w in zip(self.model.config.layer_types, self.windows, strict=True)}
        out = self.model(
            input_ids=tokens[None].to(self.device),
            position_ids=position_ids(region, b.cache.length)[:, start:].to(self.device),
            attention_mask=mask,
            cache=b.cache,
            use_cache=True,
            output_hidden_states=b.hidden,
            logits_to_keep=1 if b.last else 0,
        )
        _pend(b.cache, region)
        logits = fit_vocab(out.logits[0].float(), self.vocab_size)
        return Rows(logits, out.hidden_states[-1][0] if b.hidden else None)

    def _lean(self, blocks: Sequence[Block], apart: bool) -> list[Rows]:
        """Every block in ONE lean forward over the stacked rows (attention per request)."""
        segments, ids, positions, regions = self._stack(blocks, lean=True)
        logits, hidden = self.lean.forward(segments, ids, positions, hidden=any(b.hidden for b in blocks), apart=apart)
        out = []
        for b, region, lg, h in zip(blocks, regions, logits, hidden, strict=True):
            _pend(b.cache, region)
            out.append(Rows(fit_vocab(lg.float(), self.vocab_size), h if b.hidden else None))
        return out

    def _stacked(self, blocks: Sequence[Block]) -> list[Rows]:
        """The blocks (one or several requests') in ONE forward of transformers' model: linear layers over the
        stacked rows, attention per request with its own masks (runtime/batched.py)."""
        segments, ids, positions, regions = self._stack(blocks, lean=False)
        batch = batched.Batch(tuple(segments), self.windows)
        rows = [torch.arange(s.stop - 1 if s.last else s.start, s.stop) for s in segments]
        keep = torch.cat(rows).to(self.device) if any(s.last for s in segments) else 0  # the rows whose logits are made
        out = self.model(input_ids=ids[None], position_ids=positions, attention_mask=batched.PREPARED,
                         cache=batched.BatchWriter(batch), use_cache=True, speculor_batch=batch,
                         output_hidden_states=any(b.hidden for b in blocks), logits_to_keep=keep)
        logits = fit_vocab(out.logits[0].float(), self.vocab_size)
        result, at = [], 0
        for b, s, r, region in zip(blocks, segments, rows, regions, strict=True):
            _pend(s.cache, region)
            lg = logits[at:at + len(r)]  # logits hold the kept rows in order (all rows when none is `last`)
            at += len(r)
            result.append(Rows(lg, out.hidden_states[-1][0, s.start:s.stop] if b.hidden else None))
        return result

    def _stack(self, blocks: Sequence[Block],
               lean: bool) -> tuple[list[Segment], torch.Tensor, torch.Tensor, list[torch.Tensor]]:
        """The blocks' rows stacked: their segments, token ids [R] and positions (on the device), and each cache's
        new pending region. A lean forward takes masks [n, kv] (None where every row sees every entry) and positions
        [R]; transformers' model one mask [1, 1, n, kv] per layer window ({window: mask}) and positions [1, R]."""
        segments, ids, positions, regions, start = [], [], [], [], 0
        for b in blocks:
            tokens, region, first = _open(b)
            pos = position_ids(region, b.cache.length)[:, first:]
            if lean:
                mask = attention_mask(region, b.cache.length, self.dtype, start=first)[0, 0]
                mask, pos = (mask.to(self.device) if mask.any() else None), pos[0]
            else:
                mask = self._masks(region, b.cache.length, first)
            segments.append(Segment(b.cache, start, start + len(tokens), mask, b.last))
            ids.append(tokens)
            positions.append(pos)
            regions.append(region)
            start += len(tokens)
        return segments, torch.cat(ids).to(self.device), torch.cat(positions, dim=-1).to(self.device), regions


def _open(b: Block) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(tokens, region, start) of a block about to be forwarded: region = the parents of the whole pending region
    with the block's rows at start.. (0 unless append; parents None: a chain continuing the last pending entry)."""
    if not b.append:
        b.cache.trim(b.cache.length)
    tokens = torch.as_tensor(b.tokens, dtype=torch.long)
    start, n = len(b.cache.parents), len(tokens)
    parents = torch.arange(start - 1, start + n - 1) if b.parents is None else b.parents
    return tokens, torch.cat([b.cache.pending, torch.as_tensor(parents, dtype=torch.long)]), start


def _pend(cache: KVCache, region: torch.Tensor) -> None:
    """A forwarded block's rows, now in the cache, become its pending rows (`region`: the parents of them all)."""
    cache.add(region[len(cache.parents):].tolist())


def token_embedding(model: torch.nn.Module) -> Callable[[torch.Tensor], torch.Tensor]:
    """e(ids) -> [n, H] fp32 from a transformers model's input embedding."""
    weight = model.get_input_embeddings().weight

    def embed(ids: torch.Tensor) -> torch.Tensor:
        return weight[ids.to(weight.device)].float()

    return embed
