"""`speculor generate`: one prompt's text, streamed (or one JSON object)."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from speculor import commands
from speculor.commands import Args
from speculor.errors import SpeculorError
from speculor.grammar.compile import Constraint


def run(args: Args) -> None:
    from speculor.api import Speculor
    from speculor.config import SamplingConfig

    options = commands.strategy_options(args)  # refused before the pair is loaded
    cfg = SamplingConfig(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seed=args.seed,
                         max_new_tokens=args.max_new_tokens, stop=tuple(args.stop), min_p=args.min_p,
                         presence_penalty=args.presence_penalty, frequency_penalty=args.frequency_penalty,
                         repetition_penalty=args.repetition_penalty, logit_bias=_logit_bias(args.logit_bias),
                         logprobs=args.logprobs)
    constraint = _constraint(args)
    sp = Speculor(commands.load(args), strategy=args.strategy, **options)
    if constraint is not None:
        sp.grammar(constraint)  # a constraint that does not compile is refused before decoding
    if args.json:
        out = sp.generate(args.prompt, cfg, chat=args.chat, constraint=constraint)
        body = {"text": out.text, "token_ids": out.token_ids, "tau": out.tau, "tokens_per_s": out.tokens_per_s,
                "steps": len(out.stats.steps), "finish_reason": out.finish_reason}
        if cfg.logprobs is not None:
            body["logprobs"] = [{"token": t.id, "logprob": t.logprob, "top": [list(a) for a in t.top]}
                                for t in out.tokens]
        print(json.dumps(body))
        commands.print_peak_memory(sp.pair.target.device)
        return
    from speculor.engine import Stats

    stats, n, t0 = Stats(), 0, time.perf_counter()
    for delta, toks in sp.stream_text(args.prompt, cfg, chat=args.chat, stats=stats, constraint=constraint):
        n += len(toks)
        sys.stdout.write(delta)
        sys.stdout.flush()
    dt = time.perf_counter() - t0
    print(f"\n\n[{args.strategy}] {n} tokens in {dt:.2f} s: {n / dt:.2f} tokens/s, tau = {stats.tau:.2f}",
          file=sys.stderr)
    commands.print_peak_memory(sp.pair.target.device)


def _constraint(args: Args) -> Constraint | None:
    """--json-schema FILE or --grammar FILE (GBNF, or Lark for a .lark file) as a constraint."""
    path = args.json_schema or args.grammar
    if path is None:
        return None
    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise SpeculorError(f"cannot read {path}: {exc.strerror}") from exc
    if args.grammar:
        return Constraint("lark" if path.endswith(".lark") else "gbnf", text)
    try:
        return Constraint.json_schema(json.loads(text))
    except json.JSONDecodeError as exc:
        raise SpeculorError(f"{path} is not JSON: {exc}") from exc


def _logit_bias(items: list[str]) -> dict[int, float]:
    """--logit-bias ID=BIAS, repeated, as {id: bias}."""
    bias = {}
    for item in items:
        token, _, value = item.partition("=")
        try:
            bias[int(token)] = float(value)
        except ValueError as exc:
            raise SpeculorError(f"--logit-bias takes ID=BIAS (e.g. 42=-100), got {item!r}") from exc
    return bias
