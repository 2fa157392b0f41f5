"""What each `speculor` command does, given its parsed arguments (the parser is cli.py's: argparse lives there).

Every heavy import (torch, transformers, the models) is made inside the command that needs it, so `speculor --help`
and `speculor loadtest` start without them.
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any

from speculor.errors import SpeculorError

Args = Any  # the argparse.Namespace of the command

# The registered strategies and, per strategy option of `generate` and `serve`, the strategies that take it, as
# `speculor.drafters.registry` says (BUILDERS, options_of; tests/test_cli.py checks that they agree). Spelled out
# here so that `--help` needs no import of the registry, which imports torch.
STRATEGIES = ("plain", "chain", "sequoia", "specinfer", "ngram", "specdecpp", "dyspec", "topk-tree", "gsd", "eagle",
              "suffix")
TAKEN_BY = {
    "k": ("chain", "ngram", "topk-tree", "gsd"),
    "budget": ("sequoia", "ngram", "specdecpp", "dyspec", "topk-tree", "gsd", "eagle", "suffix"),
    "depth": ("sequoia", "dyspec", "topk-tree", "gsd", "eagle"),
    "width": ("sequoia",),
    "acc": ("sequoia",),
    "threshold": ("specdecpp", "dyspec", "eagle"),
    "head": ("specdecpp",),
    "heads": ("specinfer", "eagle"),
    "k_min": ("specdecpp",),
    "k_max": ("specdecpp",),
}

def check_options(strategy: str, options: dict) -> None:
    """The registry's check of a strategy's name and options, run before a model is loaded (imports torch)."""
    from speculor.drafters.registry import check_options as check

    check(strategy, options)


def _strategy_options(args: Args) -> dict:
    """The strategy options given on the command line (argparse dest names, e.g. k_min), checked against what
    args.strategy takes. Options not given are left out, so that the strategy's own defaults apply."""
    given = {n: getattr(args, n) for n in TAKEN_BY if getattr(args, n, None) is not None}
    check_options(args.strategy, given)
    return given


def torch_dtype(args: Args):
    """--dtype as a torch dtype; auto: bfloat16 on cuda, float32 on cpu."""
    import torch

    name = getattr(args, "dtype", "auto")
    if name == "auto":
        name = "bfloat16" if args.device.startswith("cuda") else "float32"
    return getattr(torch, name)


def load_pair_from_args(args: Args):
    from speculor.runtime.loading import load_pair

    draft = None if args.draft == "none" else args.draft
    kernels = getattr(args, "kernels", "fast")
    fast = kernels == "fast"
    return load_pair(args.target, draft, device=args.device, dtype=torch_dtype(args), packed=fast,
                     draft_int8=fast, draft_vocab=getattr(args, "draft_vocab", None),
                     offload=getattr(args, "offload", False), backend=getattr(args, "backend", "auto"),
                     threads=getattr(args, "threads", None), calls=getattr(args, "calls", "exact"))


def cmd_generate(args: Args) -> None:
    from speculor.api import Speculor
    from speculor.config import SamplingConfig

    options = _strategy_options(args)  # refused before the pair is loaded
    cfg = SamplingConfig(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seed=args.seed,
                         max_new_tokens=args.max_new_tokens, stop=tuple(args.stop), min_p=args.min_p,
                         presence_penalty=args.presence_penalty, frequency_penalty=args.frequency_penalty,
                         repetition_penalty=args.repetition_penalty, logit_bias=_logit_bias(args.logit_bias),
                         logprobs=args.logprobs)
    sp = Speculor(load_pair_from_args(args), strategy=args.strategy, **options)
    if args.json:
        out = sp.generate(args.prompt, cfg, chat=args.chat)
        body = {"text": out.text, "token_ids": out.token_ids, "tau": out.tau, "tokens_per_s": out.tokens_per_s,
                "steps": len(out.stats.steps), "finish_reason": out.finish_reason}
        if cfg.logprobs is not None:
            body["logprobs"] = [{"token": t.id, "logprob": t.logprob, "top": [list(a) for a in t.top]}
                                for t in out.tokens]
        print(json.dumps(body))
        _print_peak_memory(sp.pair.target.device)
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
    _print_peak_memory(sp.pair.target.device)


def _logit_bias(items: list[str]) -> dict[int, float]:
    """--logit-bias ID=BIAS, repeated, as {id: bias}."""
    from speculor.errors import SpeculorError

    bias = {}
    for item in items:
        token, _, value = item.partition("=")
        try:
            bias[int(token)] = float(value)
        except ValueError as exc:
            raise SpeculorError(f"--logit-bias takes ID=BIAS (e.g. 42=-100), got {item!r}") from exc
    return bias


def _print_peak_memory(device) -> None:
    """One stderr line: the process's peak memory so far (loading included; runtime/memory.py says what it counts)."""
    from speculor.runtime.memory import peak_memory_gib

    peak = peak_memory_gib(device)
    where = "GPU memory (torch's allocator)" if device.type == "cuda" else "resident memory"
    print(f"peak {where}: " + ("unknown on this OS" if peak is None else f"{peak:.2f} GiB"), file=sys.stderr)


def cmd_train_head(args: Args) -> None:
    from pathlib import Path

    from speculor.methods.specdecpp_data import DataConfig
    from speculor.methods.specdecpp_train import TrainConfig, train_and_save
    from speculor.runtime import embedded
    from speculor.runtime.assets import cache_dir

    def given(*names: str) -> dict:
        return {n: getattr(args, n) for n in names if getattr(args, n) is not None}

    data_cfg = DataConfig(**given("sequences", "max_len", "max_prompt", "mixing_ratio", "heldout", "seed"))
    train_cfg = TrainConfig(**given("epochs", "batch_size", "lr", "weight_mismatch", "layers", "seed"))
    target, draft = embedded.named(args.target, args.draft)
    if draft == "none":
        raise SpeculorError("train-head needs a draft model")
    out = Path(args.out) if args.out else cache_dir() / "specdecpp" / f"head--{Path(draft).name}.safetensors"
    plot = Path(args.plot) if args.plot else out.with_suffix(".calibration.png")
    # loaded as in the engine: the draft with int8 weights, the target with prepacked blocks (2x faster on 100+ rows)
    record = train_and_save(lambda: load_pair_from_args(args), target, draft, data_cfg, train_cfg, out, plot)
    loss, data = record["loss"], record["training"]["data"]
    print(f"data: {data['train_sequences']} + {data['heldout_sequences']} sequences, {data['train_positions']} train "
          f"/ {data['heldout_positions']} held-out positions ({data['cache']})")
    print(f"weighted loss (w = {loss['weight_mismatch']:g}): train {loss['train']:.4f}, held-out {loss['heldout']:.4f}"
          f" (best epoch {record['training']['best_epoch']})")
    print(f"calibration error vs the w-optimum {record['calibration']['error_vs_w_optimum']:.3f}")
    print(f"saved {out} (+ .json) and {plot}")


def cmd_boost_tune(args: Args) -> None:
    """SpecInfer's boost-tuning of a pool of EAGLE-style heads (methods/boost_tune.py)."""
    import datetime
    import platform
    import shlex
    from pathlib import Path

    import torch

    from speculor.methods import boost_data as bd
    from speculor.methods import boost_tune as bt
    from speculor.runtime import embedded
    from speculor.runtime.assets import cache_dir, slug
    from speculor.runtime.eagle_head import EagleConfig

    args.target = embedded.named(args.target, None)[0]
    if args.prepared:
        data = torch.load(args.prepared)
    else:
        from speculor.runtime.loading import load_tokenizer

        data = bd.prepare(load_tokenizer(args.target), conversations=args.conversations, max_len=args.max_len,
                          selfgen=args.selfgen, heldout=args.heldout, vocab=args.vocab)
    if args.save_prepared:
        torch.save(data, args.save_prepared)
        print(f"saved the prepared ids to {args.save_prepared}: {len(data['train'])} conversations, "
              f"{sum(len(i) for i, _ in data['train'])} tokens, {len(data['selfgen'])} self-generation prompts")
        return
    dtype = torch_dtype(args)
    torch.backends.cuda.matmul.allow_tf32 = True
    source, draft = _feature_source(args, dtype)
    if args.evaluate:
        from speculor.runtime.eagle_head import load_pool

        heads, _ = load_pool(Path(args.evaluate))
        table = bt.evaluate_pool(source, data, heads, answer_tokens=args.answer_tokens, draft=draft)
        print(json.dumps(table, indent=1))
        return
    cfg = EagleConfig(source.hidden_size, width=args.width, ffn=args.ffn, blocks=args.blocks, vocab=len(data["ids"]))
    train = bt.TrainConfig(steps=args.steps, batch=args.batch, lr=args.lr, hit_weight=args.hit_weight,
                           seconds=args.minutes * 60 if args.minutes else None)
    device = torch.cuda.get_device_name() if args.device.startswith("cuda") else platform.processor() or "cpu"
    plan = bt.Plan(cfg, train, ssms=args.ssms, seed=args.seed, manifest={
        "what": "a pool of EAGLE-style heads boost-tuned on the target's own distribution (SpecInfer)",
        "target": args.target, "feature_source": args.feature_source, "dtype": str(dtype).removeprefix("torch."),
        "where": f"{device}, torch {torch.__version__}", "made": datetime.date.today().isoformat(),
        "command": "speculor " + shlex.join(getattr(args, "argv", ["boost-tune"]))})
    torch.manual_seed(args.seed)
    out = Path(args.out) if args.out else cache_dir() / "boosted" / slug(Path(args.target).name)
    manifest = bt.run(source, data, plan, out, answer_tokens=args.answer_tokens, dtype=dtype,
                      draft=draft, selfgen_tokens=args.selfgen_tokens)
    print(json.dumps(manifest["heldout"], indent=1))
    print(f"saved the pool of {args.ssms} heads to {out} ({manifest['seconds']:.0f} s): use it with --heads {out}")


def _feature_source(args: Args, dtype):
    """(the target's feature source, a draft model to compare with or None)."""
    import torch

    from speculor.methods import boost_data as bd
    from speculor.runtime import embedded

    if args.feature_source == "transformers":
        from speculor.runtime.loading import load_model

        model, _ = load_model(args.target, device=args.device, dtype=dtype)
        for p in model.parameters():
            p.requires_grad_(False)
        return bd.HFSource(model, tokens_per_batch=args.tokens_per_batch), None
    from speculor.runtime.llama import LlamaModel
    from speculor.runtime.loading import gguf_file

    threads = args.threads or torch.get_num_threads()
    target = LlamaModel(gguf_file(args.target), threads=threads)
    draft = None if args.draft == "none" else LlamaModel(gguf_file(embedded.named("default", args.draft)[1]),
                                                         threads=threads)
    return bd.BackendSource(target), draft


def cmd_tune_threshold(args: Args) -> None:
    from pathlib import Path

    from speculor.api import Speculor
    from speculor.bench import prompts
    from speculor.config import SamplingConfig
    from speculor.drafters import specdecpp
    from speculor.methods.specdecpp_train import tune_threshold

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
        result = tune_threshold(sp, ids, cfg, grid, head=args.head, k_min=args.k_min, k_max=args.k_max)
        specdecpp.save_threshold(path, sha, temp, result | {"sets": args.sets, "skip": args.skip})
        for h, row in result["grid"].items():
            print(f"T={temp:g} h={h}: {row['tokens_per_s']:.2f} tokens/s, tau {row['tau']:.2f}, "
                  f"mean K {row['mean_k']:.2f}")
        print(f"T={temp:g}: threshold {result['threshold']:g}")
    print(f"saved {path}")


def cmd_fetch_models(args: Args) -> None:
    from speculor.bench import prompts
    from speculor.runtime import embedded

    prompts.fetch()
    for name in embedded.EMBEDDED:
        print(embedded.ensure(name, download=True))


def cmd_serve(args: Args) -> None:
    from speculor.cli import RAY_ARGS
    from speculor.serving.app import DEFAULT_STRATEGY, serve

    given = [name for name in RAY_ARGS if getattr(args, name, None) is not None]
    if given and not (args.ray or args.ray_address):
        raise SpeculorError(f"--{given[0].replace('_', '-')} is a Ray Serve option: add --ray")
    default = args.strategy is None
    if default:  # the batch-aware strategy
        args.strategy = DEFAULT_STRATEGY[0]
    options = _strategy_options(args)  # refused before the pair is loaded (or Ray started)
    if args.ray or args.ray_address:  # the same app on Ray Serve, replicas loading the pair
        from speculor.serving.ray_serve import serve_cli

        return serve_cli(args, None if default else args.strategy, options, given)
    pair = load_pair_from_args(args)
    if default and pair.draft_tokenizer is None:
        options = {**DEFAULT_STRATEGY[1], **options}
    elif default:  # a draft with another tokenizer: create_app's own default (chain through text)
        args.strategy = None
    serve(pair, host=args.host, port=args.port, strategy=args.strategy, queue_size=args.queue_size,
          max_batch=args.max_batch, **options)


def cmd_loadtest(args: Args) -> None:
    from pathlib import Path

    from speculor.bench import loadtest, peer_server, prompts  # httpx and the prompt sets: no torch

    try:
        clients = [int(c) for c in args.clients.split(",")]
    except ValueError:
        raise SpeculorError(f"--clients takes comma-separated integers, got {args.clients!r}") from None
    if args.threads is not None and args.threads < 1:
        raise SpeculorError("--threads must be >= 1")
    if args.peer:  # found before our rounds, started after them
        binary, gguf = peer_server.find_binary(args.llama_server), peer_server.target_gguf(args.gguf)
    texts = [p.text for p in prompts.load(args.sets.split(","), args.limit)]
    kw = dict(requests=args.requests, max_tokens=args.max_tokens)
    rows, ours = loadtest.series(args.url, texts, clients, args.strategy, reference=args.reference or bool(args.peer),
                                 **kw)
    if args.peer:
        threads = args.threads or os.cpu_count() or 1
        log = Path(args.out).with_suffix(".llama-server.log") if args.out else None
        peer_rows, theirs = peer_server.rounds(args.peer, binary, gguf, texts, clients, threads=threads, log=log, **kw)
        rows = loadtest.versus(rows, peer_rows)
        same, asked = loadtest.same_answers(ours, theirs)
        print(f"one-client answers equal between speculor and {args.peer}: {same} of {asked} prompts "
              f"({gguf.name}, {threads} threads)", file=sys.stderr)
    print(loadtest.format_rows(rows))
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=1) + "\n")
        loadtest.plot_rows(rows, Path(args.out).with_suffix(".png"))


def cmd_bench(args: Args) -> None:
    from speculor.bench.config import BenchConfig
    from speculor.bench.peers import PEERS
    from speculor.bench.run import run

    cfg = BenchConfig.from_args(args)
    for spec in cfg.strategies:  # refused before the pair is loaded
        if spec.name in PEERS:
            if spec.options:
                raise SpeculorError(f"{spec.label!r}: the peer {spec.name!r} takes no options")
        else:
            check_options(spec.name, spec.options)
    run(cfg, lambda: load_pair_from_args(args))


def cmd_calibrate(args: Args) -> None:
    from pathlib import Path

    from speculor.api import Speculor
    from speculor.bench import prompts
    from speculor.config import SamplingConfig
    from speculor.drafters.sequoia import calibration_path
    from speculor.methods.sequoia_calibration import calibrate

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
        cal = calibrate(sp.pair, ids, cfg, width=args.width, steps=args.steps, eos_ids=sp.eos_ids,
                                sets=args.sets)
        path = Path(args.out) if args.out else calibration_path(cal.target, cal.draft, temp, cfg.top_p)
        cal.save(path)
        acc = ", ".join(f"{a:.3f}" for a in cal.acc)
        print(f"T={temp:g} top_p={cfg.top_p:g}: {cal.steps} steps, sum = {sum(cal.acc):.3f}, acc = [{acc}]")
        print(f"saved {path}")


def cmd_profile(args: Args) -> None:
    """t(n) for n = 1..16 of each backend (--backend auto: every candidate), the ceiling a free drafter could give
    with the measured acceptance, and the Sequoia tree the curve picks."""
    import gc

    from speculor.runtime.choice import candidates

    if args.backend != "auto":
        _profile_one(args, args.backend)
        return
    from speculor.runtime.embedded import named

    target, draft = named(args.target, None if args.draft == "none" else args.draft)
    for name in candidates(target, draft, args.device):
        _profile_one(args, name)
        gc.collect()


def _profile_one(args: Args, backend: str) -> None:
    from speculor.bench.cost_report import report
    from speculor.runtime.cost import CostModel, cost_path, profile_cost

    args.backend = backend
    pair = load_pair_from_args(args)
    path = cost_path(pair)
    if args.force or not path.exists():
        profile_cost(pair, repeats=args.repeats).save(path)
    report(pair, CostModel.load(path), path, [float(t) for t in args.temperatures.split(",")], args.depth, args.width)
