"""Can a bench run be trusted? Rounds with shuffled order and spread, the plausibility warnings (each with a case it
must catch and a quiet case it must not flag), the other processes' CPU as the machine reports it, and Spec-Bench's
answer files read back the way Spec-Bench's evaluation/speed.py reads them."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from support.bench import bench_config
from support.server import TEXTS, tiny_pair

from speculor.bench import machine
from speculor.bench import run as bench
from speculor.bench.checks import check, predicted_speedup, start_warnings, timed_note
from speculor.bench.prompts import Prompt
from speculor.bench.summary import summarize
from speculor.runtime.call_times import CallTimes
from speculor.runtime.cost import CostModel

# t_target: 1.0 s for one row, 1.2 for 2-4, 1.5 for 8; t_draft 0.1 s a row-block
COST = CostModel((1, 2, 4, 8), (1.0, 1.2, 1.2, 1.5), (1, 2, 4, 8), (0.1, 0.12, 0.15, 0.2))


def _rec(label: str, pid: str, rnd: int, wall: float, accepted: list[int] | None, drafted: int = 0,
         forwards: int = 0, **kw) -> dict:
    """A synthetic record: `len(accepted) + sum(accepted)` new tokens (plain: accepted all 0)."""
    steps = accepted if accepted is not None else None
    tokens = sum(a + 1 for a in steps) if steps is not None else kw.pop("tokens")
    rec = {"strategy": label, "prompt_id": pid, "round": rnd, "temperature": 0.0, "category": "c", "wall_s": wall,
           "new_tokens": tokens, "token_ids": [1] * tokens, "greedy_identical": True, "others_cores": 0.0,
           "prefill_s": 0.0, "peak_memory_gib": 1.0}
    if steps is not None:
        rec |= {"accepted": steps, "drafted": [drafted] * len(steps), "forwards": [forwards] * len(steps),
                "draft_forwards": forwards * len(steps), "draft_s": 0.0, "verify_s": wall, "overhead_s": 0.0}
    return rec | kw


def _quiet_run(plain_slow_round: int | None = None, busy: tuple | None = None) -> list[dict]:
    """Each as the cost model says, over 3 rounds and 2 prompts: plain 10 one-token steps at t_target(1) = 1 s;
    chain:k=3 (3 forwards of one row, one token accepted a step, τ 2) 5 steps of t_target(4) + 3 t_draft(1) = 1.5 s;
    ngram (one node, no draft forward, never accepted, τ 1) 10 steps of t_target(2) = 1.2 s."""
    recs = []
    for rnd in range(3):
        for pid in ("p1", "p2"):
            slow = 1.4 if rnd == plain_slow_round else 1.0
            recs.append(_rec("plain", pid, rnd, 10.0 * slow, [0] * 10))
            recs.append(_rec("chain:k=3", pid, rnd, 5 * 1.5, [1] * 5, drafted=3, forwards=3))
            recs.append(_rec("ngram", pid, rnd, 10 * 1.2, [0] * 10, drafted=1))
    if busy:
        label, pid, rnd = busy
        next(r for r in recs if (r["strategy"], r["prompt_id"], r["round"]) == busy)["others_cores"] = 0.9
    return recs


def _summary(recs: list[dict]) -> tuple[dict, list[str]]:
    summary = summarize(recs, ["plain", "chain:k=3", "ngram"], [0.0])
    return summary, check(summary, recs, [0.0], COST)


def test_a_quiet_run_has_no_warning_and_matches_the_cost_model() -> None:
    summary, warnings = _summary(_quiet_run())
    assert warnings == []
    chain = summary["chain:k=3"]
    assert chain["speedup"] == pytest.approx(10 / 7.5) and chain["speedup_min"] == chain["speedup_max"]
    assert chain["predicted_speedup"] == pytest.approx(10 / 7.5) and chain["model_check"] == "ok"
    assert summary["ngram"]["predicted_speedup"] == pytest.approx(1 / 1.2) and summary["plain"]["warnings"] == []
    assert summary["plain"]["predicted_speedup"] is None


def test_the_timed_calls_are_noted_beside_the_profile() -> None:
    calls = CallTimes(3)
    assert timed_note(None, None) is None and timed_note(calls, None) is None  # nothing timed: no note
    for _ in range(CallTimes.SEEN):
        calls.add(1, 0.05)
        calls.add(3, 0.12)
    profile = CostModel((1, 2, 3), (0.05, 0.075, 0.09), (1, 2, 3), (0.0, 0.0, 0.0))
    assert timed_note(calls, profile).endswith("t(3)/t(1) 2.40 (profile 1.80)")
    assert timed_note(calls, None).endswith("t(3)/t(1) 2.40")


def test_plain_measured_slow_in_one_round_is_named() -> None:
    """Plain 40% slower in round 2: plain's drift, ngram above its τ in that round, and the model gap called noisy."""
    summary, warnings = _summary(_quiet_run(plain_slow_round=1))
    drift = summary["plain"]["warnings"]
    assert len(drift) == 1 and "40%" in drift[0] and "p1 40%" in drift[0] and "round 2" in drift[0]
    above = [w for w in summary["ngram"]["warnings"] if "above its bound" in w]
    assert len(above) == 1 and "round 2" in above[0] and "p1, p2" in above[0]
    chain = summary["chain:k=3"]
    assert chain["speedup_max"] == pytest.approx(14 / 7.5) and chain["speedup"] == pytest.approx(10 / 7.5)
    assert not any("above its bound" in w for w in chain["warnings"])  # 1.75 < τ 2
    assert set(warnings) == set(drift + summary["ngram"]["warnings"] + chain["warnings"])


def test_other_processes_during_a_generation_are_named() -> None:
    summary, warnings = _summary(_quiet_run(busy=("plain", "p2", 2)))
    assert len(warnings) == 1 and "plain" in warnings[0] and "round 3: p2" in warnings[0] and "0.90" in warnings[0]
    assert start_warnings({"others_cores": 0.8, "cores": 2, "load_avg_1m": 1.1})
    assert start_warnings({"others_cores": 0.05, "cores": 2, "load_avg_1m": 0.1}) == []


def test_a_gap_to_the_cost_model_without_noise_is_called_a_gap() -> None:
    """chain 30% slower than the model's cost of its steps (say, an overhead the code should not have)."""
    recs = _quiet_run()
    for r in recs:
        if r["strategy"] == "chain:k=3":
            r["wall_s"] *= 1.3
    summary, warnings = _summary(recs)
    assert summary["chain:k=3"]["model_check"] == "gap" and len(warnings) == 1 and "-23%" in warnings[0]


def test_predicted_speedup_counts_prefill_and_draft_rows() -> None:
    plain = [_rec("plain", "p", 0, 1.0, [0] * 4, prefill_s=2.0)]
    tree = [_rec("t", "p", 0, 1.0, [3], drafted=7, forwards=2, prefill_s=2.0)]  # 2 forwards of 4 rows
    # plain: 2 + 4 * 1.0 = 6 s for 4 tokens; tree: 2 + 1.5 + 2 * 0.15 = 3.8 s for 4 tokens
    assert predicted_speedup(tree, plain, COST) == pytest.approx(6 / 3.8)
    assert predicted_speedup([_rec("hf", "p", 0, 1.0, None, tokens=4)], plain, COST) is None


def _cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / machine.TICK  # utime, stime


def test_other_processes_cpu_is_seen() -> None:
    """A CPU-bound process beside us is counted at least at the CPU it got (whatever else runs meanwhile); our own
    CPU is not counted."""
    if machine.snapshot().busy is None:
        pytest.skip("no /proc/stat here")
    hog = subprocess.Popen([sys.executable, "-c", "import time\nt = time.time()\nwhile time.time() - t < 4: pass"])
    try:
        time.sleep(0.5)
        before, hog0 = machine.snapshot(), _cpu_s(hog.pid)
        time.sleep(1.5)
        after, hog1 = machine.snapshot(), _cpu_s(hog.pid)
    finally:
        hog.kill()
        hog.wait()
    share = (hog1 - hog0) / (after.wall - before.wall)
    assert share > 0.2, "the machine is too busy to give the test process any CPU"
    assert machine.others_cores(before, after) >= share - 0.1
    own0 = machine.snapshot()
    while time.perf_counter() - own0.wall < 1.2:  # our own spin
        pass
    own1 = machine.snapshot()
    assert own1.own - own0.own > 0.5 and machine.others_cores(own0, own1) <= (own1.busy - own0.busy) - 0.5 + 0.05
    assert machine.others_cores(own0, own0) is None  # too short to tell


@pytest.fixture(scope="module")
def pair():
    return tiny_pair()


def test_rounds_shuffle_the_order_and_spec_bench_reads_the_files(pair, tmp_path, monkeypatch) -> None:
    prompts = [Prompt(f"q{i}", "mtbench", "writing", TEXTS[i], True) for i in range(3)]
    monkeypatch.setattr(bench.prompt_sets, "load", lambda sets, limit: prompts[:limit])
    monkeypatch.setenv("SPECULOR_CACHE", str(tmp_path / "cache"))
    args = bench_config("--strategies", "plain,chain:k=2,ngram", "--limit", "3", "--max-new-tokens", "10",
                        "--rounds", "3", "--format", "spec-bench", "--out", str(tmp_path))
    summary = bench.run(args, lambda: pair)
    records = [json.loads(line) for line in (tmp_path / "records.jsonl").read_text().splitlines()]
    assert len(records) == 3 * 3 * 3
    firsts = {r["strategy"] for r in records if r["position"] == 0}
    assert len(firsts) >= 2  # no strategy always runs first (seeded: this seed gives several)
    for label, s in summary.items():
        assert s["rounds"] == 3 and len(s["speedup_by_round"]) == 3 and s["greedy_identical"] == 1.0
        assert s["speedup_min"] <= s["speedup"] <= s["speedup_max"] and isinstance(s["warnings"], list), label
    assert summary["chain:k=2"]["predicted_speedup"] > 0 and summary["chain:k=2"]["model_check"] in {
        "ok", "noisy", "gap"}
    saved = json.loads((tmp_path / "summary.json").read_text())
    assert isinstance(saved["_warnings"], list) and "others_cores" in saved["_machine"]

    for rnd in range(3):
        folder = tmp_path / "spec-bench" / f"model_answer_temp0_run_{rnd + 1}"
        for label in ("chain_k_2", "ngram"):
            speed, speed0, ratio, accept = spec_bench_speed(folder / f"{label}.jsonl", folder / "plain.jsonl",
                                                            lambda text: pair.tokenizer(text))
            mine = [r for r in records if r["round"] == rnd and r["strategy"] == label.replace("_k_", ":k=")]
            assert speed == pytest.approx(np.mean([r["new_tokens"] / r["wall_s"] for r in mine]))
            steps = [a + 1 for r in mine for a in r["accepted"]]
            assert np.mean(accept) == pytest.approx(np.mean(steps)) and speed0 > 0 and ratio > 0
        # the baseline read as a method file gives our own token counts exactly
        plain = [r for r in records if r["round"] == rnd and r["strategy"] == "plain"]
        speed, *_ = spec_bench_speed(folder / "plain.jsonl", folder / "plain.jsonl", lambda t: pair.tokenizer(t))
        assert speed == pytest.approx(np.mean([r["new_tokens"] / r["wall_s"] for r in plain]))


def spec_bench_speed(jsonl_file: Path, jsonl_file_base: Path, tokenizer, task: str = "overall"):
    """The computation of Spec-Bench's evaluation/speed.py `speed()` (task "overall"), reading the files the same
    way: per question Σ new_tokens / Σ wall_time of choice 0; the baseline's tokens re-counted from its text."""
    data = [json.loads(line) for line in Path(jsonl_file).read_text().splitlines()]
    speeds, accept_lengths_list = [], []
    for datapoint in data:
        tokens = sum(datapoint["choices"][0]["new_tokens"])
        times = sum(datapoint["choices"][0]["wall_time"])
        accept_lengths_list.extend(datapoint["choices"][0]["accept_lengths"])
        speeds.append(tokens / times)
    data = [json.loads(line) for line in Path(jsonl_file_base).read_text().splitlines()]
    speeds0 = []
    for datapoint in data:
        tokens = sum(len(tokenizer(i).input_ids) - 1 for i in datapoint["choices"][0]["turns"])
        speeds0.append(tokens / sum(datapoint["choices"][0]["wall_time"]))
    return np.mean(speeds), np.mean(speeds0), np.mean(speeds) / np.mean(speeds0), accept_lengths_list


def test_the_tau_bound_allows_for_blocks_cheaper_than_one_row() -> None:
    """ngram (τ 1, one node a step) at 1.05x: impossible where t(2) >= t(1), possible where two rows cost 0.9 of one."""
    plain = [_rec("plain", "p", 0, 10.0, [0] * 10)]
    ngram = [_rec("ngram", "p", 0, 10 / 1.05, [0] * 10, drafted=1)]
    flat = CostModel((1, 2), (1.0, 0.9), (1, 2), (0.1, 0.1))
    for cost, flagged in ((COST, True), (flat, False)):
        summary = summarize(plain + ngram, ["plain", "ngram"], [0.0])
        warnings = check(summary, plain + ngram, [0.0], cost)
        assert any("above its bound" in w for w in warnings) == flagged


def test_one_prompt_moving_is_not_a_drift_of_the_rounds() -> None:
    """p1's plain 30% slower in one round, p2's 25% faster: the rounds' sums move under 10%, no warning."""
    recs = _quiet_run()
    for r in recs:
        if r["strategy"] == "plain" and r["round"] == 1:
            r["wall_s"] *= 1.3 if r["prompt_id"] == "p1" else 0.75
    summary, warnings = _summary(recs)
    assert summary["plain"]["warnings"] == []


def test_a_drift_of_decoding_alone_is_told_apart_from_one_of_the_whole_cpu() -> None:
    """Plain 40% slower in round 2: with its prompt prefill as fast as ever, the warning says memory bandwidth varied
    (decoding reads every weight per token, prefill is compute-bound); with the prefill as slow, it does not."""
    for prefill_slow, hinted in ((1.0, True), (1.4, False)):
        recs = _quiet_run(plain_slow_round=1)
        for r in recs:
            r["prefill_s"] = 0.5 * (prefill_slow if r["strategy"] == "plain" and r["round"] == 1 else 1.0)
        drift = _summary(recs)[0]["plain"]["warnings"]
        assert len(drift) == 1 and "40%" in drift[0]
        assert ("memory bandwidth" in drift[0] and "prefill moved only 0%" in drift[0]) == hinted


def test_the_table_divides_by_llama_cpps_plain_where_that_peer_ran() -> None:
    """`÷ llama.cpp plain` beside `÷ our plain`: same-round ratios to the llama.cpp peer's tokens/s; no column without
    that peer."""
    from speculor.bench.summary import format_table

    recs = [r for rnd in range(2) for r in (_rec("plain", "p", rnd, 10.0, [0] * 10, prefill_s=2.0),
                                            _rec("chain:k=3", "p", rnd, 4.0, [1] * 5, prefill_s=2.0),
                                            _rec("llama.cpp", "p", rnd, 8.0 if rnd else 5.0, None, tokens=10,
                                                 prefill_s=1.0))]
    summary = summarize(recs, ["plain", "chain:k=3", "llama.cpp"], [0.0])
    assert summary["plain"]["vs_llama_cpp"] == pytest.approx((0.5 + 0.8) / 2)  # median of the two rounds
    assert summary["chain:k=3"]["vs_llama_cpp_min"] == pytest.approx(1.25)  # 2.5 tokens/s ÷ round 0's 2.0
    assert summary["llama.cpp"]["vs_llama_cpp"] == pytest.approx(1.0)
    # decode alone: each side's prefill (the peer's time to its first token) out: 10/8 ÷ 10/4 and 10/7
    assert summary["plain"]["vs_llama_cpp_decode"] == pytest.approx((4 / 8 + 7 / 8) / 2)
    head, rule, *rows = format_table(summary).splitlines()
    assert "| ÷ our plain (min–max) | ÷ llama.cpp plain (decode) |" in head and rule.count("---") == 14
    assert all(row.count("|") == head.count("|") for row in rows)
    assert "| 2.50x (2.50–2.50) | 1.62x (2.75x) |" in rows[1]  # chain: 10/4 ÷ 10/5, 10/8; decode 10/2 ÷ 10/4, 10/7
    untimed = [r | {"prefill_s": None} if r["strategy"] == "llama.cpp" else r for r in recs]
    for r in untimed:
        if r["prefill_s"] is None:
            del r["prefill_s"]  # a peer that says no time to its first token: no decode ratio
    assert summarize(untimed, ["plain"], [0.0])["plain"]["vs_llama_cpp_decode"] is None
    assert "| 1.00x (1.00–1.00) | 0.65x |" in format_table(summarize(untimed, ["plain"], [0.0]))
    without = [r for r in recs if r["strategy"] != "llama.cpp"]
    head = format_table(summarize(without, ["plain", "chain:k=3"], [0.0])).splitlines()[0]
    assert "÷ llama.cpp" not in head and head.count("|") == 14


def test_host_time_per_step_is_tabulated_where_the_kernels_time_is_counted() -> None:
    """host ms/step = Σ host_s / Σ steps over a strategy's records, and its share of the wall time; '-' where a record
    has no host time (torch: its kernels' seconds are not counted)."""
    from speculor.bench.summary import format_table

    recs = [_rec("plain", "p", rnd, 10.0, [0] * 10, host_s=0.05 * (rnd + 1)) for rnd in range(2)]
    a = summarize(recs, ["plain"], [0.0])["plain"]["by_temperature"]["0.0"]
    assert a["host_ms_per_step"] == pytest.approx(1000 * 0.15 / 20) and a["host_share"] == pytest.approx(0.15 / 20)
    assert "| 7.50 (0.8%) |" in format_table(summarize(recs, ["plain"], [0.0]))
    recs[0]["host_s"] = None
    assert "host_ms_per_step" not in summarize(recs, ["plain"], [0.0])["plain"]["by_temperature"]["0.0"]
