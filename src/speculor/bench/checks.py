"""Is a bench run to be trusted? Plausibility warnings, and the speedup the cost model predicts beside the measured.

Warnings (each names the strategies, rounds and prompts it concerns):
- other processes kept more than DISTURBED_CORES cores busy when the run started, or during a generation;
- plain decoding's tokens/s moved more than PLAIN_DRIFT between rounds (the prompts that moved most are named, and
  whether its compute-bound prefill held steady meanwhile: then memory bandwidth varied, not our CPU share);
- a strategy's speedup above its τ in some round: every step costs at least one target forward, so speedup ≤ τ ·
  t_target(1) / min_n t_target(n) (the cost profile's cheapest block, n up to the strategy's largest tree + 1;
  where a block of a few rows costs no more than one row, the bound is τ itself) unless plain was measured slow;
- greedy outputs differing from plain decoding's (T = 0);
- the measured speedup outside BAND of the predicted one: "noisy" where one of the warnings above touches the
  strategy or plain, else "gap" (the model or the code is wrong).

The prediction (docs/algorithms.md §4.2's cost model): a generation takes its measured prompt prefill plus, per
step, t_target(n + 1) for a tree of n nodes and f draft forwards of ⌈n / f⌉ rows each, t_draft(⌈n / f⌉); plain
decoding takes its prefill plus t_target(1) per token. predicted speedup = (tokens / predicted time) ÷ (plain's
tokens / plain's predicted time), from the acceptance each strategy reached in this run.
"""

from __future__ import annotations

import math
from typing import Any

from speculor.bench.summary import by_round, tokens_per_s
from speculor.runtime.call_times import CallTimes
from speculor.runtime.cost import CostModel

DISTURBED_CORES = 0.25  # mean cores used by other processes during a measurement
PLAIN_DRIFT = 0.10  # max/min - 1 of plain's tokens/s between rounds
BAND = 0.15  # |measured / predicted - 1| the cost model is trusted to


def predicted_s(rec: dict[str, Any], cost: CostModel) -> float | None:
    """Seconds the cost model gives one generation (None for a peer: no steps recorded)."""
    if rec.get("drafted") is None:
        return None
    total = rec.get("prefill_s", 0.0)
    for n, f in zip(rec["drafted"], rec["forwards"], strict=True):
        total += cost.t_target(n + 1) + (f * cost.t_draft(math.ceil(n / f)) if f else 0.0)
    return total


def predicted_speedup(rows: list[dict[str, Any]], base: list[dict[str, Any]], cost: CostModel) -> float | None:
    mine, ref = [predicted_s(r, cost) for r in rows], [predicted_s(r, cost) for r in base]
    if not rows or not base or None in mine or None in ref:
        return None
    return (sum(r["new_tokens"] for r in rows) / sum(mine)) / (sum(r["new_tokens"] for r in base) / sum(ref))


def _names(rows: list[dict[str, Any]]) -> str:
    """'round 1: p1, p2; round 3: p4' for the records given."""
    return "; ".join(f"round {r + 1}: {', '.join(x['prompt_id'] for x in rs)}" for r, rs in by_round(rows).items())


def start_warnings(load: dict[str, Any]) -> list[str]:
    others = load.get("others_cores")
    if others is not None and others > DISTURBED_CORES:
        return [f"machine busy when the run started: other processes kept {others:.2f} of {load.get('cores')} cores "
                f"busy (1-minute load average {load.get('load_avg_1m')})"]
    return []


def timed_note(calls: CallTimes | None, profile: CostModel | None) -> str | None:
    """The target's calls as last timed (runtime/cost.py `CallTimes`: what ngram's and suffix's auto cuts priced rows
    by at the end of the run) beside the profile's ratios; None where nothing was timed."""
    timed = {k: r for k in (2, 3) if calls is not None and (r := calls.ratio(k)) is not None}
    if not timed:
        return None
    said = ", ".join(f"t({k})/t(1) {r:.2f}" + (f" (profile {profile.t_target(k) / profile.t_target(1):.2f})"
                                               if profile is not None else "") for k, r in timed.items())
    return f"the target's calls as last timed (moving averages; the model-free cuts price rows by them): {said}"


def check(summary: dict[str, Any], records: list[dict[str, Any]], temps: list[float],
          cost: CostModel | None) -> list[str]:
    """Adds `warnings`, `predicted_speedup` and `model_check` to every summary entry (each temperature);
    returns every warning of the run."""
    out: list[str] = []
    for temp in temps:
        key = str(temp)
        rows_of = {label: [r for r in records if r["strategy"] == label and r["temperature"] == temp]
                   for label in summary}
        base = rows_of.get("plain", [])
        noisy: set[str] = set()
        found: dict[str, list[str]] = {label: [] for label in summary}
        for label, rows in rows_of.items():
            busy = [r for r in rows if (r.get("others_cores") or 0.0) > DISTURBED_CORES]
            if busy:
                noisy.add(label)
                worst = max(r["others_cores"] for r in busy)
                found[label].append(f"{label} at T={temp}: other processes kept up to {worst:.2f} cores busy during "
                                    f"{len(busy)} of its {len(rows)} generations ({_names(busy)})")
        drift = _plain_drift(base, temp)
        if drift:
            noisy.add("plain")
            found.setdefault("plain", []).append(drift)
        for label, rows in rows_of.items():
            a = summary[label]["by_temperature"][key]
            if label != "plain" and a.get("tau") is not None:
                found[label] += _above_tau(label, temp, rows, base, a["tau"], _cheapest(rows, cost))
            if a.get("greedy_identical") is not None and a["greedy_identical"] < 1:
                bad = [r for r in rows if not r["greedy_identical"]]
                found[label].append(f"{label} at T=0: {len(bad)} outputs differ from plain decoding ({_names(bad)})")
            a["predicted_speedup"] = predicted_speedup(rows, base, cost) if cost and label != "plain" else None
            a["model_check"] = None
            if a["predicted_speedup"] and a.get("speedup"):
                gap = a["speedup"] / a["predicted_speedup"] - 1
                a["model_check"] = "ok" if abs(gap) <= BAND else ("noisy" if noisy & {label, "plain"} else "gap")
                if a["model_check"] != "ok":
                    found[label].append(f"{label} at T={temp}: measured speedup {a['speedup']:.2f}x is {gap:+.0%} off "
                                        f"the cost model's {a['predicted_speedup']:.2f}x (band ±{BAND:.0%}): "
                                        + ("a noisy run" if a["model_check"] == "noisy" else
                                           "the model or the code is wrong, or the cost profile is stale"))
        for label, msgs in found.items():
            summary[label]["by_temperature"][key]["warnings"] = msgs
            out += msgs
    for s in summary.values():  # the top-level fields mirror the first temperature's
        s.update(s["by_temperature"][str(temps[0])])
    return out


def _cheapest(rows: list[dict[str, Any]], cost: CostModel | None) -> float:
    """t_target(1) / min_n t_target(n) over the blocks the strategy sent (at least 1; 1 without a cost model)."""
    largest = max((n for r in rows for n in r.get("drafted") or [0]), default=0) + 1
    if cost is None:
        return 1.0
    return max(1.0, cost.t_target(1) / min(cost.t_target(n) for n in range(1, largest + 1)))


def _plain_drift(base: list[dict[str, Any]], temp: float) -> str | None:
    rounds = by_round(base)
    tps = {r: tokens_per_s(rs) for r, rs in rounds.items()}
    if len(tps) < 2 or min(tps.values()) <= 0:
        return None
    prompts = []
    for pid in sorted({r["prompt_id"] for r in base}):
        walls = [r["wall_s"] / max(r["new_tokens"], 1) for r in base if r["prompt_id"] == pid]
        if max(walls) / min(walls) - 1 > PLAIN_DRIFT:
            prompts.append(f"{pid} {max(walls) / min(walls) - 1:.0%}")
    drift = max(tps.values()) / min(tps.values()) - 1
    if drift <= PLAIN_DRIFT:  # single prompts move more (a few seconds each); the rounds' sums are what count
        return None
    per_round = ", ".join(f"round {r + 1} {v:.2f}" for r, v in tps.items())
    return (f"plain at T={temp}: tokens/s moved {drift:.0%} between rounds ({per_round})"
            + (f"; prompts moving more than {PLAIN_DRIFT:.0%}: {', '.join(prompts)}" if prompts else "")
            + _bandwidth_hint(rounds, drift))


def _bandwidth_hint(rounds: dict[int, list[dict[str, Any]]], drift: float) -> str:
    """Where plain's prompt prefill (compute-bound: many rows a matmul) held steady while its decoding (memory-bound:
    every weight read per token) moved, the CPU was ours and the memory bandwidth was not: something outside this
    machine's process list, e.g. another tenant of the host, which /proc/stat cannot see."""
    prefill = [sum(r.get("prefill_s") or 0.0 for r in rs) for rs in rounds.values()]
    if min(prefill) <= 0 or max(prefill) / min(prefill) - 1 > drift / 2:
        return ""
    return (f"; its compute-bound prompt prefill moved only {max(prefill) / min(prefill) - 1:.0%}: the memory "
            f"bandwidth decoding needs varied, not this process's CPU (another tenant of the host?)")


def _above_tau(label: str, temp: float, rows: list[dict[str, Any]], base: list[dict[str, Any]],
               tau: float, factor: float) -> list[str]:
    """Rounds (and their prompts) whose speedup exceeds τ · factor (the cheapest-block factor, `_cheapest`)."""
    bound = tau * factor
    mine, ref = by_round(rows), by_round(base)
    hits = []
    for r, rs in mine.items():
        b = tokens_per_s(ref.get(r, []))
        if b <= 0:
            continue
        speedup = tokens_per_s(rs) / b
        if speedup <= bound:
            continue
        prompts = []
        for rec in rs:
            plain = [x for x in ref[r] if x["prompt_id"] == rec["prompt_id"]]
            ptau = sum(a + 1 for a in rec["accepted"]) / max(len(rec["accepted"]), 1)
            if plain and tokens_per_s([rec]) / max(tokens_per_s(plain), 1e-12) > ptau * factor:
                prompts.append(rec["prompt_id"])
        hits.append(f"{label} at T={temp}: speedup {speedup:.2f}x above its bound {bound:.2f} (τ {tau:.2f}) in round "
                    f"{r + 1} (plain measured slow){'; prompts: ' + ', '.join(prompts) if prompts else ''}")
    return hits
