"""`speculor bench --batch 1,4,16`: each strategy with B prompts decoded together (engine/batch.py).

For every batch size B and strategy label L, the prompts are decoded in consecutive groups of B (each request with
its own drafter and seed); a group's wall time runs from the first prefill to the last token. The strategies take
turns group by group, the one that goes first rotating from group to group: run strategy after strategy, a host
whose memory bandwidth drifted over the run favoured whichever ran first (at B = 4, one group's plain decoding
ran at 12-20 tokens/s within a run, and a strategy run third came out 15% below plain while decoding exactly as
plain decoding does; interleaved, the two were level). The summary entry
"L@B" holds the aggregate tokens/s (all tokens ÷ all group wall time), the speedup over `plain@1` of the same run,
the decode-only figures (prefills taken out), greedy identity with `plain@1` prompt by prompt, τ, the mean tree
size and the share of request-steps that drafted nothing (the batch-aware budget decoding plainly).
"""

from __future__ import annotations

import statistics
import time
from typing import Any

from tqdm import tqdm

from speculor.api import Speculor
from speculor.bench.prompts import Prompt
from speculor.bench.run import Spec
from speculor.bench.summary import cell
from speculor.config import SamplingConfig
from speculor.engine import Stats
from speculor.engine.batch import generate


def run_batched(sp: Speculor, specs: list[Spec], prompts: list[Prompt], encoded: list[list[int]],
                sizes: list[int], cfg_of) -> list[dict[str, Any]]:
    """Records: one per (B, strategy, prompt) with its tokens and steps, plus the group's wall time."""
    records = []
    bar = tqdm(total=len(sizes) * len(specs) * len(prompts), desc="bench --batch", unit="request")
    shared = {spec.label: sp.strategy_for(spec.name, **spec.options) for spec in specs}
    for b in sizes:
        for g in range(0, len(prompts), b):
            k = (g // b) % len(specs)
            for spec in specs[k:] + specs[:k]:  # the strategies take turns group by group, first in turn
                shared_s = shared[spec.label]
                idx = list(range(g, min(g + b, len(prompts))))
                entries = [(shared_s.drafter() if shared_s is not None else None, encoded[i], cfg_of(i))
                           for i in idx]
                stats = [Stats() for _ in idx]
                out: list[list[int]] = [[] for _ in idx]
                t0 = time.perf_counter()
                for j, toks in generate(sp.pair.target, entries, sp.eos_ids, stats):
                    out[j].extend(t.id for t in toks)
                wall = time.perf_counter() - t0
                for j, i in enumerate(idx):
                    steps = stats[j].steps
                    records.append({"strategy": spec.label, "batch": b, "group": g // b, "group_size": len(idx),
                                    "group_wall_s": wall, "prompt_id": prompts[i].id, "category": prompts[i].category,
                                    "token_ids": out[j], "new_tokens": len(out[j]), "prefill_s": stats[j].prefill_s,
                                    "accepted": [s.accepted for s in steps], "drafted": [s.drafted for s in steps]})
                bar.update(len(idx))
    bar.close()
    return records


def summarize_batched(records: list[dict[str, Any]], greedy: bool) -> dict[str, Any]:
    """Per "L@B": aggregate tokens/s, speedup over plain@1, decode-only speedup, greedy identity with plain@1."""
    groups: dict[str, list[dict[str, Any]]] = {}
    for r in records:
        groups.setdefault(f"{r['strategy']}@{r['batch']}", []).append(r)
    ref = {r["prompt_id"]: r["token_ids"] for r in groups.get("plain@1", [])}
    base = _rates(groups.get("plain@1", []))
    out = {}
    for key, rows in groups.items():
        tps, decode_tps = _rates(rows)
        steps = [a for r in rows for a in r["accepted"]]
        drafted = [d for r in rows for d in r["drafted"]]
        out[key] = {"strategy": rows[0]["strategy"], "batch": rows[0]["batch"], "n_prompts": len(rows),
                    "new_tokens": sum(r["new_tokens"] for r in rows), "tokens_per_s": tps,
                    "speedup": tps / base[0] if base[0] else None,
                    "decode_tokens_per_s": decode_tps, "decode_speedup": decode_tps / base[1] if base[1] else None,
                    "greedy_identical": (sum(r["token_ids"] == ref.get(r["prompt_id"]) for r in rows) / len(rows)
                                         if greedy and ref else None),
                    "tau": sum(a + 1 for a in steps) / len(steps) if steps else None,
                    "mean_tree_size": statistics.mean(drafted) if drafted else None,
                    "plain_steps": sum(d == 0 for d in drafted) / len(drafted) if drafted else None}
    return out


def _rates(rows: list[dict[str, Any]]) -> tuple[float, float]:
    """(tokens/s, decode-only tokens/s) over whole groups: every group's wall counted once, its prefills removed."""
    walls = {(r["group"], r["group_wall_s"]) for r in rows}
    wall = sum(w for _, w in walls)
    prefill = sum(r["prefill_s"] for r in rows)
    tokens = sum(r["new_tokens"] for r in rows)
    return (tokens / wall if wall else 0.0, tokens / (wall - prefill) if wall > prefill else 0.0)


def format_batched(summary: dict[str, Any]) -> str:
    lines = ["| strategy @ batch | tokens/s | speedup vs plain@1 | decode speedup | greedy identical | tau | tree "
             "| plain steps |", "|" + "---|" * 8]
    entries = {k: v for k, v in summary.items() if not k.startswith("_")}  # "_peak_memory_gib": the run's
    for key, a in sorted(entries.items(), key=lambda kv: (kv[1]["batch"], kv[0])):
        ident = "-" if a["greedy_identical"] is None else f"{a['greedy_identical']:.0%}"
        lines.append(f"| {key} | {a['tokens_per_s']:.2f} | {cell(a, 'speedup', unit='x')} "
                     f"| {cell(a, 'decode_speedup', unit='x')} | {ident} | {cell(a, 'tau')} "
                     f"| {cell(a, 'mean_tree_size', '.1f')} | {cell(a, 'plain_steps', '.0%')} |")
    return "\n".join(lines)


def sampling(args: Any):
    """cfg_of(i) for prompt i at the run's first temperature (the batch mode measures one temperature)."""
    temp = float(str(args.temperatures).split(",")[0])

    def cfg_of(i: int) -> SamplingConfig:
        return SamplingConfig(temperature=temp, top_p=args.top_p if temp > 0 else 1.0, seed=args.seed + i,
                              max_new_tokens=args.max_new_tokens)
    return cfg_of, temp == 0
