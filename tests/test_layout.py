"""The package layout keeps its promises: strategies do not import each other (every registered one checked), the
decoding path loads no training, plotting or benchmark code, layers import downwards only, nothing below the command
line imports it, runtime/'s imports (its subpackages' included) have no cycle, no source file grows past ~400 lines
and no function of the llama.cpp backend past 60."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src" / "speculor"
STRATEGIES = ["chain", "dyspec", "eagle", "gsd", "ngram", "sequoia", "specdecpp", "specinfer", "suffix", "topk_tree"]
# a module may import from its own layer and the layers below it (config and errors are at the bottom)
LAYERS = ["core", "runtime", "drafters", "engine", "api", "methods", "serving", "bench"]  # api: the module api.py


def speculor_imports(path: Path, type_checking: bool = True) -> set[str]:
    """Every `speculor.*` module a file imports, at top level or inside functions (and, unless type_checking is
    False, under `if TYPE_CHECKING:`)."""
    tree = ast.parse(path.read_text())
    typing_only = set() if type_checking else {
        id(n) for block in ast.walk(tree) if isinstance(block, ast.If) and "TYPE_CHECKING" in ast.unparse(block.test)
        for stmt in block.body for n in ast.walk(stmt)}
    out = set()
    for node in ast.walk(tree):
        if id(node) in typing_only:
            continue
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
        for path in [SRC / "api.py"] if layer == "api" else (SRC / layer).rglob("*.py"):
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


def test_the_llama_backends_functions_are_short():
    """runtime/llama/ is split by role: no function there grows past 60 lines."""
    long = {f"{p.name}:{n.name}": n.end_lineno - n.lineno + 1 for p in (SRC / "runtime" / "llama").glob("*.py")
            for n in ast.walk(ast.parse(p.read_text())) if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)
            and n.end_lineno - n.lineno + 1 > 60}
    assert not long


def test_every_registered_strategy_with_a_module_is_checked():
    """STRATEGIES (test_no_strategy_imports_another) names every strategy of the registry's BUILDERS that has a
    module of its own in drafters/ (read from the source: no torch)."""
    tree = ast.parse((SRC / "drafters" / "registry.py").read_text())
    (table,) = [n.value for n in tree.body if isinstance(n, (ast.Assign, ast.AnnAssign))
                and "BUILDERS" in ast.unparse(n.targets[0] if isinstance(n, ast.Assign) else n.target)]
    names = [k.value.replace("-", "_") for k in table.keys]
    assert len(names) > 10
    assert not [n for n in names if (SRC / "drafters" / f"{n}.py").exists() and n not in STRATEGIES]


BELOW_THE_COMMAND_LINE = ["serving", "runtime", "engine", "drafters", "core", "bench", "methods"]


def test_nothing_below_the_command_line_imports_it():
    """The command line (cli.py, the commands package) is above everything: no library module imports it, at top
    level or inside a function."""
    command_line = ("speculor.cli", "speculor.commands")
    for path in [SRC / "api.py", *(p for d in BELOW_THE_COMMAND_LINE for p in (SRC / d).rglob("*.py"))]:
        bad = {m for m in speculor_imports(path) if any(m == c or m.startswith(c + ".") for c in command_line)}
        assert not bad, f"{path.relative_to(SRC)} imports {sorted(bad)}"


def runtime_modules() -> dict[str, Path]:
    """runtime/'s modules, its subpackages' included, by dotted name (a package's __init__ by the package's)."""
    out = {}
    for p in (SRC / "runtime").rglob("*.py"):
        parts = p.relative_to(SRC / "runtime").with_suffix("").parts
        parts = parts[:-1] if parts[-1] == "__init__" else parts
        if parts:
            out["speculor.runtime." + ".".join(parts)] = p
    return out


def imported_modules(path: Path, known: set[str]) -> set[str]:
    """The modules of `known` a file imports, at top level, inside functions and under `if TYPE_CHECKING:`:
    `from package import module` imports that module, `from module import name` that module. (The package a module
    lies in, which Python imports first, is not counted: a package's __init__ may re-export its modules.)"""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            out.update(f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in known else node.module
                       for a in node.names)
        elif isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
    return out & known


def test_runtime_imports_have_no_cycle():
    """runtime/'s modules, its subpackages' included, import one another one way only (imports inside functions and
    under `if TYPE_CHECKING:` count: a cycle of types is a cycle of design)."""
    modules = runtime_modules()
    graph = {m: imported_modules(p, set(modules)) - {m} for m, p in modules.items()}
    done: set[str] = set()

    def visit(m: str, path: list[str]) -> None:
        if m in path:
            raise AssertionError(f"runtime/ import cycle: {' -> '.join(path[path.index(m):] + [m])}")
        if m not in done:
            for n in sorted(graph[m]):
                visit(n, path + [m])
            done.add(m)

    assert "speculor.runtime.llama.cells" in graph
    for m in sorted(graph):
        visit(m, [])
