"""`speculor train-head`: SpecDec++'s acceptance head, trained on data built from ShareGPT with the pair."""

from __future__ import annotations

from speculor import commands
from speculor.commands import Args
from speculor.errors import SpeculorError


def run(args: Args) -> None:
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
    # loaded as in the engine: the draft with int8 weights, the target with prepacked blocks (docs/bench, "Kernels")
    record = train_and_save(lambda: commands.load(args), target, draft, data_cfg, train_cfg, out, plot)
    loss, data = record["loss"], record["training"]["data"]
    print(f"data: {data['train_sequences']} + {data['heldout_sequences']} sequences, {data['train_positions']} train "
          f"/ {data['heldout_positions']} held-out positions ({data['cache']})")
    print(f"weighted loss (w = {loss['weight_mismatch']:g}): train {loss['train']:.4f}, held-out {loss['heldout']:.4f}"
          f" (best epoch {record['training']['best_epoch']})")
    print(f"calibration error vs the w-optimum {record['calibration']['error_vs_w_optimum']:.3f}")
    print(f"saved {out} (+ .json) and {plot}")
