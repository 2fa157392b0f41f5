"""Loading target and draft models, and `LM`: a causal LM with its KV cache, driven by token blocks.

A *block* is a list of new tokens with parents inside the block (-1 = attends only to the cache): a
chain for a prompt, [root] + nodes for a draft tree. `LM.forward` runs one block with the tree mask and
depth-based positions; `LM.commit` keeps the cache entries of the chosen block rows and drops the rest.
The uncommitted entries after the committed ones form the *pending region*; `forward(..., append=True)`
extends it instead of replacing it, so a draft tree can be grown one depth per forward, each new row
attending to its ancestors among the earlier pending entries.
Masks and positions are arguments of the forward call; no modeling file is patched.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError
from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache, PreTrainedTokenizerBase

from speculor import embedded
from speculor.errors import SpeculorError
from speculor.kernels import Int8Linear, PackedLinear, pack_linears
from speculor.tree import attention_mask, position_ids


class LM:
    """A transformers causal LM plus its KV cache, which holds `length` committed entries."""

    def __init__(self, model: torch.nn.Module, vocab_size: int | None = None) -> None:
        self.model = model.eval()
        self.device = next(model.parameters()).device
        self.dtype = next(model.parameters()).dtype
        self.vocab_size = vocab_size or model.get_output_embeddings().weight.shape[0]
        self.context_length = int(getattr(model.config, "max_position_embeddings", 1 << 30))
        self.reset()

    def reset(self) -> None:
        self.cache = DynamicCache(config=self.model.config)
        self.length = 0  # committed entries in the cache; a forward appends uncommitted ones after them
        self.pending = torch.zeros(0, dtype=torch.long)  # parents of the pending entries (region indices)

    @torch.inference_mode()
    def forward(self, tokens: torch.Tensor | list[int], parents: torch.Tensor | None = None,
                hidden: bool = False, *, append: bool = False,
                last: bool = False) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Logits [n, V] (fp32) for a block of n tokens after the committed cache ([1, V], the last row's,
        with last=True: the vocabulary projection, 1/7 of the target's flops, is then made for one row).

        The block's rows become pending entries b..b+n-1 of the pending region, where b = 0 (the region is
        emptied first) unless append=True (b = entries already pending). parents[i] is the region index of
        row i's parent (< b + i), -1 = none: a row attends to the committed cache, its ancestors and itself,
        at position length + depth. append=False with parents=None is a chain; with append=True parents=None
        continues the last pending entry. With hidden=True also returns the last hidden states [n, H].
        """
        if not append:
            self.truncate(self.length)
        tokens = torch.as_tensor(tokens, dtype=torch.long)
        b, n = len(self.pending), len(tokens)
        if parents is None:
            parents = torch.arange(b - 1, b + n - 1)
        region = torch.cat([self.pending, torch.as_tensor(parents, dtype=torch.long)])
        out = self.model(
            input_ids=tokens[None].to(self.device),
            position_ids=position_ids(region, self.length)[:, b:].to(self.device),
            attention_mask=attention_mask(region, self.length, self.dtype)[:, :, b:].to(self.device),
            past_key_values=self.cache,
            use_cache=True,
            output_hidden_states=hidden,
            logits_to_keep=1 if last else 0,
        )
        self.pending = region
        logits = _fit_vocab(out.logits[0].float(), self.vocab_size)
        return (logits, out.hidden_states[-1][0]) if hidden else logits

    def commit(self, rows: list[int]) -> None:
        """Keep the pending entries `rows` (region indices, ascending) after the committed ones; drop the rest."""
        if rows != list(range(len(rows))):
            keep = torch.cat([torch.arange(self.length), self.length + torch.tensor(rows, dtype=torch.long)])
            keep = keep.to(self.device)
            for layer in self.cache.layers:
                layer.keys = layer.keys.index_select(-2, keep)
                layer.values = layer.values.index_select(-2, keep)
        self.length += len(rows)
        self.truncate(self.length)

    def truncate(self, length: int) -> None:
        """Drop every cache entry from index `length` on (pending entries included)."""
        self.length = min(self.length, length)
        self.pending = self.pending[: max(length - self.length, 0)]
        if self.cache.get_seq_length() > length:
            for layer in self.cache.layers:
                layer.keys = layer.keys[..., :length, :]
                layer.values = layer.values[..., :length, :]


def _fit_vocab(logits: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Cut or pad (with -inf, i.e. zero probability) the last dimension to `vocab_size`."""
    v = logits.shape[-1]
    if v >= vocab_size:
        return logits[..., :vocab_size]
    pad = logits.new_full((*logits.shape[:-1], vocab_size - v), float("-inf"))
    return torch.cat([logits, pad], dim=-1)


@dataclass
class Pair:
    """A target, an optional draft model sharing its vocabulary, and their tokenizer."""

    target: LM
    draft: LM | None
    tokenizer: PreTrainedTokenizerBase
    target_name: str = ""
    draft_name: str = ""


def resolve(spec: str) -> tuple[Path, str | None]:
    """A model spec -> (folder, gguf file name or None). 'default-target'/'default-draft', an embedded
    name, a folder of a transformers model, or a .gguf file."""
    if spec in embedded.EMBEDDED:
        return embedded.ensure(spec), None
    path = Path(spec).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return path.parent, path.name
    if path.is_dir() and (path / "config.json").exists():
        return path, None
    raise SpeculorError(
        f"no model at {spec!r}: give a folder with config.json, a .gguf file, 'default', or one of "
        f"{', '.join(embedded.EMBEDDED)}")


def load_model(spec: str, *, device: str = "cpu", dtype: torch.dtype = torch.float32):
    """Load (model, tokenizer) from a spec (see `resolve`); a corrupt file gets a clear error."""
    folder, gguf = resolve(spec)
    try:
        model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=gguf, dtype=dtype).to(device)
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=gguf)
    except (OSError, ValueError, RuntimeError, KeyError, SafetensorError) as exc:
        raise SpeculorError(f"could not load the model at {spec!r} (corrupt or unsupported file?): {exc}") from exc
    if len(tokenizer) < 2:  # transformers quietly builds an empty tokenizer when the files are missing
        raise SpeculorError(f"the model at {spec!r} has no usable tokenizer (tokenizer files missing?)")
    return model, tokenizer


def check_same_vocab(target_tok: PreTrainedTokenizerBase, draft_tok: PreTrainedTokenizerBase) -> None:
    """Refuse a draft whose token ↔ id mapping differs from the target's."""
    vt, vd = target_tok.get_vocab(), draft_tok.get_vocab()
    if vt != vd:
        diff = len(set(vt.items()) ^ set(vd.items()))
        raise SpeculorError(
            f"the draft's vocabulary differs from the target's ({len(vd)} vs {len(vt)} tokens, {diff} entries "
            "differ); speculative decoding needs a draft with the target's tokenizer")


def load_pair(target: str = "default", draft: str | None = "default", *, device: str = "cpu",
              dtype: torch.dtype = torch.float32, packed: bool = True, draft_int8: bool = True) -> Pair:
    """Load a target and (unless draft is None) a draft; 'default' means the embedded Qwen2.5-Coder pair.

    packed: on a CPU in fp32, run the target's multi-row matmuls through prepacked oneDNN weights;
    draft_int8: run the draft with int8 weights (kernels.py). Neither changes what is generated: the
    target's arithmetic stays fp32, and the draft only proposes.
    """
    target = embedded.DEFAULT_TARGET if target == "default" else target
    draft = embedded.DEFAULT_DRAFT if draft == "default" else draft
    t_model, tokenizer = load_model(target, device=device, dtype=dtype)
    if packed:
        pack_linears(t_model)
    t_lm = LM(t_model)
    d_lm = None
    if draft is not None:
        d_model, d_tok = load_model(draft, device=device, dtype=dtype)
        check_same_vocab(tokenizer, d_tok)
        if packed or draft_int8:
            pack_linears(d_model, Int8Linear if draft_int8 else PackedLinear)
        d_lm = LM(d_model, vocab_size=t_lm.vocab_size)
    return Pair(t_lm, d_lm, tokenizer, target, draft or "")
