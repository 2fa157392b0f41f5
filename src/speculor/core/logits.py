"""A request's transforms of the target's logits, applied at every row of a verified block with that row's own
history, and the log-probabilities reported for emitted tokens. Pure functions.

Row 0 of a block is the root: its history is the request's sequence (prompt + output so far). Row i + 1 is tree
node i: its history adds the tokens on the path to node i (the node's own included). With z a row's logits:

    z[t] += logit_bias[t]
    z[t]  = z[t] / r if z[t] > 0 else z[t] · r          for t in the prompt or the output   (repetition_penalty r)
    z[t] -= f · c[t] + p · [c[t] > 0]                   c[t]: count of t in the output      (frequency f, presence p)

The transformed z is what plain decoding chooses from, so verifying a tree against it (greedy: its argmax;
sampling: warp(z)) emits exactly what plain decoding with the same transforms would. The draft's q stays the
distribution its tokens were drawn from, untransformed: the rules of core/verify.py are exact for any q (a q
further from p only lowers acceptance).
"""

from __future__ import annotations

import torch

from speculor.config import SamplingConfig
from speculor.core.sampling import warp
from speculor.core.tree import DraftTree, path_to


def adjusted(logits: torch.Tensor, cfg: SamplingConfig, seq: list[int], output: int,
             tree: DraftTree) -> torch.Tensor:
    """The block's logits [1 + N, V] after the request's transforms; `seq` = prompt + output, the last `output`
    tokens being the output. Unchanged (the same tensor) when the request has none."""
    if not cfg.transforms:
        return logits
    z = logits.clone()
    v = z.shape[-1]
    if cfg.logit_bias:
        ids, bias = zip(*cfg.logit_bias, strict=True)
        z[:, list(ids)] += torch.tensor(bias, dtype=z.dtype)
    paths = [[]] + [[int(tree.tokens[j]) for j in path_to(tree.parents, i)] for i in range(len(tree))]
    if cfg.repetition_penalty != 1:
        seen = torch.zeros(v, dtype=torch.bool)
        seen[torch.tensor(seq, dtype=torch.long)] = True
        r = cfg.repetition_penalty
        z = torch.where(seen, torch.where(z > 0, z / r, z * r), z)
        for row, path in enumerate(paths):
            for t in {t for t in path if not seen[t]}:
                z[row, t] = z[row, t] / r if z[row, t] > 0 else z[row, t] * r
    if cfg.frequency_penalty or cfg.presence_penalty:
        f, p = cfg.frequency_penalty, cfg.presence_penalty
        counts = torch.bincount(torch.tensor(seq[len(seq) - output:], dtype=torch.long), minlength=v)[:v]
        z -= f * counts.to(z.dtype) + p * (counts > 0).to(z.dtype)
        for row, path in enumerate(paths):
            for k, t in enumerate(path):
                z[row, t] -= f + (p if counts[t] == 0 and t not in path[:k] else 0.0)
    return z


def distribution(z: torch.Tensor, cfg: SamplingConfig) -> torch.Tensor:
    """Log-probabilities [n, V] reported for tokens chosen from the rows z: those of the distribution sampled from
    (warp: temperature, top-k, top-p, min-p), or of softmax(z) for greedy decoding."""
    return torch.log_softmax(z.float(), dim=-1) if cfg.greedy else torch.log(warp(z, cfg))


def token_logprobs(z: torch.Tensor, cfg: SamplingConfig, rows: list[int],
                   tokens: list[int]) -> list[tuple[float, tuple[tuple[int, float], ...]]]:
    """For each emitted token (chosen at block row rows[i]): its log-probability and the cfg.logprobs most likely
    tokens of that row with theirs."""
    lp = distribution(z[rows], cfg)
    top = torch.topk(lp, cfg.logprobs, dim=-1) if cfg.logprobs else None
    out = []
    for i, t in enumerate(tokens):
        alts = () if top is None else tuple(zip(top.indices[i].tolist(), top.values[i].tolist(), strict=True))
        out.append((float(lp[i, t]), alts))
    return out
