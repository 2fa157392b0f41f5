"""A bench run's summary: per strategy and temperature, speed over rounds with its spread, τ, acceptance, time split.

Every (prompt, strategy) ran once per round. A round's tokens/s is its new tokens ÷ its wall time, summed over the
prompts; its speedup divides that by plain decoding's tokens/s of the same round. The summary keeps the median over
rounds and the min–max spread (`speedup_min`, `speedup_max`, `tokens_per_s_min`, `tokens_per_s_max`). τ and the
acceptance figures pool every step of every round (the same tokens each round: the seeds are fixed).
"""

from __future__ import annotations

import statistics
from typing import Any


def summarize(records: list[dict[str, Any]], labels: list[str], temps: list[float]) -> dict[str, Any]:
    """Per strategy label: the fields at the first temperature, and `by_temperature` for every one. Where the
    `llama.cpp` peer ran, `vs_llama_cpp` (with its spread) divides by its tokens/s of the same round, as `speedup`
    divides by our plain decoding's, and `vs_llama_cpp_decode` the same with each side's prefill (its time to the
    first token) taken out."""
    out: dict[str, Any] = {}
    for label in labels:
        by_t = {}
        for temp in temps:
            rows = [r for r in records if r["strategy"] == label and r["temperature"] == temp]
            base = [r for r in records if r["strategy"] == "plain" and r["temperature"] == temp]
            by_t[str(temp)] = aggregate(rows, base, temp)
            peer = [r for r in records if r["strategy"] == "llama.cpp" and r["temperature"] == temp]
            if peer:
                by_t[str(temp)] |= spread("vs_llama_cpp", round_ratios(rows, peer))
                decode = decode_ratios(rows, peer)
                by_t[str(temp)]["vs_llama_cpp_decode"] = statistics.median(decode) if decode else None
            if best := server_best(records, temp):
                by_t[str(temp)]["vs_llama_server_best"] = versus_best(rows, records, temp, best)
        out[label] = {**by_t[str(temps[0])], "by_temperature": by_t}
    return out


def is_server(label: str) -> bool:
    """Whether a row is llama-server's (`llama-server` or `llama-server:CONFIG`, bench/peer_server.py)."""
    return label == "llama-server" or label.startswith("llama-server:")


def server_best(records: list[dict[str, Any]], temp: float) -> dict[str, str]:
    """Per prompt set: llama-server's configuration (its row's label) with the most tokens/s at `temp`, all its
    rounds pooled ({} where no llama-server row ran)."""
    rows = [r for r in records if is_server(r["strategy"]) and r["temperature"] == temp]
    out = {}
    for name in dict.fromkeys(r["set"] for r in rows):
        mine = [r for r in rows if r["set"] == name]
        tps = {label: tokens_per_s([r for r in mine if r["strategy"] == label])
               for label in dict.fromkeys(r["strategy"] for r in mine)}
        out[name] = max(tps, key=lambda label: tps[label])
    return out


def versus_best(rows: list[dict[str, Any]], records: list[dict[str, Any]], temp: float,
                best: dict[str, str]) -> dict[str, dict[str, Any]]:
    """Per prompt set: {best: llama-server's best configuration there, ratio: the median over rounds of `rows`'
    tokens/s in that set ÷ the best's in the same round (None where no round had both)}."""
    out = {}
    for name, label in best.items():
        base = [r for r in records if r["strategy"] == label and r["temperature"] == temp and r["set"] == name]
        ratios = round_ratios([r for r in rows if r["set"] == name], base)
        out[name] = {"best": label, "ratio": statistics.median(ratios) if ratios else None}
    return out


def tokens_per_s(rows: list[dict[str, Any]], decode_only: bool = False) -> float:
    """New tokens per second of wall time over `rows`; decode_only takes the prompt prefill out of the wall time."""
    secs = sum(r["wall_s"] - (r["prefill_s"] if decode_only else 0.0) for r in rows)
    return sum(r["new_tokens"] for r in rows) / secs if secs > 0 else 0.0


def by_round(rows: list[dict[str, Any]]) -> dict[int, list[dict[str, Any]]]:
    out: dict[int, list[dict[str, Any]]] = {}
    for r in rows:
        out.setdefault(r.get("round", 0), []).append(r)
    return dict(sorted(out.items()))


def round_ratios(rows: list[dict[str, Any]], base: list[dict[str, Any]], decode_only: bool = False) -> list[float]:
    """Per round: tokens/s of `rows` ÷ tokens/s of `base` in the same round (rounds where both ran)."""
    mine, ref = by_round(rows), by_round(base)
    out = []
    for r in mine:
        b = tokens_per_s(ref.get(r, []), decode_only)
        if b > 0:
            out.append(tokens_per_s(mine[r], decode_only) / b)
    return out


def decode_ratios(rows: list[dict[str, Any]], base: list[dict[str, Any]]) -> list[float]:
    """`round_ratios` of decoding alone (each side's prefill out), or none where a record has no prefill time (a peer
    that does not say its time to the first token)."""
    return round_ratios(rows, base, decode_only=True) if all("prefill_s" in r for r in rows + base) else []


def aggregate(rows: list[dict[str, Any]], base: list[dict[str, Any]], temp: float) -> dict[str, Any]:
    rounds = by_round(rows)
    tps = [tokens_per_s(rs) for rs in rounds.values()]
    speedups = round_ratios(rows, base)
    n_rounds = max(len(rounds), 1)
    agg: dict[str, Any] = {
        **spread("tokens_per_s", tps, empty=0.0), **spread("speedup", speedups),
        "speedup_by_round": speedups, "rounds": len(rounds),
        "n_prompts": len({r["prompt_id"] for r in rows}),
        "new_tokens": sum(r["new_tokens"] for r in rows) // n_rounds,
        "wall_s": sum(r["wall_s"] for r in rows) / n_rounds, "temperature": temp,
        "greedy_identical": (sum(r["greedy_identical"] for r in rows) / len(rows) if temp == 0 and rows else None)}
    steps = [a for r in rows if r.get("accepted") is not None for a in r["accepted"]]
    agg["tau"] = (sum(a + 1 for a in steps) / len(steps)) if steps else None
    # decode only: the prompt's prefill (the same target forward for every strategy) taken out of the wall time;
    # of the peers only llama.cpp's records have one (its time to the first token)
    decode = decode_ratios(rows, base)
    agg["decode_speedup"] = statistics.median(decode) if decode else None
    agg["speedup_by_category"] = by_category(rows, base)
    peaks = [r["peak_memory_gib"] for r in rows if r.get("peak_memory_gib") is not None]
    agg["peak_memory_gib"] = max(peaks) if peaks else None
    agg["drafter_stats"] = sum_stats([r.get("drafter_stats") for r in rows])
    if timings := [r["server_timings"] for r in rows if r.get("server_timings") is not None]:  # llama-server's own
        agg["server_drafted"] = sum(t.get("draft_n", 0) for t in timings)
        agg["server_accepted"] = sum(t.get("draft_n_accepted", 0) for t in timings)
    if steps:
        depth = max(steps)
        agg["acceptance_by_depth"] = [sum(a >= d for a in steps) / len(steps) for d in range(1, depth + 1)]
        if by_match := acceptance_by_match(rows):
            agg["acceptance_by_match"] = by_match
        agg["mean_tree_size"] = statistics.mean(d for r in rows for d in r["drafted"])
        agg["draft_forwards_per_step"] = sum(r["draft_forwards"] for r in rows) / len(steps)
        wall = sum(r["wall_s"] for r in rows)
        agg["time_split"] = {k: sum(r[k] for r in rows) / wall for k in ("prefill_s", "draft_s", "verify_s",
                                                                       "overhead_s")}
        if all(r.get("host_s") is not None for r in rows):  # outside the kernels: per step and its share
            host = sum(r["host_s"] for r in rows)
            agg["host_ms_per_step"], agg["host_share"] = 1000 * host / len(steps), host / wall
    return agg


MATCH_BUCKETS = ((1, 1), (2, 2), (3, 4), (5, 8), (9, 1 << 30))  # match lengths, in tokens


def acceptance_by_match(rows: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """suffix's steps that drafted, by the length of the match they drafted from: steps, mean draft tokens and mean
    accepted ones, and the share of draft tokens accepted ({} where the records carry no match lengths)."""
    out = {}
    cells = [(m, d, a) for r in rows for m, d, a in zip(r.get("match") or [], r["drafted"], r["accepted"], strict=False)
             if m]
    for lo, hi in MATCH_BUCKETS:
        chosen = [(d, a) for m, d, a in cells if lo <= m <= hi]
        if chosen:
            drafted, accepted = sum(d for d, _ in chosen), sum(a for _, a in chosen)
            out[f"{lo}" if lo == hi else f"{lo}+" if hi > 1 << 20 else f"{lo}-{hi}"] = {
                "steps": len(chosen), "drafted": drafted / len(chosen), "accepted": accepted / len(chosen),
                "accepted_share": accepted / drafted if drafted else 0.0}
    return out


def by_category(rows: list[dict[str, Any]], base: list[dict[str, Any]]) -> dict[str, float]:
    """Speedup over plain within each prompt category (same prompts, same run, all rounds pooled)."""
    out = {}
    for cat in sorted({r["category"] for r in rows}):
        ref_tps = tokens_per_s([r for r in base if r["category"] == cat])
        out[cat] = tokens_per_s([r for r in rows if r["category"] == cat]) / ref_tps if ref_tps else 0.0
    return out


def sum_stats(dicts: list[dict[str, float] | None]) -> dict[str, float] | None:
    """Key-wise sums of drafters' per-step `stats` dicts (e.g. gsd's draft work saved by merging); None if none."""
    out: dict[str, float] = {}
    for d in dicts:
        for key, value in (d or {}).items():
            out[key] = out.get(key, 0) + value
    return out or None


def format_table(summary: dict[str, Any]) -> str:
    """Markdown: per strategy and temperature τ, tree size, draft forwards per step, speed with its spread over
    rounds ÷ our plain decoding (and ÷ llama.cpp's own plain decoding where that peer ran, and ÷ llama-server's
    best configuration in each prompt set where its rows ran: named below the table), the cost model's predicted
    speedup, identity, time split and peak memory."""
    llama = any("vs_llama_cpp" in a for s in summary.values() for a in s["by_temperature"].values())
    sets = list(dict.fromkeys(name for s in summary.values() for a in s["by_temperature"].values()
                              for name in a.get("vs_llama_server_best") or {}))
    head = ("| strategy | T | tau | tree | draft fwd/step | tokens/s | ÷ our plain (min–max) | "
            + ("÷ llama.cpp plain (decode) | " if llama else "")
            + "".join(f"÷ llama-server best ({name}) | " for name in sets)
            + "predicted | decode speedup | greedy identical | prefill / draft / verify / other | host ms/step "
            + "(share) | peak GiB |")
    lines = [head, "|" + "---|" * (13 + llama + len(sets))]
    for label, s in summary.items():
        for temp, a in s["by_temperature"].items():
            ident = "-" if a["greedy_identical"] is None else f"{a['greedy_identical']:.0%}"
            split = a.get("time_split")
            parts = ("prefill_s", "draft_s", "verify_s")
            split_s = "-" if not split else " / ".join(
                [f"{split[k]:.0%}" for k in parts] + [f"{1 - sum(split[k] for k in parts):.0%}"])
            decode = "" if a.get("vs_llama_cpp_decode") is None else f" ({a['vs_llama_cpp_decode']:.2f}x)"
            speed = with_spread(a, "speedup") + (f" | {cell(a, 'vs_llama_cpp', unit='x')}{decode}" if llama else "")
            speed += "".join(f" | {cell((a.get('vs_llama_server_best') or {}).get(n, {}), 'ratio', unit='x')}"
                             for n in sets)
            predicted = cell(a, "predicted_speedup", unit="x")
            if a.get("model_check"):
                predicted += f" {a['model_check']}"
            lines.append(f"| {label} | {temp} | {cell(a, 'tau')} | {cell(a, 'mean_tree_size', '.1f')} "
                         f"| {cell(a, 'draft_forwards_per_step', '.1f')} | {a['tokens_per_s']:.2f} | {speed} "
                         f"| {predicted} | {cell(a, 'decode_speedup', unit='x')} | {ident} "
                         f"| {split_s} | {host_cell(a)} | {cell(a, 'peak_memory_gib', '.1f')} |")
    return "\n".join(lines + best_note(summary))


def drafts_note(summary: dict[str, Any]) -> str | None:
    """llama-server's own draft tokens, accepted / drafted, per speculating configuration (its `timings`; 'drafted
    nothing' where its speculation never ran: short answers with nothing to copy, or a configuration that loads no
    drafter); None where no such row ran."""
    said = []
    for label, s in summary.items():
        if is_server(label) and label != "llama-server" and s.get("server_drafted") is not None:
            drafted, accepted = s["server_drafted"], s["server_accepted"]
            said.append(f"{label} {accepted} / {drafted}" if drafted else f"{label} drafted nothing")
    return "llama-server's own drafts at the first temperature (accepted / drafted): " + ", ".join(said) if said \
        else None


def best_note(summary: dict[str, Any]) -> list[str]:
    """The line under the table naming llama-server's best configuration per prompt set and temperature."""
    first = next(iter(summary.values()), {"by_temperature": {}})
    said = [f"{name} T={temp}: {v['best']}" for temp, a in first["by_temperature"].items()
            for name, v in (a.get("vs_llama_server_best") or {}).items()]
    return ["", "llama-server's best configuration (most tokens/s) per set: " + "; ".join(said)] if said else []


def host_cell(agg: dict[str, Any]) -> str:
    """Host milliseconds per step and their share of the wall time ('-' where the kernels' time is not counted)."""
    if agg.get("host_ms_per_step") is None:
        return "-"
    return f"{agg['host_ms_per_step']:.2f} ({agg['host_share']:.1%})"


def spread(name: str, xs: list[float], empty: float | None = None) -> dict[str, float | None]:
    """`name`: the median over rounds, `name_min`, `name_max`: their spread (`empty` where there is none)."""
    return {name: statistics.median(xs) if xs else empty, f"{name}_min": min(xs, default=empty),
            f"{name}_max": max(xs, default=empty)}


def with_spread(agg: dict[str, Any], key: str) -> str:
    """A ratio's cell: its median, and (min–max) over rounds when there were several."""
    text = cell(agg, key, unit="x")
    if agg.get("rounds", 1) > 1 and agg.get(f"{key}_min") is not None:
        text += f" ({agg[f'{key}_min']:.2f}–{agg[f'{key}_max']:.2f})"
    return text


def cell(agg: dict[str, Any], key: str, fmt: str = ".2f", unit: str = "") -> str:
    """One table cell: agg[key] formatted, or '-' where it is missing (a peer has no tau, no tree)."""
    return "-" if agg.get(key) is None else format(agg[key], fmt) + unit
