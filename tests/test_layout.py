"""The package layout keeps its promises: strategies do not import each other, the decoding path loads no training,
plotting or benchmark code, layers import downwards only, and no source file grows past ~400 lines."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src" / "speculor"
STRATEGIES = ["dyspec", "gsd", "sequoia", "specdecpp", "specinfer", "suffix", "topk_tree"]
# a module may import from its own layer and the layers below it (config and errors are at the bottom)
LAYERS = ["core", "runtime", "drafters", "engine", "api", "methods", "serving", "bench"]  # api: the module api.py


def speculor_imports(path: Path) -> set[str]:
    """Every `speculor.*` module a file imports, at top level or inside functions."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("speculor"):
            out.add(node.module)
            out.update(f"{node.module}.{a.name}" for a in node.names)
        elif isinstance(node, ast.Import):
            out.update(a.name for a in node.names if a.name.startswith("speculor"))
    return out


@pytest.mark.parametrize("name", STRATEGIES)
def test_no_strategy_imports_another(name):
    others = {f"speculor.drafters.{o}" for o in STRATEGIES if o != name} | {"speculor.drafters.registry"}
    assert not speculor_imports(SRC / "drafters" / f"{name}.py") & others


def test_layers_import_downwards():
    for i, layer in enumerate(LAYERS):
        above = {f"speculor.{up}" for up in LAYERS[i + 1:]} | {"speculor.cli"}
        for path in [SRC / "api.py"] if layer == "api" else (SRC / layer).glob("*.py"):
            bad = {m for m in speculor_imports(path) if any(m == a or m.startswith(a + ".") for a in above)}
            if layer == "methods":  # offline work may read the prompt sets of bench/
                bad -= {"speculor.bench.prompts", "speculor.bench", "speculor.bench.prompts.sharegpt_records"}
            assert not bad, f"{path.relative_to(SRC)} imports {sorted(bad)} from a layer above"


def test_decoding_path_loads_no_offline_code():
    offline = ("speculor.methods", "speculor.bench", "matplotlib")
    code = ("import sys; import speculor.api, speculor.drafters.registry, speculor.engine, speculor.runtime.loading;"
            f"bad = sorted(m for m in sys.modules if m.startswith({offline!r})); print(bad); sys.exit(1 if bad else 0)")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr


def test_no_source_file_is_long():
    long = {str(p.relative_to(SRC)): n for p in SRC.rglob("*.py") if (n := len(p.read_text().splitlines())) > 420}
    assert not long
