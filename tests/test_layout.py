"""The package layout keeps its promises: strategies do not import each other (every registered one checked), the
decoding path loads no training, plotting or benchmark code, layers import downwards only, nothing below the command
line imports it, the modules of runtime/ and engine/ import one another one way only (type-only imports counted),
and no function grows past MAX_FUNCTION lines."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src" / "speculor"
STRATEGIES = ["chain", "dyspec", "eagle", "gsd", "ngram", "ngram_mod", "sequoia", "specdecpp", "specinfer", "suffix",
              "topk_tree"]
# a module may import from its own layer and the layers below it (config and errors are at the bottom)
LAYERS = ["core", "runtime", "drafters", "engine", "api", "methods", "serving", "bench"]  # api: the module api.py
MAX_FUNCTION = 60  # lines of a function or method, decorators and docstring included


def speculor_imports(path: Path) -> set[str]:
    """Every `speculor.*` module a file imports, at top level, inside functions or under `if TYPE_CHECKING:`."""
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


def long_functions(root: Path, limit: int = MAX_FUNCTION) -> dict[str, int]:
    """Every function or method under `root` longer than `limit` lines: {"path:name": lines}."""
    out = {}
    for path in root.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                first = min([node.lineno, *(d.lineno for d in node.decorator_list)])
                if (n := node.end_lineno - first + 1) > limit:
                    out[f"{path.relative_to(root)}:{node.name}"] = n
    return out


def test_no_function_is_long(tmp_path):
    """No function of the package is longer than MAX_FUNCTION lines; the check sees a long one (negative control)."""
    assert not long_functions(SRC)
    (tmp_path / "m.py").write_text("def f():\n" + "    x = 1\n" * MAX_FUNCTION)
    assert long_functions(tmp_path) == {"m.py:f": MAX_FUNCTION + 1}


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


def import_cycle(package: Path) -> list[str] | None:
    """An import cycle among the modules of `package` (its subpackages' included, a package standing for its
    __init__), counting imports inside functions and under `if TYPE_CHECKING:`; None where there is none."""
    modules = {}
    for p in package.rglob("*.py"):
        parts = p.relative_to(SRC).with_suffix("").parts
        modules[".".join(("speculor", *(parts[:-1] if parts[-1] == "__init__" else parts)))] = p
    graph = {m: imported_modules(p, set(modules)) - {m} for m, p in modules.items()}
    done: set[str] = set()

    def visit(m: str, path: list[str]) -> list[str] | None:
        if m in path:
            return path[path.index(m):] + [m]
        if m in done:
            return None
        for n in sorted(graph[m]):
            if cycle := visit(n, path + [m]):
                return cycle
        done.add(m)
        return None

    return next((c for m in sorted(graph) if (c := visit(m, []))), None)


@pytest.mark.parametrize("package", ["runtime", "engine"])
def test_imports_have_no_cycle(package):
    """runtime/'s and engine/'s modules import one another one way only, type-only imports included."""
    cycle = import_cycle(SRC / package)
    assert cycle is None, f"{package}/ import cycle: {' -> '.join(cycle)}"


def test_a_cycle_through_a_type_only_import_is_seen(tmp_path, monkeypatch):
    """Negative control: two modules that import each other, one of them only under TYPE_CHECKING."""
    pkg = tmp_path / "speculor" / "fake"
    pkg.mkdir(parents=True)
    (pkg / "a.py").write_text("from speculor.fake.b import B\n")
    (pkg / "b.py").write_text("from typing import TYPE_CHECKING\n"
                              "if TYPE_CHECKING:\n    from speculor.fake.a import A\n")
    monkeypatch.setattr(sys.modules[__name__], "SRC", tmp_path / "speculor")
    assert import_cycle(pkg) in (["speculor.fake.a", "speculor.fake.b", "speculor.fake.a"],
                                 ["speculor.fake.b", "speculor.fake.a", "speculor.fake.b"])
