"""`speculor bench` end to end on the tiny random pair of support/server.py (no downloads): records, summary, table,
plots, greedy identity against plain decoding, and the divergence report."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from support.bench import bench_config
from support.server import TEXTS, tiny_pair

from speculor.bench import run as bench
from speculor.bench.config import DEFAULTS, QUICK
from speculor.bench.prompts import Prompt
from speculor.bench.specs import parse_strategies
from speculor.errors import SpeculorError


@pytest.fixture(scope="module")
def pair():
    return tiny_pair()


def test_bench_run_writes_everything(pair, tmp_path, monkeypatch) -> None:
    prompts = [Prompt("mtbench/1", "mtbench", "writing", TEXTS[0], True),
               Prompt("HumanEval/0", "humaneval", "code", TEXTS[1], False)]
    monkeypatch.setattr(bench.prompt_sets, "load", lambda sets, limit: prompts[:limit])
    monkeypatch.setenv("SPECULOR_CACHE", str(tmp_path / "cache"))  # the cost profile of the tiny pair
    args = bench_config("--strategies", "chain:k=2,plain,ngram,hf-assisted", "--temperatures", "0,0.7", "--limit", "2",
                        "--max-new-tokens", "12", "--rounds", "2", "--out", str(tmp_path))
    summary = bench.run(args, lambda: pair)
    assert list(summary) == ["plain", "chain:k=2", "ngram", "hf-assisted"]  # plain first, always
    for label, s in summary.items():
        assert s["greedy_identical"] == 1.0 and s["n_prompts"] == 2 and s["new_tokens"] == 24, label
        assert set(s["by_temperature"]) == {"0.0", "0.7"} and s["by_temperature"]["0.7"]["greedy_identical"] is None
    chain = summary["chain:k=2"]
    assert 1 <= chain["tau"] <= 3 and len(chain["acceptance_by_depth"]) <= 2 and chain["mean_tree_size"] == 2
    assert chain["draft_forwards_per_step"] == 2 and chain["decode_speedup"] > 0
    assert summary["plain"]["decode_speedup"] == pytest.approx(1.0) and summary["hf-assisted"]["decode_speedup"] is None
    if Path("/proc/self/status").exists():  # Linux: the process's peak resident set
        assert all(s["peak_memory_gib"] > 0.01 for s in summary.values())
    assert summary["plain"]["speedup"] == pytest.approx(1.0) and summary["plain"]["tau"] == 1.0
    records = [json.loads(line) for line in (tmp_path / "records.jsonl").read_text().splitlines()]
    assert len(records) == 2 * 2 * 4 * 2 and all(r["new_tokens"] == 12 for r in records)
    saved = json.loads((tmp_path / "summary.json").read_text())
    assert saved["_run"]["strategies"] == "plain,chain:k=2,ngram,hf-assisted" and "chain:k=2" in saved
    assert "| chain:k=2 | 0.0 |" in (tmp_path / "table.md").read_text()
    assert any(p.suffix == ".png" for p in tmp_path.iterdir())
    assert not (tmp_path / "records.partial.jsonl").exists()  # a finished run keeps its records in one file


def test_a_run_stopped_early_keeps_its_records(pair, tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(bench.prompt_sets, "load", lambda sets, limit: [Prompt("p", "mtbench", "w", TEXTS[0], True)])
    monkeypatch.setenv("SPECULOR_CACHE", str(tmp_path / "cache"))
    done, run_one = [], bench.run_one

    def stopped_after_three(*a, **k):
        if len(done) == 3:
            raise KeyboardInterrupt  # e.g. `timeout` or Ctrl-C in the fourth generation
        done.append(1)
        return run_one(*a, **k)

    monkeypatch.setattr(bench, "run_one", stopped_after_three)
    monkeypatch.setattr(bench, "_warm_up", lambda *a: None)  # its generations are not records
    args = bench_config("--strategies", "plain,chain:k=2", "--limit", "1", "--max-new-tokens", "6", "--rounds", "3",
                        "--out", str(tmp_path))
    with pytest.raises(KeyboardInterrupt):
        bench.run(args, lambda: pair)
    kept = [json.loads(line) for line in (tmp_path / "records.partial.jsonl").read_text().splitlines()]
    assert [r["round"] for r in kept] == [0, 0, 1] and not (tmp_path / "records.jsonl").exists()
    assert {r["strategy"] for r in kept} == {"plain", "chain:k=2"} and all(r["new_tokens"] == 6 for r in kept)


def test_quick_fills_only_what_was_not_given() -> None:
    args = bench_config("--quick", "--temperatures", "0,0.7")
    assert args.temperatures == (0.0, 0.7) and args.limit == QUICK["limit"] and args.quick
    plain = bench_config("--limit", "3")
    assert plain.limit == 3 and plain.strategies == tuple(parse_strategies(DEFAULTS["strategies"]))
    names = [s.name for s in args.strategies]
    from speculor.drafters.registry import BUILDERS

    assert set(BUILDERS) | {"hf-assisted", "hf-prompt-lookup"} <= set(names)  # --quick runs every strategy


def test_parse_strategies_and_divergence() -> None:
    specs = parse_strategies("chain:k=2:x=0.5,sequoia:budget=auto")
    assert [(s.label, s.name, s.options) for s in specs] == [
        ("plain", "plain", {}), ("chain:k=2:x=0.5", "chain", {"k": 2, "x": 0.5}),
        ("sequoia:budget=auto", "sequoia", {"budget": "auto"})]
    with pytest.raises(SpeculorError, match="key=value"):
        parse_strategies("chain:k")
    for bad, message in ((("--rounds", "0"), "rounds"), (("--batch", "0,4"), "batch"),
                         (("--temperatures", "x"), "temperatures")):
        with pytest.raises(SpeculorError, match=message):
            bench_config(*bad)
    assert bench.first_divergence([1, 2, 3], [1, 2, 3]) is None
    assert bench.first_divergence([1, 2, 3], [1, 5, 3]) == 1
    assert bench.first_divergence([1, 2], [1, 2, 3]) == 2


@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="needs Linux's /proc")
def test_peak_memory_sees_a_new_allocation_after_a_reset() -> None:
    cpu = torch.device("cpu")
    bench.reset_peak_memory(cpu)
    before = bench.peak_memory_gib(cpu)
    block = torch.ones(256 * 2**20 // 4)  # 256 MiB, touched
    after = bench.peak_memory_gib(cpu)
    assert before is not None and after - before > 0.2 and float(block[-1]) == 1.0
    del block
    bench.reset_peak_memory(cpu)
    assert bench.peak_memory_gib(cpu) < after - 0.2  # the reset starts a new high-water mark


def test_bench_batch_writes_l_at_b_entries(pair, tmp_path, monkeypatch) -> None:
    """--batch: every strategy at every batch size, plain@1 the reference; greedy identity prompt by prompt."""
    prompts = [Prompt(f"p/{i}", "mtbench", "writing", TEXTS[i % len(TEXTS)], True) for i in range(3)]
    monkeypatch.setattr(bench.prompt_sets, "load", lambda sets, limit: prompts[:limit])
    args = bench_config("--strategies", "chain:k=2,plain,ngram,hf-assisted", "--limit", "3", "--max-new-tokens", "10",
                        "--batch", "2,3", "--rounds", "2", "--out", str(tmp_path))
    summary = bench.run(args, lambda: pair)
    peak = summary.pop("_peak_memory_gib")  # the run's, loading included
    assert peak is None or peak > 0.01
    assert set(summary) == {f"{s}@{b}" for s in ("plain", "chain:k=2", "ngram") for b in (1, 2, 3)}  # no peer
    for key, s in summary.items():
        assert s["greedy_identical"] == 1.0 and s["n_prompts"] == 3 and s["new_tokens"] == 30, key
        assert s["rounds"] == 2 and s["tokens_per_s_min"] <= s["tokens_per_s"] <= s["tokens_per_s_max"], key
        assert s["speedup_min"] <= s["speedup"] <= s["speedup_max"] and s["vs_plain_min"] <= s["vs_plain"], key
    assert summary["plain@1"]["speedup"] == pytest.approx(1.0) and summary["plain@3"]["plain_steps"] == 1.0
    assert summary["plain@2"]["vs_plain_min"] == summary["plain@2"]["vs_plain_max"] == pytest.approx(1.0)
    assert 1 <= summary["chain:k=2@3"]["tau"] <= 3 and summary["chain:k=2@3"]["mean_tree_size"] == 2
    records = [json.loads(line) for line in (tmp_path / "records.jsonl").read_text().splitlines()]
    assert len(records) == 2 * 3 * 3 * 3 and {r["group_size"] for r in records if r["batch"] == 2} == {1, 2}
    assert {r["round"] for r in records} == {0, 1}
    assert "| chain:k=2@3 |" in (tmp_path / "table.md").read_text()


def test_a_draft_with_joined_projections_is_not_the_model_as_given(pair, monkeypatch) -> None:
    """Joined without packing (a lean draft where nothing packs, e.g. on a GPU): the peers load it again too."""
    import copy

    from speculor.bench import peers
    from speculor.runtime.lean import fuse_projections
    from speculor.runtime.model import Model

    joined = copy.deepcopy(pair.draft.model)
    fuse_projections(joined)
    loaded = []
    monkeypatch.setattr(peers, "load_model", lambda spec, **kw: (loaded.append(spec), (pair.draft.model, None))[1])
    assert peers._model_as_given(Model(joined), "the-draft") is pair.draft.model and loaded == ["the-draft"]
    assert peers._model_as_given(pair.draft, "the-draft") is pair.draft.model and loaded == ["the-draft"]


def test_peers_run_the_models_as_given_after_packing(pair, tmp_path, monkeypatch) -> None:
    """A pair loaded with the fast kernels holds no fp32 Linear weights: the transformers peers load the untouched
    models from disk for their call (same tokens as on the stock pair) and free them after it."""
    import gc
    import weakref

    from speculor.bench import peers
    from speculor.config import SamplingConfig
    from speculor.runtime.kernels import can_pack, is_packed
    from speculor.runtime.loading import load_pair

    if not can_pack(pair.target.model):
        pytest.skip("needs oneDNN")
    for name, lm in (("target", pair.target), ("draft", pair.draft)):
        lm.model.save_pretrained(tmp_path / name)
        pair.tokenizer.save_pretrained(tmp_path / name)
    packed = load_pair(str(tmp_path / "target"), str(tmp_path / "draft"), backend="torch")
    assert is_packed(packed.target.model) and is_packed(packed.draft.model)
    target, draft = peers.models_as_given(packed, with_draft=True)
    assert not is_packed(target) and not is_packed(draft)
    for given, original in ((target, pair.target.model), (draft, pair.draft.model)):
        want = original.state_dict()
        assert all(torch.equal(v, want[k]) for k, v in given.state_dict().items()) and len(want) > 10
    stock_target, _ = peers.models_as_given(pair, with_draft=False)
    assert stock_target is pair.target.model  # stock models are used as they are, not loaded again
    del target, draft, given, original, stock_target

    loaded = []
    load = peers.load_model

    def spy(*args, **kwargs):
        model, tok = load(*args, **kwargs)
        loaded.append(weakref.ref(model))
        return model, tok

    monkeypatch.setattr(peers, "load_model", spy)
    cfg, eos = SamplingConfig(max_new_tokens=8, stop_on_eos=False), frozenset({pair.tokenizer.eos_token_id})
    for name in ("hf-assisted", "hf-prompt-lookup"):
        ids = pair.tokenizer.encode(TEXTS[0])
        want, _ = peers.hf_generate(pair, name, ids, cfg, eos)
        got, _ = peers.hf_generate(packed, name, ids, cfg, eos)
        assert got == want and len(got) == 8
    gc.collect()
    assert len(loaded) == 3 and all(ref() is None for ref in loaded)  # target + draft, then target: all freed


def test_quick_keeps_only_the_peers_that_run_beside_the_pair(pair, tmp_path, monkeypatch, capsys) -> None:
    """--quick's own list (fit_peers): llama.cpp's peer needs a GGUF target, transformers' peers a pair on torch;
    what is left out is said. Strategies given explicitly are kept as given."""
    from dataclasses import replace
    from types import SimpleNamespace

    from speculor.bench import peers
    from speculor.runtime.embedded import DEFAULT_TARGET
    from speculor.runtime.llama.model import available

    monkeypatch.setattr(bench.prompt_sets, "load", lambda sets, limit: [Prompt("p", "mtbench", "w", TEXTS[0], True)])
    monkeypatch.setenv("SPECULOR_CACHE", str(tmp_path / "cache"))
    assert bench_config("--quick").fit_peers and not bench_config("--quick", "--strategies", "plain").fit_peers
    args = replace(bench_config("--strategies", "plain,llama.cpp,hf-prompt-lookup", "--limit", "1",
                                "--max-new-tokens", "4", "--rounds", "1"), fit_peers=True)
    summary = bench.run(args, lambda: pair)  # a tiny torch pair from no GGUF file
    assert list(summary) == ["plain", "hf-prompt-lookup"]
    assert "peers left out on torch: llama.cpp (the target is not a GGUF file)" in capsys.readouterr().out
    on_llama = SimpleNamespace(backend="llama.cpp", target_name=DEFAULT_TARGET)  # the embedded GGUF target
    assert "transformers" in peers.unfit(on_llama, "hf-assisted")
    assert peers.unfit(on_llama, "llama.cpp") == ("" if available() else "llama-cpp-python is not installed")
    assert peers.unfit(SimpleNamespace(backend="torch", target_name="/m/t.gguf"), "hf-assisted") == ""


@pytest.mark.parametrize("batch", [None, "2"])
def test_every_round_starts_without_the_answers_of_the_last(pair, tmp_path, monkeypatch, batch) -> None:
    """suffix's shared trie would otherwise hand round 2 round 1's answers to copy: greedy rounds must draft and
    accept alike, prompt by prompt (what a fresh server would do); within a round the trie fills as it does live."""
    prompts = [Prompt(f"p/{i}", "mtbench", "writing", TEXTS[i % len(TEXTS)], True) for i in range(2)]
    monkeypatch.setattr(bench.prompt_sets, "load", lambda sets, limit: prompts[:limit])
    extra = ("--batch", batch) if batch else ()
    args = bench_config("--strategies", "plain,suffix:budget=8", "--limit", "2", "--max-new-tokens", "16",
                        "--rounds", "2", "--out", str(tmp_path), *extra)
    bench.run(args, lambda: pair)
    records = [json.loads(line) for line in (tmp_path / "records.jsonl").read_text().splitlines()]
    mine = [r for r in records if r["strategy"] == "suffix:budget=8" and r.get("batch", 2) == 2]
    by = {(r["prompt_id"], r["round"]): r["accepted"] for r in mine}
    assert len(by) == 4 and all(by[p, 0] == by[p, 1] for p in ("p/0", "p/1")), by


def test_repeated_work_keeps_a_functions_edits_in_a_row(monkeypatch) -> None:
    from speculor.bench import prompts

    rows = [{"task_id": f"HumanEval/{i}", "prompt": f"def f{i}(x):\n", "canonical_solution": "    return x\n"}
            for i in range(3)]
    monkeypatch.setattr(prompts, "_humaneval_rows", lambda: rows)
    got = prompts.load(["repeat-edit"], 5)
    assert [p.id for p in got] == [f"repeat-edit/HumanEval/{i}/{j}" for i in range(2) for j in range(3)][:5]
    assert all(p.chat and "def f0(x):\n    return x\n" in p.text for p in got[:3])
    assert len({p.text.split("\n")[0] for p in got[:3]}) == len(prompts.EDITS)  # each edit once per function


def test_a_jsonl_file_is_a_prompt_set(tmp_path, capsys) -> None:
    """MT-Bench's / Spec-Bench's question format and {"prompt": ...} lines, spread over their categories."""
    import re

    from speculor import cli
    from speculor.bench import prompts
    from speculor.errors import SpeculorError

    f = tmp_path / "mine.jsonl"
    rows = [{"question_id": 81, "category": "writing", "turns": ["Write a poem.", "Shorter."]},
            {"question_id": 82, "category": "writing", "turns": ["Write a letter."]},
            {"question_id": 91, "category": "math", "turns": ["What is 2 + 2?"]},
            {"prompt": "def f(x):\n", "chat": False, "id": "code"}]
    f.write_text("\n".join(json.dumps(r) for r in rows) + "\n\n")
    got = prompts.load([str(f)], None)
    assert [(p.id, p.set, p.category, p.text, p.chat) for p in got] == [
        ("mine/81", "mine", "writing", "Write a poem.", True), ("mine/91", "mine", "math", "What is 2 + 2?", True),
        ("mine/code", "mine", "mine", "def f(x):\n", False), ("mine/82", "mine", "writing", "Write a letter.", True)]
    bad = {"not JSON": "{", "a JSON object": "[1]", 'needs "turns"': '{"turns": []}',
           'not both': '{"turns": ["a"], "prompt": "b"}', '"chat" must be': '{"prompt": "a", "chat": "no"}',
           '(a string), not empty': '{"prompt": "  "}'}
    for why, text in bad.items():
        f.write_text('{"prompt": "fine"}\n' + text)
        with pytest.raises(SpeculorError, match=re.escape(why)):
            prompts.load([str(f)], None)
    f.write_text("\n")
    with pytest.raises(SpeculorError, match="holds no prompts"):
        prompts.load([str(f)], None)
    with pytest.raises(SpeculorError, match="cannot be read"):
        prompts.load([str(tmp_path / "missing.jsonl")], None)
    assert cli.main(["bench", "--sets", str(f)]) == 2  # refused before any model is loaded
    assert "holds no prompts" in capsys.readouterr().err


def test_acceptance_by_match_length() -> None:
    from speculor.bench.summary import acceptance_by_match

    rows = [{"match": [0, 1, 2, 6, None], "drafted": [3, 2, 4, 8, 0], "accepted": [3, 0, 2, 8, 0]},
            {"match": [12, 1], "drafted": [10, 2], "accepted": [5, 2]}, {"drafted": [1], "accepted": [1]}]
    got = acceptance_by_match(rows)
    assert list(got) == ["1", "2", "5-8", "9+"]  # the step of match 0 drafted through a fallback: not counted
    assert got["1"] == {"steps": 2, "drafted": 2.0, "accepted": 1.0, "accepted_share": 0.5}
    assert got["9+"]["accepted_share"] == 0.5 and got["5-8"]["accepted"] == 8.0
    assert acceptance_by_match([{"drafted": [1], "accepted": [1]}]) == {}
