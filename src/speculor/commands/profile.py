"""`speculor profile`: t(n) for n = 1..16 of each backend (--backend auto: every candidate, llama.cpp alone with
--calls vector or batched), the ceiling a free drafter could give with the measured acceptance, and the Sequoia tree
the curve picks."""

from __future__ import annotations

from speculor import commands
from speculor.commands import Args


def run(args: Args) -> None:
    import gc

    from speculor.runtime.choice import candidates

    if args.backend != "auto":
        _profile_one(args, args.backend)
        return
    from speculor.runtime.embedded import named

    target, draft = named(args.target, None if args.draft == "none" else args.draft)
    for name in candidates(target, draft, args.device, args.calls):
        _profile_one(args, name)
        gc.collect()


def _profile_one(args: Args, backend: str) -> None:
    from speculor.bench.cost_report import report
    from speculor.runtime.cost import CostModel, cost_path
    from speculor.runtime.profiling import profile_cost

    args.backend = backend
    pair = commands.load(args)
    path = cost_path(pair)
    if args.force or not path.exists():
        profile_cost(pair, repeats=args.repeats).save(path)
    report(pair, CostModel.load(path), path, [float(t) for t in args.temperatures.split(",")], args.depth, args.width)
