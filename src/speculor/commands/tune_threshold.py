"""`speculor tune-threshold`: SpecDec++'s stopping threshold h, picked by measured tokens/s."""

from __future__ import annotations

from speculor import commands
from speculor.commands import Args
from speculor.errors import SpeculorError


def run(args: Args) -> None:
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
    sp = Speculor(commands.load(args), strategy="specdecpp", head=args.head, k_min=args.k_min, k_max=args.k_max)
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
