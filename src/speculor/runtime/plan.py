"""What the first stage decides: `Plan`, a frozen record of what to load and how (each model's `Source`, one concrete
backend, the options the last stage applies), and `make_plan`, which builds it from a spec whose backend is given
('torch' or 'llama.cpp'; 'auto' is chosen before, by runtime/resolve.py).

Contract: `make_plan` makes every check that needs no model: the device, the options that backend refuses, and each
model spec (an embedded model's name, a .gguf file, or for torch a folder with config.json; anything else is refused
here, before a file is fetched). It only looks at paths: nothing is fetched, written or loaded (runtime/prepare.py
makes the files ready, runtime/load.py loads them).
"""

from __future__ import annotations

from dataclasses import KW_ONLY, dataclass
from pathlib import Path

import torch

from speculor.errors import SpeculorError
from speculor.runtime import embedded
from speculor.runtime.draft_vocab import check_size as draft_vocab_check
from speculor.runtime.spec import PairSpec

LLAMA_MIN_CONTEXT = 1024  # runtime/llama.py's RESERVE (512 cells kept free for a step) and as much for the requests


@dataclass(frozen=True)
class Source:
    """One model as its spec names it. name: the spec as the pair reports it ('default' replaced by the embedded
    model's name, a path as given); kind: 'embedded' (made from its part packages by runtime/prepare.py), 'gguf' (a
    .gguf file) or 'folder' (a transformers folder); path: that file or folder (None for an embedded model)."""

    name: str
    kind: str
    path: Path | None = None


@dataclass(frozen=True)
class Plan:
    """A pair to load: its models' sources (draft None: no draft), a concrete backend ('torch' or 'llama.cpp'), and
    the spec's options as runtime/spec.py's `PairSpec` describes them."""

    target: Source
    draft: Source | None
    backend: str
    _: KW_ONLY
    device: str = "cpu"
    dtype: torch.dtype = torch.float32
    threads: int | None = None
    calls: str = "exact"
    packed: bool = True
    draft_int8: bool = True
    draft_vocab: int | None = None
    lean_draft: bool = True
    offload: bool = False
    context: int | None = None


def locate(spec: str) -> Source:
    """The source a model spec names for torch: an embedded model's name, a .gguf file or a transformers folder."""
    if spec in embedded.EMBEDDED:
        return Source(spec, "embedded")
    path = Path(spec).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return Source(spec, "gguf", path)
    if path.is_dir() and (path / "config.json").exists():
        return Source(spec, "folder", path)
    raise SpeculorError(
        f"no model at {spec!r}: give a folder with config.json, a .gguf file, 'default', or one of "
        f"{', '.join(embedded.EMBEDDED)}")


def locate_gguf(spec: str) -> Source:
    """The source a model spec names for llama.cpp, which reads GGUF files only: an embedded model or a .gguf file."""
    path = Path(spec).expanduser()
    if spec in embedded.EMBEDDED or (path.is_file() and path.suffix == ".gguf"):
        return locate(spec)
    raise SpeculorError(f"the llama.cpp backend runs GGUF files: {spec!r} is not one (give a .gguf file or "
                        f"'default', or use --backend torch)")


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


def _check_torch(spec: PairSpec) -> None:
    if spec.calls != "exact":
        raise SpeculorError(f"--calls {spec.calls} is a llama.cpp setting (torch's rows keep their bits in any "
                            "batch): leave it out, or use --backend llama.cpp")
    check_device(spec.device, spec.offload)
    if spec.draft_vocab:
        if spec.draft is None:
            raise SpeculorError("--draft-vocab restricts the draft model's vocabulary: it needs a draft")
        draft_vocab_check(spec.draft_vocab)


def _check_llama(spec: PairSpec) -> None:
    if spec.offload or torch.device(spec.device).type != "cpu":
        raise SpeculorError("the llama.cpp backend runs on the CPU here: leave out --device/--offload, or use "
                            "--backend torch")
    if spec.draft_vocab:
        raise SpeculorError("--draft-vocab restricts a torch draft's head: use --backend torch")
    if spec.context is not None and spec.context < LLAMA_MIN_CONTEXT:
        raise SpeculorError(f"the llama.cpp backend needs a context (--ctx-size) of at least {LLAMA_MIN_CONTEXT} "
                            f"tokens (its KV memory keeps a step's 512 cells free), got {spec.context}")


def make_plan(spec: PairSpec) -> Plan:
    """The plan of a spec whose backend is given: its options checked for that backend, then its models located
    (the target first); 'default' names the embedded pair's model."""
    if spec.backend == "auto":
        raise SpeculorError("backend 'auto' is chosen before loading: resolve the spec first (runtime/resolve.py, "
                            "as speculor.load_pair does)")
    llama = spec.backend == "llama.cpp"
    (_check_llama if llama else _check_torch)(spec)
    find = locate_gguf if llama else locate
    target, draft = embedded.named(spec.target, spec.draft)
    return Plan(find(target), None if draft is None else find(draft), spec.backend, device=spec.device,
                dtype=spec.dtype, threads=spec.threads, calls=spec.calls, packed=spec.packed,
                draft_int8=spec.draft_int8, draft_vocab=spec.draft_vocab, lean_draft=spec.lean_draft,
                offload=spec.offload, context=spec.context)
