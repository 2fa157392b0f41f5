"""SpecDec++ training data (docs/algorithms.md §7): teacher-forced target and draft passes over ShareGPT prompt +
reply give soft labels y_i = min(1, p(Y_i)/q(Y_i)); a second draft pass over prompt + Z (Z_i = X_i with prob. r,
else Y_i) gives the head's inputs. Hidden states and labels are cached on disk in shards (resumable).
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Iterator
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file
from tqdm import tqdm

from speculor.config import is_int
from speculor.errors import SpeculorError
from speculor.runtime.assets import cache_dir
from speculor.runtime.backend import Pair, forward1
from speculor.runtime.cache import KVCache
from speculor.runtime.model import Model

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
            if not is_int(getattr(self, name)) or getattr(self, name) < (0 if name == "seed" else 1):
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
    from speculor.bench.prompts import sharegpt_records

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


def teacher_logits(model: Model, cache: KVCache, prompt: list[int], x: list[int]) -> torch.Tensor:
    """Logits [len(x), V] predicting X_0..X_{n-1} on prompt + X_<i; the prompt stays committed in `cache`."""
    first = forward1(model, cache, prompt, last=True).logits
    cache.keep(list(range(len(prompt))))
    return torch.cat([first, forward1(model, cache, x[:-1]).logits]) if len(x) > 1 else first


def sequence_features(pair: Pair, prompt: list[int], x: list[int], cfg: DataConfig,
                      generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """(hidden [m, H], labels [m]) of one sequence, m = positions where Z_i = Y_i.

    Pass 1 (teacher forced on prompt + X, target and draft): p_i, q_i; Y_i ~ q_i at temperature T; labels.
    Pass 2 (draft on prompt + Z): the last hidden state at the position whose input token is Z_i, i.e. the
    head's input for P̂(Y_i accepted), exactly as the drafter computes it (a block with hidden=True).
    """
    assert pair.draft is not None
    p_logits = teacher_logits(pair.target, pair.target.new_cache(), prompt, x)  # its cache is freed at once
    draft_cache = pair.draft.new_cache()
    q_logits = teacher_logits(pair.draft, draft_cache, prompt, x)
    q_t = torch.softmax(q_logits / cfg.temperature, dim=-1)
    y = torch.multinomial(q_t, 1, generator=generator)[:, 0]
    labels = soft_labels(p_logits, q_logits, y)
    z, from_y = mix(torch.tensor(x), y, cfg.mixing_ratio, generator)
    hidden = forward1(pair.draft, draft_cache, z, hidden=True, last=True).hidden  # after the committed prompt
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


def draft_kernel(draft: Model) -> str:
    """How the draft's matmuls ran when its hidden states were taken (the head should see the engine's)."""
    from speculor.runtime.kernels import linear_kinds

    return f"{linear_kinds(draft.model)} on {draft.device}, {draft.weights}"


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
