"""The first stages of loading a pair, with no model loaded: `resolve` (a spec -> a frozen Plan: each model's source,
one backend, the options; runtime/resolve.py, plan.py) and `prepare` (the plan's files; runtime/prepare.py) on fake
caches, files and folders. The cache is an empty folder of the test's: resolving writes nothing there."""

from __future__ import annotations

import dataclasses
import json
import platform
from pathlib import Path

import pytest
import torch

from speculor.errors import SpeculorError
from speculor.runtime import choice, embedded
from speculor.runtime.assets import slug
from speculor.runtime.plan import Plan, Source, make_plan
from speculor.runtime.prepare import Files, gguf_file, model_files, prepare
from speculor.runtime.resolve import resolve
from speculor.runtime.spec import PairSpec

TARGET, DRAFT = embedded.DEFAULT_TARGET, embedded.DEFAULT_DRAFT


@pytest.fixture()
def cache(tmp_path, monkeypatch) -> Path:
    """An empty cache; nothing measures (a test that lets auto measure patches `choice.measure` itself)."""
    root = tmp_path / "cache"
    root.mkdir()
    monkeypatch.setenv("SPECULOR_CACHE", str(root))
    monkeypatch.setattr(choice, "measure", lambda *a, **k: pytest.fail("measured"))
    return root


@pytest.fixture()
def files(tmp_path) -> dict[str, str]:
    """A .gguf file and a transformers folder (only their names and config.json are looked at)."""
    (tmp_path / "m.gguf").write_bytes(b"GGUF")
    (tmp_path / "folder").mkdir()
    (tmp_path / "folder" / "config.json").write_text("{}")
    (tmp_path / "empty").mkdir()
    return {"gguf": str(tmp_path / "m.gguf"), "folder": str(tmp_path / "folder"), "empty": str(tmp_path / "empty")}


def llama_runs(monkeypatch, yes: bool = True) -> None:
    """Whether llama-cpp-python counts as installed, whatever is: the one thing auto's choice imports to check."""
    from speculor.runtime.llama import model

    monkeypatch.setattr(model, "available", lambda: yes)


def test_the_default_pair_on_each_backend_names_the_embedded_models(cache):
    for backend in ("torch", "llama.cpp"):
        plan = resolve(PairSpec(backend=backend, threads=3))
        assert plan == Plan(Source(TARGET, "embedded"), Source(DRAFT, "embedded"), backend, threads=3)
        assert dataclasses.is_dataclass(plan) and type(plan).__dataclass_params__.frozen
    assert not list(cache.iterdir())  # nothing fetched, joined or converted


def test_a_gguf_file_and_a_folder(cache, files):
    gguf = Source(files["gguf"], "gguf", Path(files["gguf"]))
    folder = Source(files["folder"], "folder", Path(files["folder"]))
    assert resolve(PairSpec(files["gguf"], None, backend="llama.cpp")).target == gguf
    assert resolve(PairSpec(files["gguf"], files["folder"], backend="torch")) == Plan(gguf, folder, "torch")
    with pytest.raises(SpeculorError, match="runs GGUF files: '.*folder' is not one"):
        resolve(PairSpec(files["gguf"], files["folder"], backend="llama.cpp"))


def test_auto_without_measuring(cache, files, monkeypatch, capsys):
    """A folder: torch; no draft on the CPU: llama.cpp; llama-cpp-python missing: torch; each said on stderr."""
    llama_runs(monkeypatch)
    plan = resolve(PairSpec(files["folder"], "default"))
    assert plan.backend == "torch" and plan.draft == Source(DRAFT, "embedded")
    assert "chose torch: the llama.cpp backend runs GGUF files" in capsys.readouterr().err
    assert resolve(PairSpec("default", None)).backend == "llama.cpp"
    assert "no draft model" in capsys.readouterr().err
    llama_runs(monkeypatch, yes=False)
    assert resolve(PairSpec(files["gguf"], None)).backend == "torch"
    assert "needs llama-cpp-python, which is not installed (nothing measured)" in capsys.readouterr().err


def test_auto_reads_the_cached_measurement(cache, monkeypatch, capsys):
    """The pair measured before on this machine and threads: the cached prediction chooses, nothing is measured."""
    llama_runs(monkeypatch)
    path = cache / "choice" / f"{slug(TARGET)}--{slug(DRAFT)}--{slug(platform.node())}--x2.json"
    path.parent.mkdir()
    record = {"acceptance": 0.8, "predicted": {"torch": {"tokens_per_s": 9.0, "chain": 3},
                                               "llama.cpp": {"tokens_per_s": 12.0, "chain": 2}}}
    path.write_text(json.dumps(record))
    assert resolve(PairSpec(threads=2)).backend == "llama.cpp"
    assert f"cached in {path}" in capsys.readouterr().err
    record["predicted"]["torch"]["tokens_per_s"] = 20.0
    path.write_text(json.dumps(record))
    assert resolve(PairSpec("default", "default", threads=2)).backend == "torch"


def test_auto_measures_once_and_caches(cache, monkeypatch):
    llama_runs(monkeypatch)
    seen = []
    monkeypatch.setattr(choice, "measure", lambda t, d, **kw: seen.append((t, d, kw)) or {
        "acceptance": 0.7, "predicted": {"torch": {"tokens_per_s": 5.0, "chain": 1}}})
    assert resolve(PairSpec(threads=2)).backend == "torch"
    assert resolve(PairSpec(threads=2)).backend == "torch"
    assert seen == [(TARGET, DRAFT, {"device": "cpu", "threads": 2})]


def test_no_draft(cache):
    plan = resolve(PairSpec.named("default", "none", backend="torch"))
    assert plan.draft is None and plan.target == Source(TARGET, "embedded")


def test_the_options_reach_the_plan(cache, files):
    plan = resolve(PairSpec.named(files["folder"], "none", backend="torch", dtype="bfloat16", kernels="eager",
                                  threads=4, draft_vocab=None))
    assert (plan.dtype, plan.packed, plan.draft_int8, plan.threads, plan.device) == (
        torch.bfloat16, False, False, 4, "cpu")
    plan = resolve(PairSpec(files["gguf"], None, backend="llama.cpp", calls="batched"))
    assert plan.calls == "batched" and plan.lean_draft and not plan.offload


@pytest.mark.parametrize(("spec", "message"), [
    (PairSpec("no-such-folder", None, backend="torch"), "no model at 'no-such-folder': give a folder"),
    (PairSpec("default", "no-such.gguf", backend="torch"), "no model at 'no-such.gguf'"),
    (PairSpec("no-such.gguf", None, backend="llama.cpp"), "runs GGUF files: 'no-such.gguf' is not one"),
    (PairSpec("default", None, backend="torch", calls="vector"), "--calls vector is a llama.cpp setting"),
    (PairSpec("default", None, backend="torch", draft_vocab=8), "it needs a draft"),
    (PairSpec("default", backend="torch", draft_vocab=-1), "--draft-vocab"),
    (PairSpec(backend="llama.cpp", draft_vocab=1024), "--draft-vocab restricts a torch draft's head"),
    (PairSpec(backend="llama.cpp", device="cuda"), "runs on the CPU here"),
    (PairSpec(backend="torch", device="gpu"), "unknown device 'gpu'"),
    (PairSpec(device="cpu", offload=True), "--offload streams"),
])
def test_a_bad_spec_is_refused_by_resolve(cache, spec, message):
    with pytest.raises(SpeculorError, match=message):
        resolve(spec)
    assert not list(cache.iterdir())


def test_an_empty_folder_is_no_model(cache, files):
    with pytest.raises(SpeculorError, match="no model at"):
        resolve(PairSpec(files["empty"], None, backend="torch"))
    with pytest.raises(SpeculorError, match="chosen before loading"):
        make_plan(PairSpec(files["folder"], None))


def test_prepare_reads_files_where_they_are(cache, files):
    gguf, folder = Path(files["gguf"]), Path(files["folder"])
    prepared = prepare(resolve(PairSpec(files["gguf"], files["folder"], backend="torch")))
    assert (prepared.target, prepared.draft, prepared.tokenizer) == (
        Files(gguf.parent, "m.gguf"), Files(folder), Files(gguf.parent, "m.gguf"))
    assert prepared.target.path == gguf and prepared.draft.path == folder
    prepared = prepare(resolve(PairSpec(files["gguf"], None, backend="llama.cpp")))
    assert prepared.target.path == gguf and prepared.draft is None and prepared.tokenizer == prepared.target
    assert model_files(files["folder"]) == Files(folder) and gguf_file(files["gguf"]) == gguf


def test_prepare_takes_an_embedded_models_files_from_the_cache(cache):
    """An embedded model already made: torch reads its converted folder, llama.cpp its GGUF file and the tokenizer
    of the converted folder (nothing joined or fetched again)."""
    for name in (TARGET, DRAFT):
        embedded.gguf_path(name).parent.mkdir(parents=True, exist_ok=True)
        embedded.gguf_path(name).write_bytes(b"GGUF")
    on_llama = prepare(resolve(PairSpec(backend="llama.cpp")))
    assert on_llama.target.path == embedded.gguf_path(TARGET) and on_llama.draft.path == embedded.gguf_path(DRAFT)
    assert on_llama.tokenizer == on_llama.target  # no converted folder yet: the tokenizer is read from the GGUF
    for name in (TARGET, DRAFT):
        embedded.model_dir(name).mkdir(parents=True)
        (embedded.model_dir(name) / "config.json").write_text("{}")
    on_llama = prepare(resolve(PairSpec(backend="llama.cpp")))
    assert on_llama.tokenizer == Files(embedded.model_dir(TARGET))
    on_torch = prepare(resolve(PairSpec(backend="torch")))
    assert (on_torch.target, on_torch.draft) == (Files(embedded.model_dir(TARGET)), Files(embedded.model_dir(DRAFT)))
