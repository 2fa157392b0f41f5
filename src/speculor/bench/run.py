"""`speculor bench`: strategies × prompts × temperatures in rounds, against plain decoding of the same run.

Every (prompt, strategy) runs once per round, R rounds (`--rounds`, 3 by default), the strategies' order shuffled
anew (seeded) for every prompt of every round so that none always runs first or last. The summary (bench/summary.py)
keeps per strategy the median over rounds and the min–max spread of tokens/s and of the speedup (÷ plain decoding's
tokens/s in the same round); bench/checks.py adds the plausibility warnings and the speedup the cost model predicts.
Greedy identity is checked on token ids against plain decoding. Writes records.jsonl (one record per strategy ×
temperature × prompt × round), summary.json (with the warnings and the machine's load), table.md, the plots and,
with `--format spec-bench`, Spec-Bench's answer files (bench/specbench.py). The options are parsed by the CLI
(`speculor.cli.add_bench_arguments`); `run` takes any object that has them.
"""

from __future__ import annotations

import json
import random
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from speculor.api import Speculor
from speculor.bench import machine
from speculor.bench import prompts as prompt_sets
from speculor.bench.batch import format_batched, run_batched, sampling, summarize_batched
from speculor.bench.checks import check, start_warnings, timed_note
from speculor.bench.config import QUICK_NOTE, BenchConfig
from speculor.bench.peer_server import Servers, config_of, fitting_context
from speculor.bench.peers import PEERS, SERVER_PEERS, open_servers, peer_generate, unfit
from speculor.bench.specs import Spec
from speculor.bench.summary import cell, drafts_note, format_table, sum_stats, summarize
from speculor.config import SamplingConfig
from speculor.engine import Stats
from speculor.runtime.backend import Pair, forward1
from speculor.runtime.memory import peak_memory_gib, reset_peak_memory

__all__ = ["cell", "format_table", "peak_memory_gib", "reset_peak_memory", "run", "sum_stats", "summarize"]


def run_one(sp: Speculor, spec: Spec, ids: list[int], cfg: SamplingConfig,
            servers: Servers | None = None) -> dict[str, Any]:
    """One generation -> a record (tokens, wall time, per-step tree size, draft forwards, acceptance, time split);
    llama-server's rows through `servers`."""
    if spec.name in SERVER_PEERS:
        assert servers is not None, "llama-server's rows need their servers"
        return servers.generate(config_of(spec.name), ids, cfg, sp.eos_ids) | {"steps": None}
    if spec.name in PEERS:
        tokens, wall, first = peer_generate(sp.pair, spec.name, ids, cfg, sp.eos_ids)
        return {"token_ids": tokens, "wall_s": wall, "steps": None} | ({} if first is None else {"prefill_s": first})
    stats = Stats()
    k0 = kernel_s(sp.pair)
    t0 = time.perf_counter()
    tokens = [t.id for t in sp.tokens(ids, cfg, strategy=spec.name, stats=stats, **spec.options)]
    wall = time.perf_counter() - t0
    host = None if k0 is None else wall - (kernel_s(sp.pair) - k0)
    return {"token_ids": tokens, "wall_s": wall, "prefill_s": stats.prefill_s, "host_s": host,
            "accepted": [s.accepted for s in stats.steps], "drafted": [s.drafted for s in stats.steps],
            "forwards": [s.draft_forwards for s in stats.steps],
            "draft_forwards": sum(s.draft_forwards for s in stats.steps),
            "draft_s": sum(s.draft_s for s in stats.steps), "verify_s": sum(s.verify_s for s in stats.steps),
            "overhead_s": sum(s.overhead_s for s in stats.steps), "steps": len(stats.steps),
            "drafter_stats": sum_stats([s.drafter_stats for s in stats.steps]),
            "match": [int(s.drafter_stats["match"]) if s.drafter_stats and "match" in s.drafter_stats else None
                      for s in stats.steps]}  # suffix: each step's match length (0: the tries drafted nothing)


def kernel_s(pair: Pair) -> float | None:
    """Seconds the pair's models have spent in their kernels so far (llama.cpp's llama_decode), None where a
    backend does not count them (torch): the rest of a generation's wall time is host time."""
    counts = [m.kernel_s for m in (pair.target, pair.draft) if m is not None]
    return None if counts[0] is None else sum(c for c in counts if c is not None)


def first_divergence(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


@torch.inference_mode()
def top2_gap(pair: Pair, prompt: list[int], plain: list[int], pos: int) -> float:
    """Target's top-2 logit gap where plain decoding chose plain[pos] (a near-tie explains a flip)."""
    logits = forward1(pair.target, pair.target.new_cache(), prompt + plain[:pos], last=True).logits[-1]
    top = torch.topk(logits.float(), 2).values
    return float(top[0] - top[1])


def run(cfg: BenchConfig, load_pair: Callable[[], Pair]) -> dict[str, Any]:
    """The run of `cfg` on the pair `load_pair()` gives: prints the table and its warnings, writes cfg.out; the
    summary."""
    specs, temps = list(cfg.strategies), list(cfg.temperatures)
    load = machine.load_at_start()  # before loading: the load average is then other processes' alone
    prompts = prompt_sets.load(list(cfg.sets), cfg.limit)
    sp = Speculor(load_pair(), strategy="plain")
    # --quick's own list: only the peers that run beside this pair (whose backend auto may have just chosen)
    dropped = {s.label: why for s in specs
               if cfg.fit_peers and s.name in PEERS and (why := unfit(sp.pair, s.name, cfg.llama_server))}
    if dropped:
        specs = [s for s in specs if s.label not in dropped]
        cfg = replace(cfg, strategies=tuple(specs))
    for s in specs:  # fail early on unknown strategies or options
        if s.name not in PEERS:
            sp.tokens([1], SamplingConfig(max_new_tokens=1), strategy=s.name, **s.options)
    encoded = [sp.encode(p.text, chat=p.chat) for p in prompts]
    _warm_up(sp, specs, encoded[0][:WARM_UP_TOKENS])
    if cfg.batch:
        return _run_batched(cfg, sp, [s for s in specs if s.name not in PEERS], prompts, encoded)
    setup_peak = peak_memory_gib(sp.pair.target.device)  # loading, packing, profiling, warm-up: before any reset
    records = _run_rounds(sp, cfg, prompts, encoded)
    for temp in temps:
        if temp == 0:
            _check_identity(sp.pair, [r for r in records if r["temperature"] == 0], encoded, prompts)
    summary = summarize(records, [s.label for s in specs], temps)
    warnings = start_warnings(load) + check(summary, records, temps, _cost(sp))
    print(format_table(summary))
    notes = ([QUICK_NOTE] if cfg.quick else []) + [n for n in [drafts_note(summary)] if n]
    if dropped:
        notes.append(f"peers left out on {sp.pair.backend}: " + "; ".join(f"{k} ({v})" for k, v in dropped.items()))
    if setup_peak is not None:
        notes.append(f"peak memory before the first generation (loading, packing, profiling, warm-up): "
                     f"{setup_peak:.1f} GiB; per generation: the table's peak column")
    if (calls := sp.pair.target.call_times) is not None and (timed := timed_note(calls, _profile(sp.pair))):
        notes.append(timed)
    for line in notes + [f"warning: {w}" for w in warnings]:
        print(line)
    if cfg.out:
        _write(Path(cfg.out), records, summary, cfg, extra={"_warnings": warnings, "_notes": notes,
                                                              "_machine": load, "_setup_peak_gib": setup_peak})
        if cfg.format == "spec-bench":
            from speculor.bench import specbench

            def decode(ids: list[int]) -> str:  # Spec-Bench strips special tokens from its answers
                return sp.pair.tokenizer.decode(ids, skip_special_tokens=True)

            paths = specbench.write(Path(cfg.out), records, decode, time.time())
            print(f"wrote {len(paths)} Spec-Bench answer files under {cfg.out}/spec-bench")
    return summary


def _run_rounds(sp: Speculor, cfg: BenchConfig, prompts: list, encoded: list[list[int]]) -> list[dict[str, Any]]:
    """Every (temperature, prompt, strategy) once per round; the strategies' order shuffled per prompt and round.
    With --out, each record is also appended to records.partial.jsonl as it comes: a run stopped early keeps them.
    llama-server's rows ask the servers `open_servers` keeps (stopped at the end, however the run ends)."""
    partial = Path(cfg.out) / "records.partial.jsonl" if cfg.out else None
    if partial:
        partial.parent.mkdir(parents=True, exist_ok=True)
        partial.write_text("")
    specs, temps = list(cfg.strategies), list(cfg.temperatures)
    bar = tqdm(total=cfg.rounds * len(temps) * len(prompts) * len(specs), desc="bench", unit="gen")
    context = fitting_context(max(map(len, encoded)), cfg.max_new_tokens)
    records: list[dict[str, Any]] = []
    with open_servers(sp.pair, [s.label for s in specs], context, Path(cfg.out) if cfg.out else None,
                      cfg.llama_server) as servers:
        for rnd in range(cfg.rounds):
            sp.forget()  # a round starts as a fresh server: no strategy remembers an earlier round's answers
            if servers is not None:
                servers.forget()  # nor does llama-server: each configuration starts anew at its first request
            records += _round(sp, cfg, rnd, prompts, encoded, servers, partial, bar)
    bar.close()
    return records


def _round(sp: Speculor, cfg: BenchConfig, rnd: int, prompts: list, encoded: list[list[int]],
           servers: Servers | None, partial: Path | None, bar: tqdm) -> list[dict[str, Any]]:
    """One round: every (temperature, prompt, strategy) once, the strategies' order shuffled per prompt."""
    device = sp.pair.target.device
    rng = random.Random(cfg.seed + rnd)
    records = []
    for temp in cfg.temperatures:
        for i, (prompt, ids) in enumerate(zip(prompts, encoded, strict=True)):
            sampling = SamplingConfig(temperature=temp, top_p=cfg.top_p if temp > 0 else 1.0, seed=cfg.seed + i,
                                      max_new_tokens=cfg.max_new_tokens)
            order = list(cfg.strategies)
            rng.shuffle(order)
            for pos, spec in enumerate(order):
                reset_peak_memory(device)
                before = machine.snapshot()
                rec = run_one(sp, spec, ids, sampling, servers)
                # a llama-server's CPU time is this generation's, not another process's
                rec["others_cores"] = machine.others_cores(before, machine.snapshot(), rec.pop("server_cpu_s", None))
                rec |= {"strategy": spec.label, "temperature": temp, "prompt_id": prompt.id, "set": prompt.set,
                        "category": prompt.category, "new_tokens": len(rec["token_ids"]), "round": rnd,
                        "position": pos, "peak_memory_gib": rec.get("peak_memory_gib", peak_memory_gib(device))}
                records.append(rec)
                if partial:
                    with partial.open("a") as f:
                        f.write(json.dumps(rec) + "\n")
                bar.update()
    return records


def _cost(sp: Speculor):
    """This machine's cost curve for the predicted speedups (profiled once if there is none); None without a draft."""
    if sp.pair.draft is None:
        return None
    from speculor.runtime.profiling import machine_cost

    return machine_cost(sp.pair)


def _profile(pair: Pair):
    """This machine's cost curve where one is cached, else None (nothing is profiled for a note)."""
    from speculor.runtime.cost import CostModel, cost_path

    return CostModel.load(path) if (path := cost_path(pair)).exists() else None


def _run_batched(cfg: BenchConfig, sp: Speculor, specs: list[Spec], prompts: list, encoded: list[list[int]]) -> dict:
    """--batch: every strategy at every batch size (bench/batch.py); transformers' peers do not batch."""
    cfg_of, greedy = sampling(cfg)
    records = run_batched(sp, specs, prompts, encoded, sorted(set(cfg.batch) | {1}), cfg_of, cfg.rounds)
    summary = summarize_batched(records, greedy)
    summary["_peak_memory_gib"] = peak_memory_gib(sp.pair.target.device)  # the whole run's, loading included
    print(format_batched(summary))
    if summary["_peak_memory_gib"] is not None:
        print(f"peak memory of the run (loading included): {summary['_peak_memory_gib']:.1f} GiB")
    if cfg.out:
        _write(Path(cfg.out), records, summary, cfg, format_batched, plots=False)
    return summary


WARM_UP_TOKENS = 16  # a short prompt: the warm-up is for first-call costs, not for a full prefill per strategy


def _warm_up(sp: Speculor, specs: list[Spec], ids: list[int]) -> None:
    """A short generation of every strategy and in-process peer (llama-server's warm up as they start)."""
    cfg = SamplingConfig(max_new_tokens=4)
    for spec in specs:
        if spec.name not in SERVER_PEERS:
            run_one(sp, spec, ids, cfg)


def _check_identity(pair: Pair, records: list[dict[str, Any]], encoded: list[list[int]], prompts: list) -> None:
    """Greedy identity of every record against plain decoding of the same prompt (its first round)."""
    plain: dict[str, list[int]] = {}
    for r in records:  # in the order run: the first round's plain output of each prompt
        if r["strategy"] == "plain":
            plain.setdefault(r["prompt_id"], r["token_ids"])
    ids_of = {p.id: ids for p, ids in zip(prompts, encoded, strict=True)}
    for rec in records:
        ref = plain[rec["prompt_id"]]
        pos = first_divergence(rec["token_ids"], ref)
        rec["greedy_identical"] = pos is None
        if pos is not None:
            gap = top2_gap(pair, ids_of[rec["prompt_id"]], ref, pos) if pos < len(ref) else None
            rec["divergence"] = {"position": pos, "top2_gap": gap}


def _write(out: Path, records: list[dict[str, Any]], summary: dict[str, Any], cfg: BenchConfig, table=None,
           plots: bool = True, extra: dict[str, Any] | None = None) -> None:
    """records.jsonl, summary.json (with the run's options and `extra`), table.md and (unless told not to) the
    plots."""
    out.mkdir(parents=True, exist_ok=True)
    with (out / "records.jsonl").open("w") as f:
        for r in records:
            f.write(json.dumps(r) + "\n")
    (out / "records.partial.jsonl").unlink(missing_ok=True)  # the whole run is in records.jsonl now
    (out / "summary.json").write_text(json.dumps({**summary, **(extra or {}), "_run": cfg.meta()}, indent=2))
    (out / "table.md").write_text((table or format_table)(summary) + "\n")
    if not plots:
        print(f"wrote {out}/records.jsonl, summary.json, table.md")
        return
    try:
        from speculor.bench.plots import draw_all

        pngs = draw_all(out, summary, records)
    except ImportError:  # matplotlib is the optional [bench] extra
        pngs = []
    print(f"wrote {out}/records.jsonl, summary.json, table.md and {len(pngs)} plots")
