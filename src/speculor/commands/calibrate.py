"""`speculor calibrate`: Sequoia's acceptance vector of a model pair (cached where `sequoia` looks)."""

from __future__ import annotations

from speculor import commands
from speculor.commands import Args
from speculor.errors import SpeculorError


def run(args: Args) -> None:
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
    sp = Speculor(commands.load(args), strategy="plain")
    chosen = prompts.load(args.sets.split(","), args.prompts)
    ids = [sp.encode(p.text, chat=p.chat) for p in chosen]
    for temp in temps:
        cfg = SamplingConfig(temperature=temp, top_p=args.top_p if temp > 0 else 1.0, seed=args.seed)
        cal = calibrate(sp.pair, ids, cfg, width=args.width, steps=args.steps, eos_ids=sp.eos_ids, sets=args.sets)
        path = Path(args.out) if args.out else calibration_path(cal.target, cal.draft, temp, cfg.top_p)
        cal.save(path)
        acc = ", ".join(f"{a:.3f}" for a in cal.acc)
        print(f"T={temp:g} top_p={cfg.top_p:g}: {cal.steps} steps, sum = {sum(cal.acc):.3f}, acc = [{acc}]")
        print(f"saved {path}")
