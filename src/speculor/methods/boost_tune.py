"""SpecInfer's collective boost-tuning (docs/algorithms.md §14) of a pool of EAGLE-style heads (runtime/eagle_head.py).

    data     teacher forcing over the target: at every position t of a sequence, the target's feature f_t (its
             last hidden state, after the final norm), the log-normaliser lse_t of its logits and its greedy
             token g_t. Sequences: ShareGPT conversations from record SKIP on (the bench samples its ShareGPT
             prompts from the first 2000; MT-Bench and HumanEval are never trained on), loss on the replies
             only; and the target's own greedy answers to ShareGPT prompts, as far as the time allows.
    labels   the target's distribution p_t(v) = exp(W_v · f_t - lse_t) over the head's ids (W: the target's
             output rows), so every head learns the target's own law, not the data's tokens.
    SSM 1    on every position: depth 1 from the target's feature, depth 2 from the head's own ŝ (training-time
             test, as at draft time):  L = Σ_{d=1,2} -Σ_v p_{t+d-1}(v) log q_d(v) + λ SmoothL1(ŝ_t, s_t)
    SSM k+1  starts from SSM k and trains on the positions SSMs 1..k all missed (their depth-1 top-1 is not the
             target's greedy token), the others weighted `hit_weight` (SpecInfer's boosting).
    held out MT-Bench first turns and HumanEval prompts with the target's own greedy answers: acceptance by
             depth (greedy: the head's chain matches the target's) of each SSM, of the pool, of a draft model.

The data (sequences, feature sources, the corpus) are methods/boost_data.py's.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from tqdm import tqdm

from speculor.methods.boost_data import (
    DEPTHS,
    Corpus,
    FeatureSource,
    Seq,
    answered,
    heldout_corpora,
    own_vocab,
    teacher_force,
)
from speculor.runtime.eagle_head import EagleConfig, EagleHead

# ---------------------------------------------------------------- training


@dataclass(frozen=True)
class TrainConfig:
    """AdamW on random training positions, linear warm-up then cosine decay; `seconds` stops an SSM early."""

    steps: int = 2000
    batch: int = 1024
    lr: float = 1e-3
    warmup: int = 100
    feat_weight: float = 0.1  # λ of the feature regression
    hit_weight: float = 0.1  # boosting: weight of the positions earlier SSMs already got right
    seconds: float | None = None


class Labels:
    """The target's law over the head's ids from a corpus position: p_t(v) = exp(W_v · f_t - lse_t)."""

    def __init__(self, corpus: Corpus, w: torch.Tensor) -> None:
        self.c, self.w = corpus, w.to(corpus.f.device, torch.float32)

    def p(self, t: torch.Tensor) -> torch.Tensor:
        return torch.exp(self.c.f[t].float() @ self.w.T - self.c.lse[t, None]).clamp_max(1.0)


def new_head(cfg: EagleConfig, ids: torch.Tensor, corpus: Corpus, embed: Callable, seed: int) -> EagleHead:
    """A head with its standardisation set from the corpus (features and the embeddings of its tokens)."""
    torch.manual_seed(seed)
    head = EagleHead(cfg, ids.cpu()).to(corpus.f.device)
    g = torch.Generator().manual_seed(seed)
    sample = torch.randint(len(corpus.x), (min(len(corpus.x), 65536),), generator=g).to(corpus.f.device)
    f, e = corpus.f[sample].float(), embed(corpus.x[sample]).float()
    head.f_mu.copy_(f.mean(0))
    head.f_sigma.copy_(f.std(0).clamp_min(1e-4))
    head.e_mu.copy_(e.mean(0))
    head.e_sigma.copy_(e.std(0).clamp_min(1e-4))
    return head


def _ce(p: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
    """-Σ_v p(v) log q(v) per row, q = softmax(logits) over the head's ids."""
    return -(p * torch.log_softmax(logits.float(), -1)).sum(-1)


def train_ssm(head: EagleHead, corpus: Corpus, labels: Labels, embed: Callable, cfg: TrainConfig,
              weights: torch.Tensor | None = None, *, seed: int = 0, progress: bool = True,
              desc: str = "SSM") -> dict[str, Any]:
    """Train `head` in place on the corpus' training positions (sampled ∝ weights); its loss curve."""
    pos = corpus.positions
    w = torch.ones(len(pos), device=pos.device) if weights is None else weights[pos].float()
    opt = torch.optim.AdamW(head.parameters(), lr=cfg.lr, weight_decay=0.0)
    gen = torch.Generator(device=pos.device).manual_seed(seed)
    head.train()
    t0, curve, avg = time.perf_counter(), [], None
    bar = tqdm(range(cfg.steps), desc=desc, disable=not progress)
    step = 0
    for step in bar:
        lr = cfg.lr * min(1.0, (step + 1) / cfg.warmup) * 0.5 * (1 + math.cos(math.pi * step / cfg.steps))
        for group in opt.param_groups:
            group["lr"] = lr
        t = pos[torch.multinomial(w, cfg.batch, replacement=True, generator=gen)]
        s1, logits1 = head(head.standardize(corpus.f[t - 1]), embed(corpus.x[t]))
        s2, logits2 = head(s1, embed(corpus.x[t + 1]))
        reg = torch.nn.functional.smooth_l1_loss(s1, head.standardize(corpus.f[t]))
        loss = (_ce(labels.p(t), logits1) + _ce(labels.p(t + 1), logits2)).mean() + cfg.feat_weight * reg
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(head.parameters(), 1.0)
        opt.step()
        avg = loss.item() if avg is None else 0.98 * avg + 0.02 * loss.item()
        if step % 50 == 0:
            bar.set_postfix(loss=f"{avg:.3f}")
            curve.append((step, round(avg, 4)))
        if cfg.seconds is not None and time.perf_counter() - t0 > cfg.seconds:
            break
    head.eval()
    return {"steps": step + 1, "seconds": round(time.perf_counter() - t0, 1), "loss": curve}


# ---------------------------------------------------------------- acceptance


@torch.no_grad()
def chain_hits(head: EagleHead, corpus: Corpus, embed: Callable, positions: torch.Tensor,
               depths: int = DEPTHS, chunk: int = 8192) -> torch.Tensor:
    """hit [P, depths]: the head's greedy token at depth d (its own features after depth 1) is the target's."""
    out = []
    for c in range(0, len(positions), chunk):
        t = positions[c:c + chunk]
        s, hits = head.standardize(corpus.f[t - 1]), []
        for d in range(depths):
            s, logits = head(s, embed(corpus.x[t + d]))
            hits.append(head.ids[logits.argmax(-1)] == corpus.g[t + d])
        out.append(torch.stack(hits, 1))
    return torch.cat(out)


def by_depth(hits: torch.Tensor) -> dict[str, Any]:
    """Acceptance by depth of greedy chains from per-depth hits: a_d = P(hit_1..d) / P(hit_1..d-1), and the
    expected accepted length of a chain of each depth, Σ_{j<=d} P(hit_1..j)."""
    reach = torch.cumprod(hits.float(), 1).mean(0).tolist()
    acc = [reach[0]] + [reach[d] / reach[d - 1] if reach[d - 1] else 0.0 for d in range(1, len(reach))]
    return {"acceptance": [round(a, 4) for a in acc],
            "accepted_length": [round(sum(reach[:d + 1]), 4) for d in range(len(reach))]}


def pool_hits(hits: Sequence[torch.Tensor]) -> torch.Tensor:
    """Hits of the merged tree of the SSMs' greedy chains: some chain matches down to depth d (non-increasing in
    d, so `by_depth` reads it as it reads one chain's)."""
    return torch.stack([torch.cumprod(h.float(), 1) for h in hits]).amax(0) > 0.5


def draft_hits(g_draft: torch.Tensor, corpus: Corpus, positions: torch.Tensor, depths: int = DEPTHS) -> torch.Tensor:
    """hit [P, depths] of a draft model teacher-forced over the same sequences (its greedy token g_draft[t])."""
    return torch.stack([g_draft[positions + d] == corpus.g[positions + d] for d in range(depths)], 1)


@torch.no_grad()
def alpha1(head: EagleHead, corpus: Corpus, labels: Labels, embed: Callable, positions: torch.Tensor,
           chunk: int = 4096) -> float:
    """Mean first-token acceptance at T = 1, E Σ_v min(p(v), q(v))."""
    total = 0.0
    for c in range(0, len(positions), chunk):
        t = positions[c:c + chunk]
        _, logits = head(head.standardize(corpus.f[t - 1]), embed(corpus.x[t]))
        total += float(torch.minimum(labels.p(t), torch.softmax(logits.float(), -1)).sum())
    return total / max(len(positions), 1)


# ---------------------------------------------------------------- the pipeline


@dataclass
class Plan:
    """What one boost-tuning run makes: `ssms` heads of `config` trained with `train` on `corpus`, evaluated on
    `heldout` (name -> corpus), saved in `out` after each SSM (resumable: SSMs already there are kept)."""

    config: EagleConfig
    train: TrainConfig
    ssms: int = 3
    seed: int = 0
    manifest: dict[str, Any] = field(default_factory=dict)


def evaluate(heads: Sequence[EagleHead], heldout: dict[str, Corpus], embed: Callable, w: torch.Tensor,
             drafts: dict[str, torch.Tensor] | None = None) -> dict[str, Any]:
    """Held-out acceptance by depth of each SSM alone, of the pool, of a draft (its greedy tokens given)."""
    table: dict[str, Any] = {}
    for name, c in heldout.items():
        pos = c.positions
        hits = [chain_hits(h, c, embed, pos) for h in heads]
        row = {f"ssm{k}": by_depth(h) for k, h in enumerate(hits, 1)}
        for k, h in enumerate(heads, 1):
            row[f"ssm{k}"]["alpha1_t1"] = round(alpha1(h, c, Labels(c, w), embed, pos), 4)
        if len(hits) > 1:
            row["pool"] = by_depth(pool_hits(hits))
        if drafts and name in drafts:
            row["draft"] = by_depth(draft_hits(drafts[name].to(c.g.device), c, pos))
        in_vocab = torch.isin(c.g[pos], heads[0].ids.to(c.g.device)).float().mean()
        table[name] = {"positions": len(pos), "target_token_in_head_vocab": round(float(in_vocab), 4), **row}
    return table


def boost_tune(plan: Plan, corpus: Corpus, heldout: dict[str, Corpus], ids: torch.Tensor, embed: Callable,
               out_rows: Callable, out, *, drafts: dict[str, torch.Tensor] | None = None,
               progress: bool = True) -> tuple[list[EagleHead], dict[str, Any]]:
    """SSM 1 on every training position, SSM k+1 from SSM k on the positions 1..k missed (module docstring);
    the pool and its manifest saved in `out` after each SSM."""
    from pathlib import Path

    from speculor.runtime.eagle_head import as_saved, load_pool, save_pool

    out = Path(out)
    w = out_rows(ids)
    labels = Labels(corpus, w)
    heads: list[EagleHead] = []
    manifest = {**plan.manifest, "seed": plan.seed, "train": plan.train.__dict__, "ssm_runs": []}
    if (out / "manifest.json").exists():  # resume: keep the SSMs already trained with the same settings
        done, old = load_pool(out, corpus.f.device)
        if old.get("train") == manifest["train"] and old.get("config") == plan.config.__dict__:
            heads, manifest["ssm_runs"] = done[:plan.ssms], old.get("ssm_runs", [])[:plan.ssms]
    pos = corpus.positions
    missed = torch.ones(len(corpus.x), dtype=torch.bool, device=pos.device)
    for h in heads:
        missed[pos] &= ~chain_hits(h, corpus, embed, pos, depths=1)[:, 0]
    for k in range(len(heads) + 1, plan.ssms + 1):
        if k == 1:
            head = new_head(plan.config, ids, corpus, embed, plan.seed)
            weights = None
        else:
            head = EagleHead(plan.config, ids.cpu()).to(pos.device)
            head.load_state_dict(heads[-1].state_dict())
            weights = torch.where(missed, 1.0, plan.train.hit_weight)
        run = train_ssm(head, corpus, labels, embed, plan.train, weights, seed=plan.seed + k, progress=progress,
                        desc=f"SSM {k}/{plan.ssms}")
        run["weighted_positions_missed_before"] = round(float(missed[pos].float().mean()), 4)
        heads.append(as_saved(head))
        missed[pos] &= ~chain_hits(head, corpus, embed, pos, depths=1)[:, 0]
        run["train_positions_missed_by_all"] = round(float(missed[pos].float().mean()), 4)
        manifest["ssm_runs"].append(run)
        manifest["heldout"] = evaluate(heads, heldout, embed, w, drafts)
        save_pool(heads, out, manifest)
    return heads, manifest


def evaluate_pool(source: FeatureSource, data: dict[str, Any], heads: Sequence[EagleHead], *,
                  answer_tokens: int = 128, draft=None) -> dict[str, Any]:
    """A trained pool (and a draft) on the held-out prompts' answers as this source computes them: the acceptance
    by depth with the features a deployment reads (`evaluate`)."""
    heldout, drafts = heldout_corpora(source, data, answer_tokens, draft, torch.float32)
    device = next(iter(heldout.values())).f.device
    heads = [h.to(device) for h in heads]
    return evaluate(heads, heldout, source.embed, source.out_rows(heads[0].ids), drafts or None)


def run(source: FeatureSource, data: dict[str, Any], plan: Plan, out, *, answer_tokens: int = 128,
        selfgen_tokens: int = 256, draft=None, dtype=torch.bfloat16, own: bool = True) -> dict[str, Any]:
    """The whole run on prepared ids: held-out answers and corpora (and a draft model's greedy tokens over them,
    to compare), self-generated answers, teacher forcing, boost-tuning; the manifest (also saved with the pool in
    `out`)."""
    t0 = time.perf_counter()
    eos = data["eos"]
    heldout, drafts = heldout_corpora(source, data, answer_tokens, draft, dtype)
    seqs = [Seq(ids, mask) for ids, mask in data["train"]]
    if data.get("selfgen"):
        asks = data["selfgen"]
        seqs += answered(asks, source.greedy(asks, selfgen_tokens, eos))
    corpus = teacher_force(source, seqs, dtype=dtype)
    t_data = time.perf_counter() - t0
    ids = own_vocab(corpus, len(data["ids"]), eos) if own else torch.as_tensor(data["ids"])
    plan.manifest.update({
        "data": {"sharegpt_records": data.get("sharegpt_records"), "conversations": len(data["train"]),
                 "selfgen_answers": len(seqs) - len(data["train"]), "sequences": len(seqs),
                 "tokens": len(corpus.x), "training_positions": len(corpus.positions),
                 "heldout": {k: {"prompts": len(v), "answer_tokens": answer_tokens}
                             for k, v in data["heldout"].items()},
                 "seconds": round(t_data, 1)}})
    heads, manifest = boost_tune(plan, corpus, heldout, ids, source.embed, source.out_rows, out,
                                 drafts=drafts or None)
    manifest["seconds"] = round(time.perf_counter() - t0, 1)
    from speculor.runtime.eagle_head import save_pool

    save_pool(heads, out, manifest)
    return manifest
