"""FR-Spec's frequency-ranked vocabulary (Zhao et al. 2025, "FR-Spec: Accelerating Large-Vocabulary Language Models
via Frequency-Ranked Speculative Sampling"): count how often each token of the target's tokenizer occurs in real
replies and keep the ids ranked by count, the special / end-of-sequence tokens first.

Sources (the prompt-set packages of bench/prompts.py): the assistant ("gpt") turns of ShareGPT and the canonical
solutions of HumanEval. The result is shipped as `speculor/data/fr_vocab.npy` (int32 ids, most frequent first) with
`fr_vocab.json` beside it (how it was made); `runtime/draft_vocab.py` reads them to restrict the draft's head.

    python -m speculor.methods.fr_vocab --out src/speculor/data/fr_vocab.npy [--top 32768] [--records N]
"""

from __future__ import annotations

import argparse
import datetime
import gzip
import json
import sys
import time
from collections.abc import Iterable, Iterator
from pathlib import Path

import numpy as np

from speculor.bench import prompts
from speculor.errors import SpeculorError
from speculor.runtime.assets import package_file
from speculor.runtime.draft_vocab import special_ids, vocab_fingerprint

TOP = 32768
BATCH = 256  # texts per tokenizer call


def sharegpt_replies(records: int | None = None) -> Iterator[str]:
    """The text of every "gpt" turn of the first `records` ShareGPT conversations (all when None)."""
    for r in prompts.sharegpt_records(records):
        for turn in r.get("conversations") or []:
            if turn.get("from") == "gpt" and turn.get("value"):
                yield turn["value"]


def humaneval_solutions() -> Iterator[str]:
    """The canonical solution of every HumanEval problem (the code a model writes after the prompt)."""
    with package_file(*prompts.SOURCES["humaneval"]) as f:
        for line in gzip.decompress(f.read()).decode().splitlines():
            if line.strip():
                yield json.loads(line)["canonical_solution"]


def count_tokens(tokenizer, texts: Iterable[str], size: int) -> tuple[np.ndarray, int]:
    """(counts [size] int64 of every token id in `texts`, number of texts), tokenized without special tokens."""
    counts, n, batch = np.zeros(size, dtype=np.int64), 0, []

    def flush() -> None:
        ids = tokenizer(batch, add_special_tokens=False)["input_ids"]
        flat = np.fromiter((t for row in ids for t in row), dtype=np.int64)
        counts[:] += np.bincount(flat, minlength=size)[:size]
        batch.clear()

    for text in texts:
        batch.append(text)
        n += 1
        if len(batch) == BATCH:
            flush()
    if batch:
        flush()
    return counts, n


def rank(counts: np.ndarray, first: Iterable[int], top: int) -> np.ndarray:
    """The ids `first` (in order), then every other id by decreasing count (ties: lower id first), cut to `top`."""
    first = list(dict.fromkeys(int(i) for i in first))
    order = np.lexsort((np.arange(len(counts)), -counts))  # last key sorts first: count desc, then id asc
    rest = order[~np.isin(order, first)]
    return np.concatenate([np.asarray(first, dtype=np.int64), rest])[:top].astype(np.int32)


def build(tokenizer, *, top: int = TOP, records: int | None = None) -> tuple[np.ndarray, dict]:
    """(ranked ids [top] int32, the record of how they were made)."""
    size = len(tokenizer)
    if top > size:
        raise SpeculorError(f"--top {top} is more than the tokenizer's {size} tokens")
    start = time.time()
    sources, total = [], np.zeros(size, dtype=np.int64)
    for name, texts, what in [("sharegpt", sharegpt_replies(records), "gpt turns"),
                              ("humaneval", humaneval_solutions(), "canonical solutions")]:
        counts, n = count_tokens(tokenizer, texts, size)
        dist, version, path = prompts.SOURCES[name]
        sources.append({"package": f"{dist}=={version}", "file": path, "texts": n, "what": what,
                        "tokens": int(counts.sum()), **({"records": records} if name == "sharegpt" else {})})
        total += counts
    specials = special_ids(tokenizer)
    ids = rank(total, specials, top)
    n_all = int(total.sum())
    coverage = {str(k): round(float(total[ids[:k]].sum()) / max(n_all, 1), 5)
                for k in (1024, 4096, 8192, 16384, 32768) if k <= top}
    record = {
        "what": "token ids of the target's tokenizer ranked by frequency (FR-Spec), special tokens first",
        "file": "fr_vocab.npy (int32)", "top": top, "sources": sources, "tokens_counted": n_all,
        "distinct_tokens_seen": int((total > 0).sum()), "special_ids_first": specials,
        "coverage_of_counted_tokens": coverage,
        "tokenizer": {"name": Path(getattr(tokenizer, "name_or_path", "")).name, "size": size,
                      "fingerprint": vocab_fingerprint(tokenizer)},
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "seconds": round(time.time() - start, 1),
        "command": "python -m speculor.methods.fr_vocab " + " ".join(sys.argv[1:]),
    }
    return ids, record


def default_tokenizer():
    """The tokenizer of the embedded default target (tokenizer files only; the model is not loaded)."""
    from transformers import AutoTokenizer

    from speculor.runtime import embedded

    return AutoTokenizer.from_pretrained(embedded.ensure(embedded.DEFAULT_TARGET))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m speculor.methods.fr_vocab", description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help=".npy file; the record goes beside it as .json")
    ap.add_argument("--top", type=int, default=TOP, help="ids kept (default 32768)")
    ap.add_argument("--records", type=int, default=None, help="ShareGPT conversations read (default: all)")
    ap.add_argument("--tokenizer", default=None, help="tokenizer folder (default: the embedded target's)")
    args = ap.parse_args(argv)
    try:
        if args.tokenizer:
            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(args.tokenizer)
        else:
            tokenizer = default_tokenizer()
        ids, record = build(tokenizer, top=args.top, records=args.records)
    except SpeculorError as exc:
        print(f"fr_vocab: error: {exc}", file=sys.stderr)
        return 2
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    np.save(out, ids)
    out.with_suffix(".json").write_text(json.dumps(record, indent=1, ensure_ascii=False) + "\n")
    print(json.dumps({k: record[k] for k in ("tokens_counted", "distinct_tokens_seen", "coverage_of_counted_tokens",
                                             "seconds")}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
