"""Command line: `speculor generate | bench | calibrate | profile | fetch-models | serve`. argparse lives here only."""

from __future__ import annotations

import argparse
import json
import sys
import time

from speculor.errors import SpeculorError


def _add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--target", default="default", help="target model: 'default', a folder, a .gguf file")
    p.add_argument("--draft", default="default", help="draft model: 'default', a folder, a .gguf file, 'none'")
    p.add_argument("--device", default="cpu", help="cpu or cuda (bf16 on cuda, fp32 on cpu)")


def _add_sampling_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--max-new-tokens", type=int, default=128)


def _budget(text: str) -> int | str:
    return text if text == "auto" else int(text)


def _add_tree_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--budget", type=_budget, default=None, help="sequoia: draft tokens per step, or 'auto'")
    p.add_argument("--depth", type=int, default=None, help="sequoia: most draft tokens on a path")
    p.add_argument("--width", type=int, default=None, help="sequoia: most children per node")
    p.add_argument("--acc", default=None, help="sequoia: calibration JSON (default: cached, else built-in)")


def _strategy_options(args: argparse.Namespace) -> dict:
    names = ("k", "budget", "depth", "width", "acc")
    return {n: getattr(args, n) for n in names if getattr(args, n, None) is not None}


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="speculor", description="Lossless speculative decoding with token trees.")
    sub = ap.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="generate text for one prompt, streaming it")
    g.add_argument("--prompt", required=True)
    g.add_argument("--strategy", default="chain")
    g.add_argument("--k", type=int, default=None, help="draft length of the chain strategy")
    g.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    g.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    g.add_argument("--json", action="store_true", help="print one JSON object instead of streaming")
    _add_tree_args(g)
    _add_model_args(g)
    _add_sampling_args(g)

    b = sub.add_parser("bench", help="benchmark strategies against plain decoding on real prompts")
    from speculor.bench import add_arguments
    add_arguments(b)
    _add_model_args(b)

    c = sub.add_parser("calibrate", help="measure Sequoia's acceptance vector for a model pair (cached)")
    c.add_argument("--temperatures", default="0,0.7", help="comma-separated; 0 = greedy matching of top-W")
    c.add_argument("--top-p", type=float, default=1.0)
    c.add_argument("--width", type=int, default=16, help="children drafted per step (W)")
    c.add_argument("--prompts", type=int, default=12, help="number of prompts")
    c.add_argument("--steps", type=int, default=24, help="steps per prompt")
    c.add_argument("--sets", default="mtbench,humaneval")
    c.add_argument("--seed", type=int, default=0)
    c.add_argument("--out", default=None, help="JSON file (default: the cache, where `sequoia` looks)")
    _add_model_args(c)

    pr = sub.add_parser("profile", help="time target and draft forwards on this machine; show the auto tree")
    pr.add_argument("--repeats", type=int, default=3)
    pr.add_argument("--force", action="store_true", help="profile again even if a profile is cached")
    pr.add_argument("--temperatures", default="0,0.7", help="show the chosen tree at these temperatures")
    pr.add_argument("--depth", type=int, default=8)
    pr.add_argument("--width", type=int, default=8)
    _add_model_args(pr)

    sub.add_parser("fetch-models", help="download and convert the embedded model pair and prompt sets")

    s = sub.add_parser("serve", help="OpenAI-compatible HTTP server")
    s.add_argument("--host", default="127.0.0.1")
    s.add_argument("--port", type=int, default=8000)
    s.add_argument("--strategy", default="chain")
    s.add_argument("--queue-size", type=int, default=64)
    s.add_argument("--k", type=int, default=None, help="draft length of the chain strategy")
    _add_tree_args(s)
    _add_model_args(s)
    return ap


def load_pair_from_args(args: argparse.Namespace):
    import torch

    from speculor.models import load_pair

    dtype = torch.bfloat16 if args.device.startswith("cuda") else torch.float32
    draft = None if args.draft == "none" else args.draft
    return load_pair(args.target, draft, device=args.device, dtype=dtype)


def cmd_generate(args: argparse.Namespace) -> None:
    from speculor.api import Speculor
    from speculor.config import SamplingConfig

    cfg = SamplingConfig(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seed=args.seed,
                         max_new_tokens=args.max_new_tokens, stop=tuple(args.stop))
    sp = Speculor(load_pair_from_args(args), strategy=args.strategy, **_strategy_options(args))
    if args.json:
        out = sp.generate(args.prompt, cfg, chat=args.chat)
        print(json.dumps({"text": out.text, "token_ids": out.token_ids, "tau": out.tau,
                          "tokens_per_s": out.tokens_per_s, "steps": len(out.stats.steps),
                          "finish_reason": out.finish_reason}))
        return
    from speculor.engine import Stats

    stats, n, t0 = Stats(), 0, time.perf_counter()
    for delta, toks in sp.stream_text(args.prompt, cfg, chat=args.chat, stats=stats):
        n += len(toks)
        sys.stdout.write(delta)
        sys.stdout.flush()
    dt = time.perf_counter() - t0
    print(f"\n\n[{args.strategy}] {n} tokens in {dt:.2f} s: {n / dt:.2f} tokens/s, tau = {stats.tau:.2f}",
          file=sys.stderr)


def cmd_fetch_models(args: argparse.Namespace) -> None:
    from speculor import embedded, prompts

    prompts.fetch()
    for name in embedded.EMBEDDED:
        print(embedded.ensure(name, download=True))


def cmd_serve(args: argparse.Namespace) -> None:
    from speculor.server import serve

    serve(load_pair_from_args(args), host=args.host, port=args.port, strategy=args.strategy,
          queue_size=args.queue_size, **_strategy_options(args))


def cmd_bench(args: argparse.Namespace) -> None:
    from speculor.bench import run

    run(args, load_pair_from_args)


def cmd_calibrate(args: argparse.Namespace) -> None:
    from pathlib import Path

    from speculor import prompts, sequoia
    from speculor.api import Speculor
    from speculor.config import SamplingConfig

    temps = [float(t) for t in args.temperatures.split(",")]
    if args.width < 1 or args.prompts < 1 or args.steps < 1:
        raise SpeculorError("--width, --prompts and --steps must be >= 1")
    if args.out and len(temps) > 1:
        raise SpeculorError("--out takes one temperature")
    sp = Speculor(load_pair_from_args(args), strategy="plain")
    chosen = prompts.load(args.sets.split(","), args.prompts)
    ids = [sp.encode(p.text, chat=p.chat) for p in chosen]
    for temp in temps:
        cfg = SamplingConfig(temperature=temp, top_p=args.top_p if temp > 0 else 1.0, seed=args.seed)
        cal = sequoia.calibrate(sp.pair, ids, cfg, width=args.width, steps=args.steps, eos_ids=sp.eos_ids,
                                sets=args.sets)
        path = Path(args.out) if args.out else sequoia.calibration_path(cal.target, cal.draft, temp, cfg.top_p)
        cal.save(path)
        acc = ", ".join(f"{a:.3f}" for a in cal.acc)
        print(f"T={temp:g} top_p={cfg.top_p:g}: {cal.steps} steps, sum = {sum(cal.acc):.3f}, acc = [{acc}]")
        print(f"saved {path}")


def cmd_profile(args: argparse.Namespace) -> None:
    from speculor import sequoia
    from speculor.config import SamplingConfig

    pair = load_pair_from_args(args)
    path = sequoia.cost_path(pair)
    if args.force or not path.exists():
        sequoia.profile_cost(pair, repeats=args.repeats).save(path)
    cost = sequoia.CostModel.load(path)
    print(f"cost model: {path}")
    print("  n   target_s  t(n)/t(1)  draft_s  d(n)/d(1)")
    for n, t, d in zip(cost.target_n, cost.target_s, cost.draft_s, strict=False):
        print(f"{n:4d}  {t:8.3f}  {t / cost.target_s[0]:8.2f}  {d:8.3f}  {d / cost.draft_s[0]:8.2f}")
    opts = sequoia.SequoiaOptions("auto", args.depth, args.width)
    for temp in (float(t) for t in args.temperatures.split(",")):
        acc, source = sequoia.resolve_acc(None, pair.target_name, pair.draft_name, SamplingConfig(temperature=temp))
        c = sequoia.plan_tree(acc, opts, cost)[2]
        print(f"T={temp:g} (acc: {source}): n = {c.n} nodes with the root, {c.d} levels, widths "
              f"{sequoia.level_widths(c.shape)}, F = {c.expected_tokens:.2f} tokens/step, {c.step_s:.3f} s/step, "
              f"{c.tokens_per_s:.2f} tokens/s predicted (plain {1 / cost.t_target(1):.2f})")
        print(f"  shape = {list(c.shape)}")


COMMANDS = {"generate": cmd_generate, "bench": cmd_bench, "calibrate": cmd_calibrate, "profile": cmd_profile,
            "fetch-models": cmd_fetch_models, "serve": cmd_serve}


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        COMMANDS[args.command](args)
    except SpeculorError as exc:
        print(f"speculor: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
