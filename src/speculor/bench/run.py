"""`speculor bench`: strategies × prompts × temperatures in one run, against plain decoding.

Per prompt, every strategy runs back to back (plain first), `repeats` times, keeping the median wall
time; speedup = tokens/s of a strategy ÷ tokens/s of plain, both summed over the same prompts in this
run. Greedy identity is checked on token ids against plain decoding. Writes records.jsonl (one record
per strategy × temperature × prompt), summary.json and table.md into --out. The options are parsed by the
CLI (`speculor.cli.add_bench_arguments`); `run` takes any object that has them.
"""

from __future__ import annotations

import json
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from speculor.api import Speculor
from speculor.bench import prompts as prompt_sets
from speculor.bench.peers import PEERS, hf_generate
from speculor.config import SamplingConfig
from speculor.engine import Stats
from speculor.errors import SpeculorError
from speculor.runtime.loading import Pair

# every strategy; Sequoia and DySpec size their trees from this machine's cost profile (their hardware-aware mode)
ALL = "plain,chain:k=4,specinfer,sequoia:budget=auto,ngram,dyspec:budget=auto,topk-tree,gsd,specdecpp"
DEFAULTS = {"strategies": "plain,chain", "limit": 6, "max_new_tokens": 48, "temperatures": "0"}
# --quick: one MT-Bench and one HumanEval prompt, so that every strategy and both peers fit in ~10 minutes here
QUICK = {"strategies": ALL + ",hf-assisted,hf-prompt-lookup", "limit": 2, "max_new_tokens": 32, "temperatures": "0"}


def fill_defaults(args: Any) -> None:
    """Options not given on the command line (None) take the --quick values (with --quick) or the defaults;
    args: the parsed options of `speculor bench` (the CLI's `add_bench_arguments`), or any object with them."""
    for key, value in (QUICK if args.quick else DEFAULTS).items():
        if getattr(args, key, None) is None:
            setattr(args, key, value)


@dataclass(frozen=True)
class Spec:
    label: str
    name: str
    options: dict[str, Any] = field(default_factory=dict)


def parse_strategies(text: str) -> list[Spec]:
    """'plain,chain:k=2' -> [Spec('plain','plain',{}), Spec('chain:k=2','chain',{'k': 2})]; plain comes first."""
    specs = []
    for item in filter(None, (s.strip() for s in text.split(","))):
        name, *opts = item.split(":")
        options = {}
        for o in opts:
            key, sep, value = o.partition("=")
            if not sep:
                raise SpeculorError(f"bad strategy option {o!r} in {item!r}; write key=value")
            options[key.replace("-", "_")] = _number(value)
        specs.append(Spec(item, name, options))
    specs = [s for s in specs if s.name == "plain"][:1] + [s for s in specs if s.name != "plain"]
    if not specs or specs[0].name != "plain":
        specs.insert(0, Spec("plain", "plain"))
    return specs


def _number(value: str) -> Any:
    for cast in (int, float):
        try:
            return cast(value)
        except ValueError:
            pass
    return value


def run_one(sp: Speculor, spec: Spec, ids: list[int], cfg: SamplingConfig) -> dict[str, Any]:
    """One generation -> a record (tokens, wall time, per-step acceptance and time split)."""
    if spec.name in PEERS:
        tokens, wall = hf_generate(sp.pair, spec.name, ids, cfg, sp.eos_ids)
        return {"token_ids": tokens, "wall_s": wall, "steps": None}
    stats = Stats()
    t0 = time.perf_counter()
    tokens = [t.id for t in sp.tokens(ids, cfg, strategy=spec.name, stats=stats, **spec.options)]
    wall = time.perf_counter() - t0
    return {"token_ids": tokens, "wall_s": wall, "prefill_s": stats.prefill_s,
            "accepted": [s.accepted for s in stats.steps], "drafted": [s.drafted for s in stats.steps],
            "draft_forwards": sum(s.draft_forwards for s in stats.steps),
            "draft_s": sum(s.draft_s for s in stats.steps), "verify_s": sum(s.verify_s for s in stats.steps),
            "overhead_s": sum(s.overhead_s for s in stats.steps), "steps": len(stats.steps),
            "drafter_stats": sum_stats([s.drafter_stats for s in stats.steps])}


def sum_stats(dicts: list[dict[str, float] | None]) -> dict[str, float] | None:
    """Key-wise sums of drafters' per-step `stats` dicts (e.g. gsd's draft work saved by merging); None if none."""
    out: dict[str, float] = {}
    for d in dicts:
        for key, value in (d or {}).items():
            out[key] = out.get(key, 0) + value
    return out or None


def first_divergence(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


@torch.inference_mode()
def top2_gap(pair: Pair, prompt: list[int], plain: list[int], pos: int) -> float:
    """Target's top-2 logit gap where plain decoding chose plain[pos] (a near-tie explains a flip)."""
    logits = pair.target.model(torch.tensor([prompt + plain[:pos]], device=pair.target.device)).logits[0, -1]
    top = torch.topk(logits.float(), 2).values
    return float(top[0] - top[1])


def run(args: Any, load_pair) -> dict[str, Any]:
    fill_defaults(args)
    specs = parse_strategies(args.strategies)
    temps = [float(t) for t in args.temperatures.split(",")]
    prompts = prompt_sets.load(args.sets.split(","), args.limit)
    sp = Speculor(load_pair(args), strategy="plain")
    for s in specs:  # fail early on unknown strategies or options
        if s.name not in PEERS:
            sp.tokens([1], SamplingConfig(max_new_tokens=1), strategy=s.name, **s.options)
    encoded = [sp.encode(p.text, chat=p.chat) for p in prompts]
    _warm_up(sp, specs, encoded[0][:WARM_UP_TOKENS])
    if getattr(args, "batch", None):
        return _run_batched(args, sp, [s for s in specs if s.name not in PEERS], prompts, encoded)
    records = []
    bar = tqdm(total=len(temps) * len(prompts) * len(specs), desc="bench", unit="gen")
    for temp in temps:
        for i, (prompt, ids) in enumerate(zip(prompts, encoded, strict=True)):
            cfg = SamplingConfig(temperature=temp, top_p=args.top_p if temp > 0 else 1.0,
                                 seed=args.seed + i, max_new_tokens=args.max_new_tokens)
            plain_ids = None
            for spec in specs:
                rec = _measure(sp, spec, ids, cfg, args.repeats)
                rec |= {"strategy": spec.label, "temperature": temp, "prompt_id": prompt.id, "set": prompt.set,
                        "category": prompt.category, "new_tokens": len(rec["token_ids"])}
                if spec.name == "plain":
                    plain_ids = rec["token_ids"]
                if temp == 0:
                    _check_identity(rec, sp.pair, ids, plain_ids)
                records.append(rec)
                bar.update()
    bar.close()
    summary = summarize(records, specs, temps)
    print(format_table(summary))
    if args.out:
        _write(Path(args.out), records, summary, args)
    return summary


def _run_batched(args: Any, sp: Speculor, specs: list[Spec], prompts: list, encoded: list[list[int]]) -> dict:
    """--batch: every strategy at every batch size (bench/batch.py); transformers' peers do not batch."""
    from speculor.bench.batch import format_batched, run_batched, sampling, summarize_batched

    sizes = sorted({int(b) for b in str(args.batch).split(",")})
    if any(b < 1 for b in sizes):
        raise SpeculorError(f"--batch takes batch sizes >= 1, got {args.batch!r}")
    cfg_of, greedy = sampling(args)
    records = run_batched(sp, specs, prompts, encoded, sorted(set(sizes) | {1}), cfg_of)
    summary = summarize_batched(records, greedy)
    print(format_batched(summary))
    if args.out:
        _write(Path(args.out), records, summary, args, format_batched, plots=False)
    return summary


WARM_UP_TOKENS = 16  # a short prompt: the warm-up is for first-call costs, not for a full prefill per strategy


def _warm_up(sp: Speculor, specs: list[Spec], ids: list[int]) -> None:
    cfg = SamplingConfig(max_new_tokens=4)
    for spec in specs:
        run_one(sp, spec, ids, cfg)


def _measure(sp: Speculor, spec: Spec, ids: list[int], cfg: SamplingConfig, repeats: int) -> dict[str, Any]:
    device = sp.pair.target.device
    reset_peak_memory(device)
    runs = [run_one(sp, spec, ids, cfg) for _ in range(max(repeats, 1))]
    rec = runs[0]
    rec["wall_s"] = statistics.median(r["wall_s"] for r in runs)
    rec["wall_s_all"] = [r["wall_s"] for r in runs]
    rec["peak_memory_gib"] = peak_memory_gib(device)
    return rec


def reset_peak_memory(device: torch.device) -> None:
    """Start a new high-water mark: CUDA's allocator statistics, or on Linux the process's peak resident set
    (writing 5 to /proc/self/clear_refs resets VmHWM)."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        return
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        pass


def peak_memory_gib(device: torch.device) -> float | None:
    """GiB at the high-water mark since `reset_peak_memory`: tensors allocated on a GPU, or the process's
    resident set on a CPU (the models included); None where the OS does not say."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    try:
        status = Path("/proc/self/status").read_text()
    except OSError:
        return None
    line = next((ln for ln in status.splitlines() if ln.startswith("VmHWM:")), None)
    return int(line.split()[1]) / 2**20 if line else None


def _check_identity(rec: dict[str, Any], pair: Pair, ids: list[int], plain_ids: list[int] | None) -> None:
    assert plain_ids is not None
    pos = first_divergence(rec["token_ids"], plain_ids)
    rec["greedy_identical"] = pos is None
    if pos is not None:
        rec["divergence"] = {"position": pos, "top2_gap": top2_gap(pair, ids, plain_ids, pos) if pos < len(
            plain_ids) else None}


def summarize(records: list[dict[str, Any]], specs: list[Spec], temps: list[float]) -> dict[str, Any]:
    """Per strategy: the fields at the first temperature, and `by_temperature` for every one."""
    out: dict[str, Any] = {}
    for spec in specs:
        by_t = {}
        for temp in temps:
            rows = [r for r in records if r["strategy"] == spec.label and r["temperature"] == temp]
            base = [r for r in records if r["strategy"] == "plain" and r["temperature"] == temp]
            by_t[str(temp)] = _aggregate(rows, base, temp)
        out[spec.label] = {**by_t[str(temps[0])], "by_temperature": by_t}
    return out


def _tokens_per_s(rows: list[dict[str, Any]], decode_only: bool = False) -> float:
    """New tokens per second of wall time over `rows`; decode_only takes the prompt prefill out of the wall time."""
    secs = sum(r["wall_s"] - (r["prefill_s"] if decode_only else 0.0) for r in rows)
    return sum(r["new_tokens"] for r in rows) / secs if secs > 0 else 0.0


def _aggregate(rows: list[dict[str, Any]], base: list[dict[str, Any]], temp: float) -> dict[str, Any]:
    tokens, wall = sum(r["new_tokens"] for r in rows), sum(r["wall_s"] for r in rows)
    tps, base_tps = _tokens_per_s(rows), _tokens_per_s(base)
    agg: dict[str, Any] = {"tokens_per_s": tps, "speedup": tps / base_tps if base_tps else None,
                           "n_prompts": len(rows), "new_tokens": tokens, "wall_s": wall, "temperature": temp,
                           "greedy_identical": (sum(r["greedy_identical"] for r in rows) / len(rows)
                                                if temp == 0 and rows else None)}
    steps = [a for r in rows if r.get("accepted") is not None for a in r["accepted"]]
    agg["tau"] = (sum(a + 1 for a in steps) / len(steps)) if steps else None
    # decode only: the prompt's prefill (the same target forward for every strategy) taken out of the wall time;
    # the peers' records have no prefill time
    decode_tps = _tokens_per_s(rows, decode_only=True) if all("prefill_s" in r for r in rows) else 0.0
    base_decode_tps = _tokens_per_s(base, decode_only=True)
    agg["decode_speedup"] = decode_tps / base_decode_tps if decode_tps and base_decode_tps else None
    agg["speedup_by_category"] = _by_category(rows, base)
    peaks = [r["peak_memory_gib"] for r in rows if r.get("peak_memory_gib") is not None]
    agg["peak_memory_gib"] = max(peaks) if peaks else None
    agg["drafter_stats"] = sum_stats([r.get("drafter_stats") for r in rows])
    if steps:
        depth = max(steps)
        agg["acceptance_by_depth"] = [sum(a >= d for a in steps) / len(steps) for d in range(1, depth + 1)]
        agg["mean_tree_size"] = statistics.mean(d for r in rows for d in r["drafted"])
        agg["draft_forwards_per_step"] = sum(r["draft_forwards"] for r in rows) / len(steps)
        agg["time_split"] = {k: sum(r[k] for r in rows) / wall for k in ("prefill_s", "draft_s", "verify_s",
                                                                       "overhead_s")}
    return agg


def _by_category(rows: list[dict[str, Any]], base: list[dict[str, Any]]) -> dict[str, float]:
    """Speedup over plain within each prompt category (same prompts, same run)."""
    out = {}
    for cat in sorted({r["category"] for r in rows}):
        mine = [r for r in rows if r["category"] == cat]
        ref = [r for r in base if r["category"] == cat]
        ref_tps = _tokens_per_s(ref)
        out[cat] = _tokens_per_s(mine) / ref_tps if ref_tps else 0.0
    return out


def format_table(summary: dict[str, Any]) -> str:
    """Markdown: per strategy and temperature τ, tree size, draft forwards per step, speed, identity, time split
    and peak memory."""
    head = ("| strategy | T | tau | tree | draft fwd/step | tokens/s | speedup | decode speedup | greedy identical "
            "| prefill / draft / verify / other | peak GiB |")
    lines = [head, "|" + "---|" * 11]
    for label, s in summary.items():
        for temp, a in s["by_temperature"].items():
            ident = "-" if a["greedy_identical"] is None else f"{a['greedy_identical']:.0%}"
            split = a.get("time_split")
            parts = ("prefill_s", "draft_s", "verify_s")
            split_s = "-" if not split else " / ".join(
                [f"{split[k]:.0%}" for k in parts] + [f"{1 - sum(split[k] for k in parts):.0%}"])
            lines.append(f"| {label} | {temp} | {_cell(a, 'tau')} | {_cell(a, 'mean_tree_size', '.1f')} "
                         f"| {_cell(a, 'draft_forwards_per_step', '.1f')} | {a['tokens_per_s']:.2f} "
                         f"| {_cell(a, 'speedup', unit='x')} | {_cell(a, 'decode_speedup', unit='x')} | {ident} "
                         f"| {split_s} | {_cell(a, 'peak_memory_gib', '.1f')} |")
    return "\n".join(lines)


def _cell(agg: dict[str, Any], key: str, fmt: str = ".2f", unit: str = "") -> str:
    """One table cell: agg[key] formatted, or '-' where it is missing (a peer has no tau, no tree)."""
    return "-" if agg.get(key) is None else format(agg[key], fmt) + unit


def _write(out: Path, records: list[dict[str, Any]], summary: dict[str, Any], args: Any, table=None,
           plots: bool = True) -> None:
    """records.jsonl, summary.json (with the run's options), table.md and (unless told not to) the plots."""
    out.mkdir(parents=True, exist_ok=True)
    with (out / "records.jsonl").open("w") as f:
        for r in records:
            f.write(json.dumps(r) + "\n")
    meta = {k: v for k, v in vars(args).items() if isinstance(v, (str, int, float, bool, type(None)))}
    (out / "summary.json").write_text(json.dumps({**summary, "_run": meta}, indent=2))
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
