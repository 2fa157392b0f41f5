"""Loading a target and a draft model (`load_pair` of a `PairSpec`): a folder, a .gguf file or an embedded model; a
draft with another tokenizer than the target's is kept with its tokenizer (cross-tokenizer drafting,
drafters/cross_vocab.py); the fast CPU kernels are swapped in here. Backend "auto" is chosen before loading, above
this module (runtime/choice.py, whose `load_pair` is `speculor.load_pair`)."""

from __future__ import annotations

from dataclasses import KW_ONLY, dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerBase

from speculor.errors import SpeculorError
from speculor.runtime import embedded
from speculor.runtime.backend import Pair
from speculor.runtime.draft_vocab import check_size as draft_vocab_check
from speculor.runtime.draft_vocab import restrict_draft
from speculor.runtime.kernels import Int8Linear, PackedLinear, can_pack, pack_linears
from speculor.runtime.lean import fuse_projections, supports
from speculor.runtime.model import Model


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
    except (OSError, ValueError, RuntimeError, KeyError, SafetensorError) as exc:
        raise SpeculorError(f"could not load the model at {spec!r} (corrupt or unsupported file?): {exc}") from exc
    return model, load_tokenizer(spec)


def load_tokenizer(spec: str) -> PreTrainedTokenizerBase:
    """The tokenizer of a model spec (see `resolve`); a corrupt or missing one gets a clear error."""
    folder, gguf = resolve(spec)
    try:
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=gguf)
    except (OSError, ValueError, RuntimeError, KeyError, SafetensorError) as exc:
        raise SpeculorError(f"could not load the model at {spec!r} (corrupt or unsupported file?): {exc}") from exc
    if len(tokenizer) < 2:  # transformers quietly builds an empty tokenizer when the files are missing
        raise SpeculorError(f"the model at {spec!r} has no usable tokenizer (tokenizer files missing?)")
    return tokenizer


def check_device(device: str, offload: bool = False) -> None:
    """Refuse a device torch cannot use here, and offloading with nowhere to stream to."""
    try:
        dev = torch.device(device)
    except RuntimeError as exc:
        raise SpeculorError(f"unknown device {device!r}: give cpu, cuda or cuda:N") from exc
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise SpeculorError(f"device {device!r}: this torch build or machine has no CUDA GPU; use --device cpu")
    if dev.type == "cuda" and (dev.index or 0) >= torch.cuda.device_count():
        raise SpeculorError(f"device {device!r}: this machine has {torch.cuda.device_count()} CUDA GPU(s)")
    if offload and dev.type == "cpu":
        raise SpeculorError("--offload streams the target's weights from CPU memory to a GPU: give --device cuda")


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


BACKENDS = ("auto", "torch", "llama.cpp")


def torch_dtype(name: str, device: str) -> torch.dtype:
    """A dtype by name; "auto": bfloat16 on cuda, float32 on cpu (the command line's and Ray's `dtype`)."""
    if name == "auto":
        name = "bfloat16" if device.startswith("cuda") else "float32"
    return getattr(torch, name)


@dataclass(frozen=True)
class PairSpec:
    """A model pair and how it runs: what `load_pair` loads. target, draft: 'default' (the embedded Qwen2.5-Coder
    pair), an embedded model's name, a folder or a .gguf file; draft None: no draft.

    backend: 'auto', the default (runtime/choice.py: the one this machine's measured cost curves predict fastest,
    said on stderr; torch without measuring where llama.cpp cannot run the pair), 'torch' (transformers, the fp32
    reference and the GPU path) or 'llama.cpp' (GGUF files on llama.cpp's own quantized kernels, runtime/llama/).
    threads: the CPU threads of either (default: torch's).
    calls (llama.cpp): 'exact', the default (rows in calls that give each the bits of a one-row call: speculative
    output is plain decoding's and no answer depends on what shares its batch), 'padded' (the same guarantees in
    the other class of bits, the 4-row kernels': every call padded to 4k rows, so a lone step costs a 4-row call and
    a loaded server's steps llama.cpp's own sizes), or 'batched' (llama.cpp's own call sizes: more throughput under
    load, neither guarantee; runtime/llama/).

    packed: on a CPU in fp32, run the target's matmuls through oneDNN weights prepacked once; draft_int8: run the
    draft with int8 weights (kernels.py). Either releases the fp32 weights it replaces (each weight is held once;
    transformers' own generate then needs the models loaded again, bench/peers.py). Neither changes what is
    generated: the target's arithmetic stays fp32, and the draft only proposes.
    draft_vocab: N > 0 restricts the draft's head to the N most frequent tokens (FR-Spec, draft_vocab.py; exact
    as any draft is, docs/algorithms.md §1.1); None or 0: the full vocabulary.
    lean_draft: with int8 draft kernels, run the draft through lean.py's forward (Qwen2/Llama-style drafts; the same
    logits, less time a forward), its q/k/v and gate/up projections joined (`fuse_projections`; docs/bench/README.md
    "Joined projections").
    offload: keep the target's weights in pinned CPU memory and stream them to `device` for each forward (`offload`).
    """

    target: str = "default"
    draft: str | None = "default"
    _: KW_ONLY
    device: str = "cpu"
    dtype: torch.dtype = torch.float32
    packed: bool = True
    draft_int8: bool = True
    draft_vocab: int | None = None
    lean_draft: bool = True
    offload: bool = False
    backend: str = "auto"
    threads: int | None = None
    calls: str = "exact"

    def __post_init__(self) -> None:
        if self.backend not in BACKENDS:
            raise SpeculorError(f"unknown backend {self.backend!r}: give one of {', '.join(BACKENDS)}")
        if self.threads is not None and self.threads < 1:
            raise SpeculorError(f"--threads must be at least 1, got {self.threads}")

    @classmethod
    def of(cls, spec: PairSpec | str = "default", *args: Any, **options: Any) -> PairSpec:
        """`load_pair`'s arguments as a PairSpec: one PairSpec, or the fields of one (target, draft, options)."""
        if not isinstance(spec, PairSpec):
            return cls(spec, *args, **options)
        if args or options:
            raise SpeculorError("load_pair takes a PairSpec or the fields of one, not both")
        return spec

    @classmethod
    def named(cls, target: str = "default", draft: str = "default", *, dtype: str = "auto", kernels: str = "fast",
              device: str = "cpu", **options: Any) -> PairSpec:
        """The pair as the command line and Ray's settings name it: draft 'none' for no draft, dtype by name
        (`torch_dtype`), kernels 'fast' (a prepacked target, an int8 lean draft) or 'eager' (plain nn.Linear)."""
        fast = kernels == "fast"
        return cls(target, None if draft == "none" else draft, device=device, dtype=torch_dtype(dtype, device),
                   packed=fast, draft_int8=fast, **options)


def load_pair(spec: PairSpec | str = "default", *args: Any, **options: Any) -> Pair:
    """Load a pair whose backend is chosen ('torch' or 'llama.cpp'; `speculor.load_pair` chooses 'auto' first):
    `load_pair(PairSpec(...))`, or the fields of one (`load_pair("default", None, backend="torch")`)."""
    spec = PairSpec.of(spec, *args, **options)
    if spec.backend == "auto":
        raise SpeculorError("backend 'auto' is chosen before loading: call speculor.load_pair (runtime/choice.py)")
    if spec.threads is not None:
        torch.set_num_threads(spec.threads)
    target, draft, device, offload, draft_vocab = spec.target, spec.draft, spec.device, spec.offload, spec.draft_vocab
    if spec.backend == "llama.cpp":
        if offload or torch.device(device).type != "cpu":
            raise SpeculorError("the llama.cpp backend runs on the CPU here: leave out --device/--offload, or use "
                                "--backend torch")
        if draft_vocab:
            raise SpeculorError("--draft-vocab restricts a torch draft's head: use --backend torch")
        return load_llama_pair(target, draft, threads=torch.get_num_threads(), calls=spec.calls)
    if spec.calls != "exact":
        raise SpeculorError(f"--calls {spec.calls} is a llama.cpp setting (torch's rows keep their bits in any "
                            "batch): leave it out, or use --backend llama.cpp")
    check_device(device, offload)
    if draft_vocab:
        if draft is None:
            raise SpeculorError("--draft-vocab restricts the draft model's vocabulary: it needs a draft")
        draft_vocab_check(draft_vocab)  # before the models are loaded
    target, draft = embedded.named(target, draft)
    t_model, tokenizer = load_model(target, device="cpu" if offload else device, dtype=spec.dtype)
    if offload:
        offload_to(t_model, device)
    elif spec.packed:
        pack_linears(t_model, PackedLinear)
    t_lm = Model(t_model, device=device)
    d_lm = None
    if draft is not None:
        d_model, d_tok = load_model(draft, device=device, dtype=spec.dtype)
        cross = not same_vocab(tokenizer, d_tok)  # another tokenizer: drafted through text (cross_vocab.py)
        if cross and draft_vocab:
            raise SpeculorError("--draft-vocab restricts a draft that shares the target's vocabulary; this draft has "
                                "another tokenizer")
        if draft_vocab:  # before packing, so that the subset's rows get the draft's kernel kind
            restrict_draft(d_model, tokenizer, draft_vocab, t_lm.vocab_size)
        kind = Int8Linear if spec.draft_int8 else PackedLinear
        lean = spec.lean_draft and spec.draft_int8 and supports(d_model)
        if lean:  # before packing too, each joined matrix packed as it is made
            fuse_projections(d_model, kind if can_pack(d_model) else None)
        if spec.packed or spec.draft_int8:
            pack_linears(d_model, kind)
        d_lm = Model(d_model, vocab_size=None if cross else t_lm.vocab_size, lean=lean)
    return Pair(t_lm, d_lm, tokenizer, target, draft or "", backend="torch",
                draft_tokenizer=d_tok if draft is not None and cross else None)


def gguf_file(spec: str) -> Path:
    """The GGUF file of a model spec (an embedded name or a .gguf path); the llama.cpp backend reads only those."""
    if spec in embedded.EMBEDDED:
        return embedded.ensure_gguf(spec, download=True)
    path = Path(spec).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return path
    raise SpeculorError(f"the llama.cpp backend runs GGUF files: {spec!r} is not one (give a .gguf file or "
                        f"'default', or use --backend torch)")


def load_llama_pair(target: str = "default", draft: str | None = "default", *, threads: int,
                    calls: str = "exact") -> Pair:
    """The pair on llama.cpp (runtime/llama/); the tokenizer is transformers' (from the converted folder of an
    embedded model, else read from the GGUF)."""
    from speculor.runtime.llama.model import LlamaModel

    target, draft = embedded.named(target, draft)
    t_path = gguf_file(target)
    folder, name = ((embedded.model_dir(target), None) if target in embedded.EMBEDDED and embedded.is_ready(target)
                    else (t_path.parent, t_path.name))
    try:
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    except (OSError, ValueError, RuntimeError, KeyError) as exc:
        raise SpeculorError(f"could not read the tokenizer of {target!r} (corrupt or unsupported file?): "
                            f"{exc}") from exc
    t_lm = LlamaModel(t_path, threads=threads, calls=calls)
    d_lm = None
    if draft is not None:
        d_calls = "exact" if calls == "padded" else calls  # a draft's bits need no class: its cheapest load-free one
        d_lm = LlamaModel(gguf_file(draft), threads=threads, vocab_size=t_lm.vocab_size, calls=d_calls)
        if d_lm.vocabulary() != t_lm.vocabulary():
            raise SpeculorError(f"the draft's vocabulary differs from the target's ({d_lm.n_vocab} vs {t_lm.n_vocab} "
                                "tokens); on llama.cpp the draft needs the target's tokenizer (a draft with another "
                                "one runs with --backend torch, drafting through text)")
    return Pair(t_lm, d_lm, tokenizer, target, draft or "", backend="llama.cpp")
