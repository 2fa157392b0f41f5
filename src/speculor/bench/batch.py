"""`speculor bench --batch 1,4,16`: each strategy with B prompts decoded together (engine/batch.py).

For every batch size B and strategy label L, the prompts are decoded in consecutive groups of B (each request with
its own drafter and seed); a group's wall time runs from the first prefill to the last token. The strategies take
turns group by group, the one that goes first rotating from group to group: run strategy after strategy, a host
whose memory bandwidth drifts over the run favours whichever runs first (docs/bench/README.md, "Batched runs
interleaved"). With `--rounds R` the whole run repeats R times, the
rotation moving on by one each round. The summary entry "L@B" holds the aggregate tokens/s of each round (all
tokens ÷ all group wall time) and their median and min-max spread; the speedup over `plain@1` and the ratio to
`plain@B` of the same round (median and spread over rounds); the decode-only speedup (prefills taken out); greedy
identity with `plain@1`'s first round, prompt by prompt and round by round; τ, the mean tree size and the share of
request-steps that drafted nothing (the batch-aware budget decoding plainly), pooled over rounds.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

from tqdm import tqdm

from speculor.api import Speculor
from speculor.bench.config import BenchConfig
from speculor.bench.prompts import Prompt
from speculor.bench.specs import Spec
from speculor.bench.summary import by_round, cell, spread, with_spread
from speculor.config import SamplingConfig
from speculor.engine import Stats
from speculor.engine.batch import generate


def run_batched(sp: Speculor, specs: list[Spec], prompts: list[Prompt], encoded: list[list[int]],
                sizes: list[int], cfg_of, rounds: int = 1) -> list[dict[str, Any]]:
    """Records: one per (round, B, strategy, prompt) with its tokens and steps, plus the group's wall time."""
    records = []
    bar = tqdm(total=rounds * len(sizes) * len(specs) * len(prompts), desc="bench --batch", unit="request")
    shared = {spec.label: sp.strategy_for(spec.name, **spec.options) for spec in specs}
    for rnd in range(rounds):
        for b in sizes:
            sp.forget()  # each round and batch size starts as a fresh server: no earlier answers remembered
            for g in range(0, len(prompts), b):
                k = (g // b + rnd) % len(specs)
                idx = list(range(g, min(g + b, len(prompts))))
                for spec in specs[k:] + specs[:k]:  # the strategies take turns group by group, first in turn
                    records += _group(sp, shared[spec.label], [encoded[i] for i in idx], [cfg_of(i) for i in idx],
                                      [prompts[i] for i in idx], {"strategy": spec.label, "batch": b,
                                                                  "group": g // b, "round": rnd})
                    bar.update(len(idx))
    bar.close()
    return records


def _group(sp: Speculor, strategy, encoded: list[list[int]], cfgs: list[SamplingConfig], prompts: list[Prompt],
           tags: dict[str, Any]) -> list[dict[str, Any]]:
    """Decode one group together (each request with its own drafter and seed): a record per prompt."""
    entries = [(strategy.drafter() if strategy is not None else None, e, c) for e, c in zip(encoded, cfgs, strict=True)]
    stats = [Stats() for _ in encoded]
    out: list[list[int]] = [[] for _ in encoded]
    t0 = time.perf_counter()
    for j, toks in generate(sp.pair.target, entries, sp.eos_ids, stats):
        out[j].extend(t.id for t in toks)
    wall = time.perf_counter() - t0
    return [{**tags, "group_size": len(encoded), "group_wall_s": wall, "prompt_id": p.id, "category": p.category,
             "token_ids": toks, "new_tokens": len(toks), "prefill_s": st.prefill_s,
             "accepted": [s.accepted for s in st.steps], "drafted": [s.drafted for s in st.steps]}
            for p, toks, st in zip(prompts, out, stats, strict=True)]


def summarize_batched(records: list[dict[str, Any]], greedy: bool) -> dict[str, Any]:
    """Per "L@B": tokens/s, speedup over plain@1 and ratio to plain@B (median and spread over rounds), greedy
    identity with plain@1."""
    groups: dict[str, list[dict[str, Any]]] = {}
    for r in records:
        groups.setdefault(f"{r['strategy']}@{r['batch']}", []).append(r)
    ref: dict[str, list[int]] = {}
    for r in groups.get("plain@1", []):
        ref.setdefault(r["prompt_id"], r["token_ids"])  # its first round's
    base = {rnd: _rates(rows) for rnd, rows in by_round(groups.get("plain@1", [])).items()}
    out = {}
    for key, rows in groups.items():
        per_round = {rnd: _rates(rs) for rnd, rs in by_round(rows).items()}
        plain_b = {rnd: _rates(rs) for rnd, rs in by_round(groups.get(f"plain@{rows[0]['batch']}", [])).items()}
        steps = [a for r in rows for a in r["accepted"]]
        drafted = [d for r in rows for d in r["drafted"]]
        out[key] = {"strategy": rows[0]["strategy"], "batch": rows[0]["batch"], "rounds": len(per_round),
                    "n_prompts": len({r["prompt_id"] for r in rows}),
                    "new_tokens": sum(r["new_tokens"] for r in rows) // len(per_round),
                    **spread("tokens_per_s", [tps for tps, _ in per_round.values()]),
                    **spread("speedup", _ratios(per_round, base, 0)),
                    **spread("vs_plain", _ratios(per_round, plain_b, 0)),
                    "decode_tokens_per_s": statistics.median(d for _, d in per_round.values()),
                    **spread("decode_speedup", _ratios(per_round, base, 1)),
                    "greedy_identical": (sum(r["token_ids"] == ref.get(r["prompt_id"]) for r in rows) / len(rows)
                                         if greedy and ref else None),
                    "tau": sum(a + 1 for a in steps) / len(steps) if steps else None,
                    "mean_tree_size": statistics.mean(drafted) if drafted else None,
                    "plain_steps": sum(d == 0 for d in drafted) / len(drafted) if drafted else None}
    return out


def _ratios(mine: dict[int, tuple[float, float]], ref: dict[int, tuple[float, float]], k: int) -> list[float]:
    """Per round where both ran: rate k of `mine` ÷ rate k of `ref` (k = 0 end to end, 1 decode only)."""
    return [mine[r][k] / ref[r][k] for r in mine if r in ref and ref[r][k] > 0]


def _rates(rows: list[dict[str, Any]]) -> tuple[float, float]:
    """(tokens/s, decode-only tokens/s) over whole groups: every group's wall counted once, its prefills removed."""
    walls = {(r["group"], r["group_wall_s"]) for r in rows}
    wall = sum(w for _, w in walls)
    prefill = sum(r["prefill_s"] for r in rows)
    tokens = sum(r["new_tokens"] for r in rows)
    return (tokens / wall if wall else 0.0, tokens / (wall - prefill) if wall > prefill else 0.0)


def format_batched(summary: dict[str, Any]) -> str:
    lines = ["| strategy @ batch | tokens/s | speedup vs plain@1 | vs plain@B | decode speedup | greedy identical "
             "| tau | tree | plain steps |", "|" + "---|" * 9]
    entries = {k: v for k, v in summary.items() if not k.startswith("_")}  # "_peak_memory_gib": the run's
    for key, a in sorted(entries.items(), key=lambda kv: (kv[1]["batch"], kv[0])):
        ident = "-" if a["greedy_identical"] is None else f"{a['greedy_identical']:.0%}"
        lines.append(f"| {key} | {a['tokens_per_s']:.2f} | {with_spread(a, 'speedup')} "
                     f"| {with_spread(a, 'vs_plain')} | {cell(a, 'decode_speedup', unit='x')} | {ident} "
                     f"| {cell(a, 'tau')} | {cell(a, 'mean_tree_size', '.1f')} | {cell(a, 'plain_steps', '.0%')} |")
    return "\n".join(lines)


def sampling(cfg: BenchConfig):
    """cfg_of(i) for prompt i at the run's first temperature (the batch mode measures one temperature)."""
    temp = cfg.temperatures[0]

    def cfg_of(i: int) -> SamplingConfig:
        return SamplingConfig(temperature=temp, top_p=cfg.top_p if temp > 0 else 1.0, seed=cfg.seed + i,
                              max_new_tokens=cfg.max_new_tokens)
    return cfg_of, temp == 0
