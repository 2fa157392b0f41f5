"""What a caller asks to load: `PairSpec`, a model pair and how it runs, as the command line, Ray's settings and
`speculor.load_pair` name it. Plain data: nothing here checks a file, chooses a backend or loads a model (the three
stages that do, in order: runtime/resolve.py, prepare.py, load.py; runtime/loading.py runs them)."""

from __future__ import annotations

from dataclasses import KW_ONLY, dataclass
from typing import Any

import torch

from speculor.errors import SpeculorError

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
    reference and the GPU path) or 'llama.cpp' (GGUF files on llama.cpp's own quantized kernels, runtime/llama.py).
    threads: the CPU threads of either (default: torch's).
    calls (llama.cpp): 'exact', the default (every row gets the bits of a one-row call in calls of up to 31 rows
    shared with any requests: speculative output is plain decoding's and no answer depends on what shares its
    batch; needs llama.cpp built with patches/llama.cpp, checked at load, else 'vector'), 'vector' (the same from
    calls of at most 3 rows, on llama.cpp as released), or 'batched' (llama.cpp's own call sizes: neither guarantee
    on llama.cpp as released; runtime/llama/model.py).

    packed: on a CPU in fp32, run the target's matmuls through oneDNN weights prepacked once; draft_int8: run the
    draft with int8 weights (kernels.py). Either releases the fp32 weights it replaces (each weight is held once;
    transformers' own generate then needs the models loaded again, bench/peers.py). Neither changes what is
    generated: the target's arithmetic stays fp32, and the draft only proposes.
    draft_vocab: N > 0 restricts the draft's head to the N most frequent tokens (FR-Spec, draft_vocab.py; exact
    as any draft is, docs/algorithms.md §1.1); None or 0: the full vocabulary.
    lean_draft: with int8 draft kernels, run the draft through lean.py's forward (Qwen2/Llama-style drafts; the same
    logits, less time a forward), its q/k/v and gate/up projections joined (`fuse_projections`; docs/bench/README.md
    "Joined projections").
    offload: keep the target's weights in pinned CPU memory and stream them to `device` for each forward
    (load.py's `offload_to`).
    context: the most tokens a request's context holds (prompt and answer; llama-server's `-c`). llama.cpp: also the
    cells of the KV memory every request shares (default: runtime/llama.py's N_CTX); torch: the model's own limit,
    capped at it. None: the backend's own.
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
    context: int | None = None

    def __post_init__(self) -> None:
        if self.backend not in BACKENDS:
            raise SpeculorError(f"unknown backend {self.backend!r}: give one of {', '.join(BACKENDS)}")
        if self.threads is not None and self.threads < 1:
            raise SpeculorError(f"--threads must be at least 1, got {self.threads}")
        if self.context is not None and self.context < 16:
            raise SpeculorError(f"the context (--ctx-size) must be at least 16 tokens, got {self.context}")

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
