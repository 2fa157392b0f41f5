"""`speculor refit-priors`: the priors of data/priors.json recomputed from plain answers of bench runs
(drafters/refit.py), the file written for a person to review."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path

from speculor.commands import Args
from speculor.errors import SpeculorError


def run(args: Args) -> None:
    import datetime
    import json

    from speculor.core import priors
    from speculor.drafters import refit
    from speculor.runtime import embedded

    source = Path(args.priors).expanduser() if args.priors else priors.path()
    out = Path(args.out).expanduser() if args.out else source
    document = json.loads(source.read_text(encoding="utf-8"))
    tokenizer = Path(args.tokenizer).expanduser() if args.tokenizer else embedded.model_dir(embedded.DEFAULT_TARGET)
    runs, sets = load_runs(args.records, args.questions, encoder(tokenizer), args.temperature)
    answers = sum(len(r) for r in runs)
    print(f"{answers} plain answers at T = {args.temperature:g} ({', '.join(sets)}) in {len(runs)} runs")

    entries = document["priors"]
    fitted = {"set": f"plain answers (round 0, T = {args.temperature:g}) of {', '.join(sets)}, one run a file",
              "records": list(args.records), "machine": args.machine, "command": "speculor " + " ".join(args.argv),
              "date": datetime.date.today().isoformat(), "commit": _commit()}
    entries["suffix.trust_0"], changes = refit.refit_trust(entries["suffix.trust_0"], refit.suffix_cells(runs),
                                                           fitted)
    print(f"suffix.trust_0: {len(changes)} cells changed" if changes else "suffix.trust_0: unchanged")
    for line in changes:
        print(f"  {line}")
    means = [hit / (hit + miss) for hit, miss in entries["ngram.prior"]["value"]]
    print("ngram.prior: not refit (data/priors.json says why); measured, per matched length m:")
    for m, (c, mean) in enumerate(zip(refit.ngram_copies(runs), means, strict=False), 1):
        a = "-" if c.acceptance is None else f"{c.acceptance:.4f}"
        first = "-" if c.first_rate is None else f"{c.first_rate:.4f}"
        print(f"  m = {m}: a = {a}, first token {first}, {c.steps} steps (the prior's mean {mean:g})")
    for name, entry in entries.items():
        if name not in ("suffix.trust_0", "ngram.prior"):
            print(f"{name}: {entry['refit']}")
    if args.dry_run:
        print("nothing written (--dry-run)")
        return
    out.write_text(priors.dumps(document), encoding="utf-8")
    print(f"saved {out}")


def encoder(folder: Path) -> Callable:
    """A prompt's token ids as the bench gave them to the target: its chat template for a chat prompt, the raw text
    otherwise (scripts/drafts/replay.py)."""
    from transformers import AutoTokenizer

    if not (folder / "tokenizer_config.json").exists() and not (folder / "tokenizer.json").exists():
        raise SpeculorError(f"no tokenizer in {folder}: give --tokenizer (the target's model folder), or run "
                            "`speculor fetch-models` for the embedded target's")
    tok = AutoTokenizer.from_pretrained(str(folder))

    def encode(prompt) -> list[int]:  # noqa: ANN001 (a bench Prompt)
        if not prompt.chat:
            return tok(prompt.text)["input_ids"]
        ids = tok.apply_chat_template([{"role": "user", "content": prompt.text}], add_generation_prompt=True,
                                      tokenize=True)
        return list(ids["input_ids"] if hasattr(ids, "keys") else ids)

    return encode


def load_runs(files: Sequence[str], questions: Sequence[str], encode: Callable,
              temperature: float) -> tuple[list[list[tuple[list[int], list[int]]]], list[str]]:
    """Each records file's plain answers of round 0 at `temperature` as one run of (prompt ids, answer ids), in the
    file's order; the prompts from the built-in sets the records name and from the `questions` files. Also the sets'
    names."""
    import json

    from speculor.bench import prompts

    rows = []
    for f in files:
        try:
            lines = Path(f).read_text(encoding="utf-8").splitlines()
        except OSError as exc:
            raise SpeculorError(f"cannot read records {f}: {exc}") from None
        rows.append([r for r in map(json.loads, filter(str.strip, lines)) if r.get("strategy") == "plain"
                     and r.get("round", 0) == 0 and r.get("temperature") == temperature])
    sets = sorted({r["set"] for run in rows for r in run})
    known = {p.id: p for s in sets if s in prompts.LOADERS for p in prompts.load([s])}
    known |= {p.id: p for q in questions for p in prompts.file_set(Path(q))}
    missing = sorted({r["prompt_id"] for run in rows for r in run} - set(known))
    if missing:
        raise SpeculorError(f"prompts not found: {', '.join(missing[:5])}{' ...' if len(missing) > 5 else ''}; give "
                            "the prompt files they came from with --questions")
    if not any(rows):
        raise SpeculorError(f"no plain answers of round 0 at T = {temperature:g} in the records given")
    ids = {}
    for pid in {r["prompt_id"] for run in rows for r in run}:
        ids[pid] = encode(known[pid])
    return [[(ids[r["prompt_id"]], r["token_ids"]) for r in run] for run in rows], sets


def _commit() -> str:
    """The checkout's commit the drafters ran from (and whether it had changes), or 'unknown'."""
    import subprocess

    import speculor

    here = Path(speculor.__file__).parent
    try:
        head = subprocess.run(["git", "-C", str(here), "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, timeout=10, check=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(here), "status", "--porcelain", "--", "."], capture_output=True,
                               text=True, timeout=10, check=True).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return f"{head}{' with uncommitted changes' if dirty else ''}"
