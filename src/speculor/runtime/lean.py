"""A lean forward of a Qwen2/Llama-style decoder over a request's `KVCache`: the draft model's logits without
transformers' per-call machinery (mask builders, output capturing, cache dispatch, module hooks).

The model's own submodules do the arithmetic (embed_tokens, input_layernorm, self_attn.{q,k,v,o}_proj,
post_attention_layernorm, mlp, norm, rotary_emb, lm_head — whatever kernel each one runs); this module only
wires them, one function per stage:

    x_0 = E[tokens]                                               [n, H]
    per layer l:  h = RMSNorm(x);  q, k, v = h Wqᵀ + bq, h Wkᵀ + bk, h Wvᵀ + bv
                  q, k = rope(q, pos), rope(k, pos);  K, V = cache_l ⊕ (k, v)
                  x = x + Wo · softmax(q Kᵀ / √d + M) V                  (M: the tree mask, 0 or -inf-ish)
                  x = x + MLP(RMSNorm(x))
    logits = lm_head(RMSNorm(x))                                  [n, V] (or the last row's, [1, V])

Several requests' blocks can share one forward (`LeanDecoder.forward`, as the target's stacked forward does): their
rows are stacked for the linear layers, and each block's attention reads its own cache with its own mask.
Grouped-query attention runs on the key/value heads without copying them: the `rep` query heads that share a
key/value head are stacked along the query axis (rows r·n + i), with the mask repeated the same way. It is used for
the draft only (`Model(..., lean=True)`): the draft only proposes, so any forward that computes its logits keeps
decoding exact; the target keeps transformers' own forward. The results equal the stock forward's up to fp32
summation order (tests/test_lean.py).

`fuse_projections` joins each layer's q/k/v, and its gate/up, into one weight before packing: the lean forward then
makes one matmul of each group (h [W_q; W_k; W_v]ᵀ), and transformers' forward still runs through `Part`s.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from functools import partial

import torch
from torch.nn.functional import scaled_dot_product_attention

from speculor.errors import SpeculorError
from speculor.runtime.backend import Segment
from speculor.runtime.cache import KVCache
from speculor.runtime.kernels import Int8Linear, apply, scale_rows
from speculor.runtime.memory import drop_file_pages

FAMILIES = ("qwen2", "llama")  # decoders with exactly this layer structure (no q/k norms, no sliding windows)


def supports(model: torch.nn.Module) -> bool:
    """True when `LeanDecoder` computes this causal LM's forward: a Qwen2/Llama-style decoder, full attention only."""
    config = getattr(model, "config", None)
    layer_types = set(getattr(config, "layer_types", None) or ["full_attention"])
    return (getattr(config, "model_type", None) in FAMILIES and layer_types == {"full_attention"}
            and hasattr(getattr(model, "model", None), "rotary_emb"))


class LeanDecoder:
    """The forward of the module docstring over a transformers causal LM's own submodules (weights not copied)."""

    def __init__(self, model: torch.nn.Module) -> None:
        if not supports(model):
            raise SpeculorError(f"the lean forward runs Qwen2/Llama-style decoders ({', '.join(FAMILIES)}) with "
                                f"full attention only, not {type(model).__name__}")
        cfg = model.config
        self.model = model
        self.embed, self.norm, self.rotary = model.model.embed_tokens, model.model.norm, model.model.rotary_emb
        self.layers = list(model.model.layers)[:cfg.num_hidden_layers]
        attn = self.layers[0].self_attn
        self.heads, self.kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
        self.rep = self.heads // self.kv_heads  # query heads per key/value head
        self.head_dim = attn.head_dim
        self.scale = attn.scaling
        # rows apart (`forward(apart=True)`) matters only for kernels that quantize a call's activations together
        self.per_call = any(isinstance(m, Int8Linear) and m.packed is not None for m in model.modules())
        # q/k/v and gate/up as one matmul each where `fuse_projections` joined them (else None: one call each)
        self.qkv = [joint([a.q_proj, a.k_proj, a.v_proj]) for a in (x.self_attn for x in self.layers)]
        self.gate_up = [joint([x.mlp.gate_proj, x.mlp.up_proj]) for x in self.layers]

    def __call__(self, cache: KVCache, tokens: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor | None,
                 *, last: bool = False, hidden: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(logits [n, V] or [1, V] with last=True, final-norm hidden states [n, H] or None) for tokens [n] at
        positions [n], appended to the cache; mask [n, kv] additive (kv = cache entries after the append), or
        None when every row sees every entry."""
        (logits,), (h,) = self.forward([Segment(cache, 0, len(tokens), mask, last)], tokens, positions, hidden=hidden)
        return logits, h

    def forward(self, blocks: Sequence[Segment], tokens: torch.Tensor, positions: torch.Tensor, *, hidden: bool = False,
                apart: bool = False) -> tuple[list[torch.Tensor], list[torch.Tensor | None]]:
        """Several requests' blocks in one forward: tokens [R] and positions [R] stacked, block b owning rows
        [start, stop) and attending to its own cache. Per block: its logits (all rows, or the last with
        `last`) and, with hidden=True, its final-norm hidden states. The linear layers run once over all R rows;
        apart=True computes each row of them from that row alone (kernels.scale_rows), so a block's results do not
        depend on the blocks beside it."""
        x = self.embed(tokens)  # [R, H]
        cos, sin = self.rotary(x, positions[None])  # [1, R, D] each
        cos, sin = cos[0, :, None], sin[0, :, None]  # [R, 1, D]: broadcast over heads
        masks = [b.mask.repeat(self.rep, 1) if b.mask is not None else None for b in blocks]  # [rep·n, kv]: query
        # row r·n + i is row i of head group r
        mm = partial(reader, apart=apart and self.per_call)
        for i, layer in enumerate(self.layers):
            x = x + self._attend(layer.self_attn, mm(layer.input_layernorm(x)), blocks, masks, i, cos, sin, mm)
            h = mm(layer.post_attention_layernorm(x))
            if self.gate_up[i] is None:  # MLP(h) = W_down (silu(h W_gateᵀ) ⊙ h W_upᵀ)
                gate, up = h(layer.mlp.gate_proj), h(layer.mlp.up_proj)
            else:
                gate, up = h(self.gate_up[i]).chunk(2, dim=-1)
            x = x + mm(layer.mlp.act_fn(gate) * up)(layer.mlp.down_proj)
        picked = [r for b in blocks for r in (range(b.stop - 1, b.stop) if b.last else range(b.start, b.stop))]
        every = len(picked) == len(x)
        out = self.norm(x if hidden or every else x[picked])  # [R or picked, H]
        logits = mm(out if every or not hidden else out[picked])(self.model.lm_head)
        ends = list(itertools.accumulate(1 if b.last else b.stop - b.start for b in blocks))
        return ([logits[a:e] for a, e in zip([0, *ends[:-1]], ends, strict=True)],
                [out[b.start:b.stop] if hidden else None for b in blocks])

    def _attend(self, attn: torch.nn.Module, h: Callable, blocks: Sequence[Segment], masks: list[torch.Tensor | None],
                layer: int, cos: torch.Tensor, sin: torch.Tensor, mm: Callable) -> torch.Tensor:
        """Attention of one layer for the stacked input h (rows of every block): writes each block's keys/values
        into its cache; returns [R, H]."""
        d = self.head_dim
        if self.qkv[layer] is None:
            qk, v = torch.cat([h(attn.q_proj), h(attn.k_proj)], dim=-1), h(attn.v_proj)
        else:
            qk, v = h(self.qkv[layer]).split([(self.heads + self.kv_heads) * d, self.kv_heads * d], dim=-1)
        n_all = len(v)
        qk = rope(qk.reshape(n_all, self.heads + self.kv_heads, d), cos, sin)  # queries and keys in one pass
        q, k, v = qk[:, :self.heads], qk[:, self.heads:], v.reshape(n_all, self.kv_heads, d)  # [R, heads, D]
        outs = []
        for b, mask in zip(blocks, masks, strict=True):
            n = b.stop - b.start
            keys, values = b.cache.update(k[b.start:b.stop].transpose(0, 1)[None],
                                          v[b.start:b.stop].transpose(0, 1)[None], layer)  # [1, kv_heads, kv, D]
            # head h = g·rep + r attends to key/value head g: stack its rep query heads along the query axis
            qb = q[b.start:b.stop].view(n, self.kv_heads, self.rep, d).permute(1, 2, 0, 3)
            o = scaled_dot_product_attention(qb.reshape(1, self.kv_heads, self.rep * n, d), keys, values,
                                             attn_mask=mask, scale=self.scale)  # [1, kv_heads, rep·n, D]
            outs.append(o.view(self.kv_heads, self.rep, n, d).permute(2, 0, 1, 3).reshape(n, self.heads * d))
        return mm(torch.cat(outs) if len(outs) > 1 else outs[0])(attn.o_proj)


def reader(h: torch.Tensor, apart: bool) -> Callable[[torch.nn.Module], torch.Tensor]:
    """linear -> linear(h): the input of one or more linear layers. apart: each row's output computed from that row
    alone, h's rows scaled once for every layer that reads h (kernels.scale_rows)."""
    return partial(apply, rows=scale_rows(h)) if apart else lambda linear: linear(h)


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding of x [n, heads, D]: x·cos + rotate_half(x)·sin, rotate_half(x) = (-x₂, x₁) by halves."""
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


class Part(torch.nn.Module):
    """Output columns [start, stop) of a linear whose other columns belong to other Parts (`fuse_projections`).
    Called alone (transformers' own forward) it computes the whole and keeps its columns; the lean forward calls the
    whole once for all its Parts."""

    def __init__(self, whole: torch.nn.Module, start: int, stop: int) -> None:
        super().__init__()
        self.whole, self.start, self.stop = whole, start, stop
        self.in_features, self.out_features = whole.in_features, stop - start

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.whole(x)[..., self.start:self.stop]


def fuse_projections(model: torch.nn.Module, kind: type[torch.nn.Module] | None = None) -> int:
    """Join each layer's q/k/v projections, and its gate/up projections, into one linear (weights stacked by output
    rows: [W_q; W_k; W_v] x = [W_q x; W_k x; W_v x]) held by `Part`s in their places; returns the count.
    kind (kernels.Int8Linear or PackedLinear): pack each joined matrix at once, so one joined fp32 matrix at most
    exists at a time; None: nn.Linear, which `kernels.pack_linears` packs once later. One weight copy as before;
    3 + 2 matmul calls a layer become 2 (docs/bench/README.md, "Joined projections"). An int8 row keeps its scale
    (per output row), so the results are unchanged. The originals' file pages are given back
    (memory.drop_file_pages). Linears of other kinds are left as they are."""
    count = 0
    for layer in list(model.model.layers)[:model.config.num_hidden_layers]:
        for owner, names in ((layer.self_attn, ("q_proj", "k_proj", "v_proj")), (layer.mlp, ("gate_proj", "up_proj"))):
            linears = [getattr(owner, name) for name in names]
            if any(type(m) is not torch.nn.Linear for m in linears):
                continue
            whole = _stacked(linears)
            whole = kind(whole) if kind is not None else whole
            ends = list(itertools.accumulate(m.out_features for m in linears))
            for name, start, stop in zip(names, [0, *ends[:-1]], ends, strict=True):
                setattr(owner, name, Part(whole, start, stop))
            for m in linears:
                drop_file_pages(m.weight)
            count += 1
    return count


def _stacked(linears: list[torch.nn.Linear]) -> torch.nn.Linear:
    """One nn.Linear computing the linears' outputs side by side (same input); its weight is made once, by cat."""
    w = linears[0].weight
    out = torch.nn.Linear(w.shape[1], sum(m.out_features for m in linears), bias=False, device="meta")
    out.weight = torch.nn.Parameter(torch.cat([m.weight.detach() for m in linears]), requires_grad=False)
    if any(m.bias is not None for m in linears):
        out.bias = torch.nn.Parameter(torch.cat([m.bias.detach() if m.bias is not None else w.new_zeros(m.out_features)
                                                 for m in linears]), requires_grad=False)
    return out


def is_joined(model: torch.nn.Module) -> bool:
    """True when `fuse_projections` joined some of the model's projections (it is no longer the model as given)."""
    return any(isinstance(m, Part) for m in model.modules())


def joint(linears: list[torch.nn.Module]) -> torch.nn.Module | None:
    """The linear whose output is the linears' outputs side by side, when they are its Parts in order; else None."""
    whole = getattr(linears[0], "whole", None)
    if whole is None or not all(isinstance(m, Part) and m.whole is whole for m in linears):
        return None
    ends = [0, *(m.stop for m in linears)]
    return whole if [m.start for m in linears] == ends[:-1] and ends[-1] == whole.out_features else None
