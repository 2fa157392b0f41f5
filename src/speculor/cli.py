"""Command line: `speculor generate | bench | fetch-models | serve`. argparse lives here only."""

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
    _add_model_args(g)
    _add_sampling_args(g)

    b = sub.add_parser("bench", help="benchmark strategies against plain decoding on real prompts")
    from speculor.bench import add_arguments
    add_arguments(b)
    _add_model_args(b)

    sub.add_parser("fetch-models", help="download and convert the embedded model pair and prompt sets")

    s = sub.add_parser("serve", help="OpenAI-compatible HTTP server")
    s.add_argument("--host", default="127.0.0.1")
    s.add_argument("--port", type=int, default=8000)
    s.add_argument("--strategy", default="chain")
    s.add_argument("--queue-size", type=int, default=64)
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
    options = {"k": args.k} if args.k is not None else {}
    sp = Speculor(load_pair_from_args(args), strategy=args.strategy, **options)
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
          queue_size=args.queue_size)


def cmd_bench(args: argparse.Namespace) -> None:
    from speculor.bench import run

    run(args, load_pair_from_args)


COMMANDS = {"generate": cmd_generate, "bench": cmd_bench, "fetch-models": cmd_fetch_models, "serve": cmd_serve}


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
