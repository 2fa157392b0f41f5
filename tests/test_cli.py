"""The command line: `--help` and `loadtest` start without torch, strategy options reach only a strategy that
takes them (refused before any model is loaded), the registry's messages, and every name the commands import.
No model is loaded here: the pair loader is replaced by one that fails the test if it is called."""

from __future__ import annotations

import ast
import importlib
import inspect
import json
import socket
import subprocess
import sys
import textwrap
import types
from pathlib import Path

import pytest

from speculor import cli, commands
from speculor.errors import SpeculorError

COMMANDS = ["generate", "bench", "calibrate", "profile", "train-head", "tune-threshold", "refit-priors", "fetch-models",
            "serve", "loadtest"]
HEAVY = ("torch", "transformers")


def _python(code: str) -> subprocess.CompletedProcess:
    """Run `code` in a fresh interpreter (this one has torch imported already); its last stdout line is JSON."""
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                          timeout=120)


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def no_pair(monkeypatch):
    """Fail the test if a command gets as far as loading a model pair."""
    def load(args):
        raise AssertionError("the model pair was loaded")

    monkeypatch.setattr(commands, "load", load)


# ------------------------------------------------------------------------------------------- no torch at start


def test_help_of_every_command_imports_no_torch() -> None:
    proc = _python(f"""
        import json, sys
        from speculor.cli import main
        codes = []
        for argv in [["--help"]] + [[c, "--help"] for c in {COMMANDS!r}]:
            try:
                main(argv)
            except SystemExit as exc:
                codes.append(exc.code)
        print(json.dumps({{"codes": codes, "heavy": [m for m in {HEAVY!r} if m in sys.modules]}}))
    """)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out == {"codes": [0] * (len(COMMANDS) + 1), "heavy": []}
    assert "strategy options" in proc.stdout and "loadtest" in proc.stdout


def test_loadtest_against_a_closed_port_fails_cleanly_without_torch() -> None:
    port = _closed_port()
    proc = _python(f"""
        import json, sys
        from speculor.bench import prompts
        prompts.load = lambda sets, limit: [prompts.Prompt("p", "mtbench", "writing", "Hello", True)]
        from speculor.cli import main
        try:
            main(["loadtest", "--help"])
        except SystemExit:
            pass
        code = main(["loadtest", "--url", "http://127.0.0.1:{port}", "--clients", "1", "--max-tokens", "1"])
        print(json.dumps({{"code": code, "heavy": [m for m in {HEAVY!r} if m in sys.modules]}}))
    """)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == {"code": 2, "heavy": []}
    assert f"speculor: error: cannot connect to http://127.0.0.1:{port}" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_loadtest_refuses_bad_clients(capsys) -> None:
    assert cli.main(["loadtest", "--clients", "1,x"]) == 2
    assert "--clients takes comma-separated integers" in capsys.readouterr().err


# ------------------------------------------------------------------------------------------- strategy options


@pytest.mark.parametrize("argv, message", [
    (["--strategy", "chain", "--depth", "3"], "strategy 'chain' takes no option 'depth' (its options: k)"),
    (["--strategy", "sequoia", "--k", "2", "--head", "h"],
     "strategy 'sequoia' takes no option 'head', 'k' (its options: budget, depth, width, acc)"),
    (["--strategy", "specdecpp", "--width", "4"],
     "strategy 'specdecpp' takes no option 'width' (its options: threshold, k_min, k_max, head, budget)"),
    (["--strategy", "plain", "--k", "2"], "strategy 'plain' takes no option 'k' (its options: none)"),
])
@pytest.mark.parametrize("command", [["generate", "--prompt", "hi"], ["serve"]])
def test_an_option_the_strategy_does_not_take_is_refused(command, argv, message, no_pair, capsys) -> None:
    assert cli.main(command + argv) == 2
    assert capsys.readouterr().err.strip() == f"speculor: error: {message}"


@pytest.mark.parametrize("command, argv, message", [
    (["generate", "--prompt", "hi"], ["--depth", "3"], "strategy 'default' takes no option 'depth' (its options: "
                                                       "budget, max_depth, min_prob, shared, max_tokens, fallback, "
                                                       "max_spec_factor)"),
    (["serve"], ["--k", "3"], "strategy 'default' takes no option 'k' (its options: budget, max_depth, min_prob, "
                              "shared, max_tokens, fallback, max_spec_factor)"),
])
def test_the_default_strategy_refuses_what_it_does_not_take(command, argv, message, no_pair, capsys) -> None:
    """generate and serve share one default strategy, suffix's options (with dyspec's fallback beside a draft)."""
    assert cli.main(command + argv) == 2
    assert message in capsys.readouterr().err


def test_only_given_options_reach_the_strategy(monkeypatch) -> None:
    import speculor.api

    seen = []
    pair = types.SimpleNamespace(draft_tokenizer=None)  # a pair whose draft shares the target's tokenizer
    monkeypatch.setattr(commands, "load", lambda args: pair)

    class Recorder:
        def __init__(self, pair, strategy, **options):
            seen.append((pair, strategy, options))
            raise SpeculorError("stop here")

    monkeypatch.setattr(speculor.api, "Speculor", Recorder)
    assert cli.main(["generate", "--prompt", "hi", "--strategy", "sequoia", "--budget", "auto", "--depth", "5"]) == 2
    assert cli.main(["generate", "--prompt", "hi", "--strategy", "specdecpp", "--k-min", "3",
                     "--threshold", "0.5"]) == 2
    assert cli.main(["generate", "--prompt", "hi"]) == 2
    assert seen == [(pair, "sequoia", {"budget": "auto", "depth": 5}),
                    (pair, "specdecpp", {"threshold": 0.5, "k_min": 3}), (pair, "default", {})]

    served = []
    fake = types.ModuleType("speculor.serving.app")
    fake.serve = lambda pair, **kw: served.append((pair, kw))
    monkeypatch.setitem(sys.modules, "speculor.serving.app", fake)
    assert cli.main(["serve", "--strategy", "topk-tree", "--k", "3", "--budget", "12", "--port", "1"]) == 0
    assert cli.main(["serve", "--budget", "4", "--max-batch", "16"]) == 0  # the default: suffix, dyspec's fallback
    assert cli.main(["serve", "--depth", "4"]) == 2  # not an option of the default strategy
    assert served == [(pair, {"host": "127.0.0.1", "port": 1, "strategy": "topk-tree", "queue_size": 64,
                                "max_batch": 16, "k": 3, "budget": 12}),
                      (pair, {"host": "127.0.0.1", "port": 8000, "strategy": "default", "queue_size": 64,
                                "max_batch": 16, "budget": 4})]


@pytest.mark.parametrize("strategies, message", [
    ("plain,chain:depth=2", "strategy 'chain' takes no option 'depth' (its options: k)"),
    ("hf-assisted:k=2", "'hf-assisted:k=2': the peer 'hf-assisted' takes no options"),
    ("nope", "unknown strategy 'nope'"),
])
def test_bench_refuses_bad_strategies_before_loading(strategies, message, no_pair, capsys) -> None:
    assert cli.main(["bench", "--strategies", strategies]) == 2
    assert message in capsys.readouterr().err


def test_unknown_strategy_lists_every_registered_strategy(no_pair, capsys) -> None:
    from speculor.drafters.registry import BUILDERS, make_strategy, options_of
    from speculor.runtime.backend import Pair

    for call in (lambda: make_strategy("nope", Pair(None, None, None)), lambda: options_of("nope")):
        with pytest.raises(SpeculorError, match="unknown strategy 'nope'") as info:
            call()
        assert all(name in str(info.value) for name in BUILDERS)
    assert cli.main(["generate", "--prompt", "hi", "--strategy", "nope"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("speculor: error: unknown strategy 'nope'") and all(name in err for name in BUILDERS)


def test_options_of_matches_each_builders_keyword_parameters() -> None:
    from speculor.drafters.registry import BUILDERS, make_strategy, options_of
    from speculor.runtime.backend import Pair

    for name, builder in BUILDERS.items():  # the default strategy takes suffix's options
        params = list(inspect.signature(BUILDERS["suffix"] if name == "default" else builder).parameters.values())
        assert params[0].name == "pair", name
        assert options_of(name) == [p.name for p in params[1:]], name
        assert all(p.default is not inspect.Parameter.empty and p.kind is p.POSITIONAL_OR_KEYWORD
                   for p in params[1:]), name  # every option is optional and may be given by keyword
        with pytest.raises(SpeculorError, match=f"strategy '{name}' takes no option 'nope' "):
            make_strategy(name, Pair(None, None, None), nope=1)  # refused before the pair is touched


def test_the_clis_static_tables_agree_with_the_registry() -> None:
    """--help names the strategies and which take each option without importing the registry (torch)."""
    from speculor.drafters.registry import BUILDERS, options_of

    assert cli.STRATEGIES == tuple(BUILDERS)
    assert cli.TAKEN_BY == {opt: tuple(n for n in BUILDERS if opt in options_of(n)) for opt in cli.TAKEN_BY}


def test_the_default_backend_is_auto_but_where_transformers_models_are_trained() -> None:
    for command in (["generate", "--prompt", "hi"], ["bench"], ["calibrate"], ["profile"], ["serve"]):
        assert cli._parser().parse_args(command).backend == "auto", command
    for command in (["train-head"], ["tune-threshold"]):  # the SpecDec++ head reads the draft's transformers model
        assert cli._parser().parse_args(command).backend == "torch", command


def test_bench_help_shows_the_bench_defaults(capsys) -> None:
    from speculor.bench.config import DEFAULTS, QUICK, BenchConfig

    with pytest.raises(SystemExit):
        cli.main(["bench", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert f"(default {DEFAULTS['strategies']})" in text and f"(default {DEFAULTS['limit']})" in text
    assert f"(default {DEFAULTS['max_new_tokens']})" in text and f"(default {DEFAULTS['temperatures']})" in text
    assert f"{QUICK['limit']} prompts, {QUICK['max_new_tokens']} tokens" in text
    args = cli._parser().parse_args(["bench", "--quick", "--limit", "5"])
    cfg = BenchConfig.from_args(args)
    assert cfg.limit == 5 and ",".join(s.label for s in cfg.strategies) == QUICK["strategies"]


# ------------------------------------------------------------------------------------------- imports resolve


def test_every_name_the_commands_import_exists() -> None:
    """The command functions import lazily; every `from M import N` there, and every `M.N` read from a module
    imported so, must resolve (a stale name of the old flat layout fails here, not in front of a user)."""
    modules_of = sorted(Path(commands.__file__).parent.glob("*.py"))
    assert {p.stem for p in modules_of} >= {c.replace("-", "_") for c in COMMANDS}
    functions = [n for p in modules_of for n in ast.parse(p.read_text()).body if isinstance(n, ast.FunctionDef)]
    checked = 0
    for fn in functions:
        modules: dict[str, object] = {}
        for node in ast.walk(fn):
            if isinstance(node, ast.ImportFrom) and node.module:
                for alias in node.names:
                    try:  # a submodule, as in `from speculor.bench import prompts`
                        target = importlib.import_module(f"{node.module}.{alias.name}")
                    except ModuleNotFoundError:
                        target = importlib.import_module(node.module)
                        assert hasattr(target, alias.name), f"{fn.name}: {node.module}.{alias.name}"
                        target = getattr(target, alias.name)
                    modules[alias.asname or alias.name] = target
                    checked += 1
        for node in ast.walk(fn):
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in modules:
                mod = modules[node.value.id]
                if isinstance(mod, types.ModuleType):
                    assert hasattr(mod, node.attr), f"{fn.name}: {mod.__name__}.{node.attr}"
                    checked += 1
    assert checked > 30


@pytest.mark.parametrize("json_out", [False, True])
def test_generate_prints_the_peak_memory(json_out, monkeypatch, capsys) -> None:
    """One stderr line with the process's peak resident memory (runtime/memory.py), after the text or the JSON."""
    from support.server import tiny_pair

    monkeypatch.setattr(commands, "load", lambda args: tiny_pair())
    assert cli.main(["generate", "--prompt", "The quick brown fox", "--max-new-tokens", "4"]
                    + (["--json"] if json_out else [])) == 0
    out, err = capsys.readouterr()
    assert out.strip() and (json.loads(out)["token_ids"] if json_out else True)
    line = err.strip().splitlines()[-1]
    assert line.startswith("peak resident memory: ")
    if Path("/proc/self/status").exists():
        assert 0.05 < float(line.removeprefix("peak resident memory: ").removesuffix(" GiB")) < 1024


REFUSED_DEVICES = [(["--offload"], "--offload streams"), (["--device", "gpu"], "unknown device"),
                   (["--device", "cuda:99"], "cuda:99")]


@pytest.mark.parametrize(("argv", "message"), REFUSED_DEVICES)
def test_a_device_that_cannot_run_is_refused_before_loading(argv, message, capsys) -> None:
    assert cli.main(["generate", "--prompt", "hi", *argv]) == 2
    assert message in capsys.readouterr().err


def test_the_arguments_reach_the_loader_as_a_pair_spec(monkeypatch) -> None:
    """One PairSpec from the arguments (`commands.pair_spec`): dtype auto is bfloat16 on cuda, float32 on cpu; a
    command without an option gets its default; it goes to `speculor.load_pair`, which chooses the backend."""
    import torch

    from speculor.runtime import loading
    from speculor.runtime.spec import PairSpec

    seen = []
    monkeypatch.setattr(loading, "load_pair", seen.append)
    for device, dtype, expected in (("cpu", "auto", torch.float32), ("cuda", "auto", torch.bfloat16),
                                    ("cuda", "float32", torch.float32), ("cpu", "float16", torch.float16)):
        commands.load(types.SimpleNamespace(target="t", draft="d", device=device, dtype=dtype))
        assert seen[-1] == PairSpec("t", "d", device=device, dtype=expected), (device, dtype)
    args = cli._parser().parse_args(["generate", "--prompt", "hi", "--draft", "none", "--kernels", "eager",
                                     "--backend", "llama.cpp", "--threads", "3", "--calls", "batched"])
    assert commands.pair_spec(args) == PairSpec("default", None, packed=False, draft_int8=False, backend="llama.cpp",
                                                threads=3, calls="batched")


def test_generate_takes_the_servers_sampling_fields(monkeypatch, capsys) -> None:
    """`speculor generate` takes what the server takes: a logit bias that bans the greedy first token changes it,
    penalties and logprobs reach the library (checked against the Python API with the same settings)."""
    from support.server import tiny_pair

    from speculor import SamplingConfig, Speculor

    pair = tiny_pair()
    monkeypatch.setattr(commands, "load", lambda args: pair)
    base = ["generate", "--prompt", "The quick brown fox", "--max-new-tokens", "8", "--json"]
    assert cli.main(base + ["--logprobs", "2"]) == 0
    plain = json.loads(capsys.readouterr().out)
    assert len(plain["logprobs"]) == 8 and all(len(e["top"]) == 2 for e in plain["logprobs"])
    first = plain["token_ids"][0]
    assert cli.main(base + ["--logit-bias", f"{first}=-100", "--frequency-penalty", "1.5",
                            "--repetition-penalty", "1.3"]) == 0
    changed = json.loads(capsys.readouterr().out)["token_ids"]
    assert changed[0] != first
    sp = Speculor(pair)
    cfg = SamplingConfig(max_new_tokens=8, logit_bias={first: -100}, frequency_penalty=1.5, repetition_penalty=1.3)
    assert changed == sp.generate(sp.encode("The quick brown fox"), cfg).token_ids
    assert cli.main(base + ["--logit-bias", "x=1"]) == 2
    assert "--logit-bias takes ID=BIAS" in capsys.readouterr().err


def test_the_default_strategy_is_suffix_with_dyspec_s_fallback_only_beside_a_draft(monkeypatch) -> None:
    """One default everywhere (library, generate, serve, bench): suffix with budget auto and DySpec's fallback where
    a draft model is loaded (suffix alone without one); chain through text for a draft with another tokenizer;
    the options given are suffix's."""
    from speculor.api import Speculor
    from speculor.drafters import registry

    built = []
    monkeypatch.setattr(registry, "make_suffix", lambda pair, budget, *rest: built.append((budget, rest[-2])))
    monkeypatch.setitem(registry.BUILDERS, "dyspec", lambda pair, budget=None: ("dyspec", {"budget": budget}))
    monkeypatch.setattr(registry, "_chain", lambda pair: built.append("chain"))
    registry.make_strategy("default", types.SimpleNamespace(draft=object(), draft_tokenizer=None))
    registry.make_strategy("default", types.SimpleNamespace(draft=None, draft_tokenizer=None), budget=8)
    registry.make_strategy("default", types.SimpleNamespace(draft=object(), draft_tokenizer=object()))
    assert built == [("auto", ("dyspec", {"budget": "auto"})), (8, None), "chain"]
    assert registry.options_of("default") == registry.options_of("suffix")
    with pytest.raises(SpeculorError, match="takes no option 'k'"):
        registry.check_options("default", {"k": 3})
    assert inspect.signature(Speculor.__init__).parameters["strategy"].default == "default"


def test_generate_takes_a_json_schema_or_a_grammar_file(monkeypatch, capsys, tmp_path) -> None:
    """--json-schema FILE and --grammar FILE (GBNF; Lark for .lark) constrain the output; a file that is not JSON or
    a grammar that does not compile is a clear error (exit 2), not a traceback."""
    from support.server import tiny_pair

    pair = tiny_pair()
    monkeypatch.setattr(commands, "load", lambda args: pair)
    schema = tmp_path / "s.json"
    schema.write_text(json.dumps({"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
                                  "additionalProperties": False}))
    base = ["generate", "--prompt", "The quick brown fox", "--max-new-tokens", "40", "--json"]
    assert cli.main(base + ["--json-schema", str(schema)]) == 0
    assert set(json.loads(json.loads(capsys.readouterr().out)["text"])) == {"ok"}
    gbnf, lark = tmp_path / "g.gbnf", tmp_path / "g.lark"
    gbnf.write_text('root ::= "yes" | "no"')
    lark.write_text('start: "up" | "down"')
    assert cli.main(base + ["--grammar", str(gbnf)]) == 0
    assert json.loads(capsys.readouterr().out)["text"] in ("yes", "no")
    assert cli.main(base + ["--grammar", str(lark)]) == 0
    assert json.loads(capsys.readouterr().out)["text"] in ("up", "down")
    gbnf.write_text("root ::= (")
    assert cli.main(base + ["--grammar", str(gbnf)]) == 2
    assert "gbnf" in capsys.readouterr().err.lower()
    schema.write_text("{nope")
    assert cli.main(base + ["--json-schema", str(schema)]) == 2
    assert "not JSON" in capsys.readouterr().err
