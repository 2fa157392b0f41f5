"""The third stage: a prepared plan's models built on its backend and packed into a `Pair`.

Contract: `load(prepared)` reads only the files runtime/prepare.py made ready and chooses nothing, save what only the
tokenizers tell: a draft with another tokenizer than the target's is kept with its own (cross-tokenizer drafting,
drafters/cross_vocab.py; torch only). torch: the target (offloaded, or its matmuls prepacked), the draft (its head
restricted by --draft-vocab, its projections joined for lean.py's forward, int8 or prepacked kernels) on
runtime/model.py's `Model`; llama.cpp: runtime/llama.py's `LlamaModel` for each, the tokenizer transformers'. The
plan's threads are set for torch here. `load_model` and `load_tokenizer` read one model spec outside a pair.
"""

from __future__ import annotations

import torch
from safetensors import SafetensorError
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerBase

from speculor.errors import SpeculorError
from speculor.runtime.backend import Pair
from speculor.runtime.draft_vocab import restrict_draft
from speculor.runtime.kernels import Int8Linear, PackedLinear, can_pack, pack_linears
from speculor.runtime.lean import fuse_projections, supports
from speculor.runtime.model import Model
from speculor.runtime.prepare import Files, Prepared, model_files

READ_ERRORS = (OSError, ValueError, RuntimeError, KeyError, SafetensorError)


def load(prepared: Prepared) -> Pair:
    """The pair of a prepared plan, on its backend."""
    if prepared.plan.threads is not None:
        torch.set_num_threads(prepared.plan.threads)
    pair = (_llama_pair if prepared.plan.backend == "llama.cpp" else _torch_pair)(prepared)
    if prepared.plan.context is not None:  # torch: the models' own limit capped (llama.cpp's context is made so)
        for model in (pair.target, pair.draft):
            if model is not None:
                model.context_length = min(model.context_length, prepared.plan.context)
    return pair


def read_model(files: Files, name: str, *, device: str, dtype: torch.dtype) -> torch.nn.Module:
    """A transformers model from its files (`name`: its spec, for the error); a corrupt file gets a clear error."""
    try:
        return AutoModelForCausalLM.from_pretrained(files.folder, gguf_file=files.gguf, dtype=dtype).to(device)
    except READ_ERRORS as exc:
        raise SpeculorError(f"could not load the model at {name!r} (corrupt or unsupported file?): {exc}") from exc


def read_tokenizer(files: Files, name: str) -> PreTrainedTokenizerBase:
    """A tokenizer from its files; a corrupt or missing one gets a clear error."""
    try:
        tokenizer = AutoTokenizer.from_pretrained(files.folder, gguf_file=files.gguf)
    except READ_ERRORS as exc:
        raise SpeculorError(f"could not load the model at {name!r} (corrupt or unsupported file?): {exc}") from exc
    if len(tokenizer) < 2:  # transformers quietly builds an empty tokenizer when the files are missing
        raise SpeculorError(f"the model at {name!r} has no usable tokenizer (tokenizer files missing?)")
    return tokenizer


def load_model(spec: str, *, device: str = "cpu", dtype: torch.dtype = torch.float32):
    """(model, tokenizer) of one model spec on transformers (prepare.py's `model_files`, then read)."""
    files = model_files(spec)
    return read_model(files, spec, device=device, dtype=dtype), read_tokenizer(files, spec)


def load_tokenizer(spec: str) -> PreTrainedTokenizerBase:
    """The tokenizer of one model spec (prepare.py's `model_files`, then read)."""
    return read_tokenizer(model_files(spec), spec)


def offload_to(model: torch.nn.Module, device: str) -> None:
    """Weights in pinned CPU memory, copied to `device` module by module as each one runs and dropped after
    (accelerate's hooks; the parameters themselves become meta tensors). One forward then moves every weight
    once, whatever its number of rows: the regime where Sequoia's large trees pay most."""
    from accelerate import cpu_offload

    pin = torch.device(device).type == "cuda"
    pinned: dict[int, torch.Tensor] = {}  # one copy of a tied weight (embedding = head)
    weights = {}
    for name, t in model.state_dict().items():
        if t.data_ptr() not in pinned:
            pinned[t.data_ptr()] = t.pin_memory() if pin else t
        weights[name] = pinned[t.data_ptr()]
    cpu_offload(model, execution_device=torch.device(device), state_dict=weights)


def same_vocab(target_tok: PreTrainedTokenizerBase, draft_tok: PreTrainedTokenizerBase) -> bool:
    return target_tok.get_vocab() == draft_tok.get_vocab()


def check_same_vocab(target_tok: PreTrainedTokenizerBase, draft_tok: PreTrainedTokenizerBase) -> None:
    """Refuse a draft whose token ↔ id mapping differs from the target's."""
    vt, vd = target_tok.get_vocab(), draft_tok.get_vocab()
    if vt != vd:
        diff = len(set(vt.items()) ^ set(vd.items()))
        raise SpeculorError(
            f"the draft's vocabulary differs from the target's ({len(vd)} vs {len(vt)} tokens, {diff} entries "
            "differ); speculative decoding needs a draft with the target's tokenizer")


def _torch_pair(prepared: Prepared) -> Pair:
    plan = prepared.plan
    target = plan.target.name
    t_model = read_model(prepared.target, target, device="cpu" if plan.offload else plan.device, dtype=plan.dtype)
    tokenizer = read_tokenizer(prepared.tokenizer, target)
    if plan.offload:
        offload_to(t_model, plan.device)
    elif plan.packed:
        pack_linears(t_model, PackedLinear)
    t_lm = Model(t_model, device=plan.device)
    d_lm, d_tok = None, None
    if prepared.draft is not None:
        d_lm, d_tok = _torch_draft(prepared, tokenizer, t_lm.vocab_size)
    return Pair(t_lm, d_lm, tokenizer, target, plan.draft.name if plan.draft else "", backend="torch",
                draft_tokenizer=d_tok)


def _torch_draft(prepared: Prepared, tokenizer: PreTrainedTokenizerBase,
                 vocab_size: int) -> tuple[Model, PreTrainedTokenizerBase | None]:
    """The draft on torch, and its tokenizer where it is not the target's (None where it is)."""
    plan, files = prepared.plan, prepared.draft
    assert plan.draft is not None and files is not None
    d_model = read_model(files, plan.draft.name, device=plan.device, dtype=plan.dtype)
    d_tok = read_tokenizer(files, plan.draft.name)
    cross = not same_vocab(tokenizer, d_tok)  # another tokenizer: drafted through text (cross_vocab.py)
    if cross and plan.draft_vocab:
        raise SpeculorError("--draft-vocab restricts a draft that shares the target's vocabulary; this draft has "
                            "another tokenizer")
    if plan.draft_vocab:  # before packing, so that the subset's rows get the draft's kernel kind
        restrict_draft(d_model, tokenizer, plan.draft_vocab, vocab_size)
    kind = Int8Linear if plan.draft_int8 else PackedLinear
    lean = plan.lean_draft and plan.draft_int8 and supports(d_model)
    if lean:  # before packing too, each joined matrix packed as it is made
        fuse_projections(d_model, kind if can_pack(d_model) else None)
    if plan.packed or plan.draft_int8:
        pack_linears(d_model, kind)
    return Model(d_model, vocab_size=None if cross else vocab_size, lean=lean), d_tok if cross else None


def _llama_pair(prepared: Prepared) -> Pair:
    """The pair on llama.cpp; the tokenizer is transformers' (prepare.py says from which files)."""
    from speculor.runtime.llama import LlamaModel

    plan, threads = prepared.plan, torch.get_num_threads()
    try:
        tokenizer = AutoTokenizer.from_pretrained(prepared.tokenizer.folder, gguf_file=prepared.tokenizer.gguf)
    except (OSError, ValueError, RuntimeError, KeyError) as exc:
        raise SpeculorError(f"could not read the tokenizer of {plan.target.name!r} (corrupt or unsupported file?): "
                            f"{exc}") from exc
    n_ctx = {} if plan.context is None else {"n_ctx": plan.context}  # the KV memory's cells, each request's limit
    t_lm = LlamaModel(prepared.target.path, threads=threads, calls=plan.calls, **n_ctx)
    d_lm = None
    if prepared.draft is not None:
        d_lm = LlamaModel(prepared.draft.path, threads=threads, vocab_size=t_lm.vocab_size, calls=plan.calls, **n_ctx)
        if d_lm.vocabulary() != t_lm.vocabulary():
            raise SpeculorError(f"the draft's vocabulary differs from the target's ({d_lm.n_vocab} vs {t_lm.n_vocab} "
                                "tokens); on llama.cpp the draft needs the target's tokenizer (a draft with another "
                                "one runs with --backend torch, drafting through text)")
    return Pair(t_lm, d_lm, tokenizer, plan.target.name, plan.draft.name if plan.draft else "", backend="llama.cpp")
