"""`speculor bench --format spec-bench`: the run's answers in Spec-Bench's record format, so that Spec-Bench's own
speed script (evaluation/speed.py, github.com/hemingkx/Spec-Bench) reads them unchanged.

Spec-Bench keeps one answer file per method and run, `model_answer_temp{T}_run_{k}/{model_id}.jsonl`, one line per
question: {"question_id", "category", "answer_id", "model_id", "tstamp", "choices": [{"index", "turns",
"decoding_steps", "new_tokens", "wall_time", "accept_lengths"}]}, with one entry per turn in turns / decoding_steps /
new_tokens / wall_time and the accept length (accepted + 1, the bonus included) of every step of every turn in
accept_lengths. Its speed script takes per question Σ new_tokens ÷ Σ wall_time of choice 0 (for the baseline it
re-tokenizes the turns' text instead) and divides the mean over questions of the method by the baseline's. We decode
one turn per prompt; our rounds are its runs; plain decoding is the baseline (`plain.jsonl`).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from speculor.runtime.assets import slug


def records_to_answers(records: list[dict[str, Any]], decode: Callable[[list[int]], str],
                       tstamp: float) -> dict[Path, list[dict[str, Any]]]:
    """Spec-Bench answer lines per relative file path, from bench records (one per strategy × temperature ×
    prompt × round)."""
    files: dict[Path, list[dict[str, Any]]] = {}
    for r in records:
        temp = f"{r['temperature']:g}"
        path = Path(f"model_answer_temp{temp}_run_{r.get('round', 0) + 1}") / f"{slug(r['strategy'])}.jsonl"
        accepted = r.get("accepted") or []
        choice = {"index": 0, "turns": [decode(r["token_ids"]).strip()],
                  "decoding_steps": [len(accepted) if r.get("accepted") is not None else r["new_tokens"]],
                  "new_tokens": [r["new_tokens"]], "wall_time": [r["wall_s"]],
                  "accept_lengths": [a + 1 for a in accepted]}
        files.setdefault(path, []).append({
            "question_id": r["prompt_id"], "category": r["category"],
            "answer_id": f"{r['strategy']}/{r['prompt_id']}/T{temp}/run{r.get('round', 0) + 1}",
            "model_id": r["strategy"], "choices": [choice], "tstamp": tstamp})
    return files


def write(out: Path, records: list[dict[str, Any]], decode: Callable[[list[int]], str], tstamp: float) -> list[Path]:
    """Writes the answer files under out/spec-bench/; returns their paths."""
    paths = []
    for rel, lines in records_to_answers(records, decode, tstamp).items():
        path = out / "spec-bench" / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("".join(json.dumps(line) + "\n" for line in lines))
        paths.append(path)
    return paths
