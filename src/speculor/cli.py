"""Command line: `speculor generate | bench | calibrate | profile | train-head | tune-threshold | fetch-models | serve |
loadtest`.
argparse lives here only."""

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
    p.add_argument("--kernels", choices=("fast", "eager"), default="fast",
                   help="fast: the target's matmuls through prepacked oneDNN weights (two copies) and the draft with "
                   "int8 weights (CPU, fp32); eager: plain nn.Linear for both (what the models do by themselves)")


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


def _add_specdecpp_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--threshold", type=float, default=None, help="specdecpp: stop when 1 - prod P̂ > h (default: tuned)")
    p.add_argument("--head", default=None, help="specdecpp: head file (default: the packaged head)")
    p.add_argument("--k-min", type=int, default=None, help="specdecpp: fewest draft tokens per step (default 2)")
    p.add_argument("--k-max", type=int, default=None, help="specdecpp: most draft tokens per step (default 20)")


def _strategy_options(args: argparse.Namespace) -> dict:
    names = ("k", "budget", "depth", "width", "acc", "threshold", "head", "k_min", "k_max")
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
    _add_specdecpp_args(g)
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

    _add_train_head_parser(sub)
    _add_tune_threshold_parser(sub)

    sub.add_parser("fetch-models", help="download and convert the embedded model pair and prompt sets")

    s = sub.add_parser("serve", help="OpenAI-compatible HTTP server")
    s.add_argument("--host", default="127.0.0.1")
    s.add_argument("--port", type=int, default=8000)
    s.add_argument("--strategy", default="chain")
    s.add_argument("--queue-size", type=int, default=64)
    s.add_argument("--k", type=int, default=None, help="draft length of the chain strategy")
    _add_tree_args(s)
    _add_specdecpp_args(s)
    _add_model_args(s)

    lt = sub.add_parser("loadtest", help="latency and throughput of a running server at several concurrencies")
    lt.add_argument("--url", default="http://127.0.0.1:8000")
    lt.add_argument("--clients", default="1,4,16", help="comma-separated concurrencies, one round each")
    lt.add_argument("--requests", type=int, default=1, help="requests per client in a round, one after another")
    lt.add_argument("--max-tokens", type=int, default=32)
    lt.add_argument("--strategy", default=None, help="the request's speculative strategy (default: the server's)")
    lt.add_argument("--out", default=None, help="JSON file for the rows")
    return ap


def _add_train_head_parser(sub) -> None:
    t = sub.add_parser("train-head", help="SpecDec++: build training data on ShareGPT and train the acceptance head",
                       description="Defaults: those of specdecpp.DataConfig and specdecpp.TrainConfig.")
    t.add_argument("--sequences", type=int, help="ShareGPT conversations used (data size; default 64, ~20-40 s each "
                   "on a 2-core CPU, cached and resumable)")
    t.add_argument("--max-len", type=int, help="prompt + reply tokens per sequence (256)")
    t.add_argument("--max-prompt", type=int, help="skip prompts longer than this (128 tokens)")
    t.add_argument("--mixing-ratio", type=float, help="r: share of true reply tokens in Z (0.15)")
    t.add_argument("--heldout", type=float, help="share of sequences held out (0.15)")
    t.add_argument("--layers", type=int, help="residual blocks of the head (3)")
    t.add_argument("--epochs", type=int, help="(8; the best held-out epoch is kept)")
    t.add_argument("--lr", type=float, help="(5e-5)")
    t.add_argument("--batch-size", type=int, help="(256)")
    t.add_argument("--weight", type=float, dest="weight_mismatch", help="w: loss weight of the reject class (6)")
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--out", default=None, help="head file (default: <cache>/specdecpp/head--<draft>.safetensors)")
    t.add_argument("--plot", default=None, help="calibration PNG (default: next to the head)")
    _add_model_args(t)


def _add_tune_threshold_parser(sub) -> None:
    u = sub.add_parser("tune-threshold", help="SpecDec++: pick the stopping threshold h by measured tokens/s")
    u.add_argument("--head", default=None, help="head file (default: the packaged head)")
    u.add_argument("--grid", default="0.5,0.7,0.8,0.9,0.95,0.98", help="comma-separated thresholds to try")
    u.add_argument("--temperatures", default="0,0.7", help="comma-separated; one threshold per temperature")
    u.add_argument("--top-p", type=float, default=1.0)
    u.add_argument("--sets", default="mtbench,humaneval")
    u.add_argument("--prompts", type=int, default=4, help="number of prompts")
    u.add_argument("--skip", type=int, default=6, help="skip the first prompts (the bench's) to keep them apart")
    u.add_argument("--max-new-tokens", type=int, default=48)
    u.add_argument("--k-min", type=int, default=2)
    u.add_argument("--k-max", type=int, default=20)
    u.add_argument("--seed", type=int, default=0)
    u.add_argument("--out", default=None, help="thresholds JSON (default: the cache, where `specdecpp` looks)")
    _add_model_args(u)


def load_pair_from_args(args: argparse.Namespace):
    import torch

    from speculor.models import load_pair

    dtype = torch.bfloat16 if args.device.startswith("cuda") else torch.float32
    draft = None if args.draft == "none" else args.draft
    fast = getattr(args, "kernels", "fast") == "fast"
    return load_pair(args.target, draft, device=args.device, dtype=dtype, packed=fast, draft_int8=fast)


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


def cmd_train_head(args: argparse.Namespace) -> None:
    from pathlib import Path

    from speculor import embedded, specdecpp
    from speculor.assets import cache_dir

    def given(*names: str) -> dict:
        return {n: getattr(args, n) for n in names if getattr(args, n) is not None}

    data_cfg = specdecpp.DataConfig(**given("sequences", "max_len", "max_prompt", "mixing_ratio", "heldout", "seed"))
    train_cfg = specdecpp.TrainConfig(**given("epochs", "batch_size", "lr", "weight_mismatch", "layers", "seed"))
    target = embedded.DEFAULT_TARGET if args.target == "default" else args.target
    draft = embedded.DEFAULT_DRAFT if args.draft == "default" else args.draft
    if draft == "none":
        raise SpeculorError("train-head needs a draft model")
    out = Path(args.out) if args.out else cache_dir() / "specdecpp" / f"head--{Path(draft).name}.safetensors"
    plot = Path(args.plot) if args.plot else out.with_suffix(".calibration.png")
    # loaded as in the engine: the draft with int8 weights, the target with prepacked blocks (2x faster on 100+ rows)
    record = specdecpp.train_and_save(lambda: load_pair_from_args(args), target, draft, data_cfg, train_cfg, out, plot)
    loss, data = record["loss"], record["training"]["data"]
    print(f"data: {data['train_sequences']} + {data['heldout_sequences']} sequences, {data['train_positions']} train "
          f"/ {data['heldout_positions']} held-out positions ({data['cache']})")
    print(f"weighted loss (w = {loss['weight_mismatch']:g}): train {loss['train']:.4f}, held-out {loss['heldout']:.4f}"
          f" (best epoch {record['training']['best_epoch']})")
    print(f"calibration error vs the w-optimum {record['calibration']['error_vs_w_optimum']:.3f}")
    print(f"saved {out} (+ .json) and {plot}")


def cmd_tune_threshold(args: argparse.Namespace) -> None:
    from pathlib import Path

    from speculor import prompts, specdecpp
    from speculor.api import Speculor
    from speculor.config import SamplingConfig

    grid = [float(h) for h in args.grid.split(",")]
    temps = [float(t) for t in args.temperatures.split(",")]
    if args.prompts < 1 or args.skip < 0:
        raise SpeculorError("--prompts must be >= 1 and --skip >= 0")
    sp = Speculor(load_pair_from_args(args), strategy="specdecpp", head=args.head, k_min=args.k_min,
                  k_max=args.k_max)
    chosen = prompts.load(args.sets.split(","), args.skip + args.prompts)[args.skip:]
    ids = [sp.encode(p.text, chat=p.chat) for p in chosen]
    head_path = Path(args.head).expanduser() if args.head else specdecpp.HEAD_FILE
    sha = specdecpp.file_sha256(head_path)
    path = Path(args.out) if args.out else specdecpp.threshold_path(sha)
    for temp in temps:
        cfg = SamplingConfig(temperature=temp, top_p=args.top_p if temp > 0 else 1.0, seed=args.seed,
                             max_new_tokens=args.max_new_tokens)
        result = specdecpp.tune_threshold(sp, ids, cfg, grid, head=args.head, k_min=args.k_min, k_max=args.k_max)
        specdecpp.save_threshold(path, sha, temp, result | {"sets": args.sets, "skip": args.skip})
        for h, row in result["grid"].items():
            print(f"T={temp:g} h={h}: {row['tokens_per_s']:.2f} tokens/s, tau {row['tau']:.2f}, "
                  f"mean K {row['mean_k']:.2f}")
        print(f"T={temp:g}: threshold {result['threshold']:g}")
    print(f"saved {path}")


def cmd_fetch_models(args: argparse.Namespace) -> None:
    from speculor import embedded, prompts

    prompts.fetch()
    for name in embedded.EMBEDDED:
        print(embedded.ensure(name, download=True))


def cmd_serve(args: argparse.Namespace) -> None:
    from speculor.server import serve

    serve(load_pair_from_args(args), host=args.host, port=args.port, strategy=args.strategy,
          queue_size=args.queue_size, **_strategy_options(args))


def cmd_loadtest(args: argparse.Namespace) -> None:
    from pathlib import Path

    from speculor import loadtest, prompts

    texts = [p.text for p in prompts.load(["mtbench", "humaneval"], 16)]
    spec = {"strategy": args.strategy} if args.strategy else None
    rows = loadtest.run(args.url, texts, [int(c) for c in args.clients.split(",")], requests=args.requests,
                        max_tokens=args.max_tokens, speculative=spec)
    print(loadtest.format_rows(rows))
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=1) + "\n")


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
            "train-head": cmd_train_head, "tune-threshold": cmd_tune_threshold, "fetch-models": cmd_fetch_models,
            "serve": cmd_serve, "loadtest": cmd_loadtest}


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
