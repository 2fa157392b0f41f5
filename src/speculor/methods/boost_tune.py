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

A `Corpus` is built by `teacher_force` from any `FeatureSource`: a transformers model (`HFSource`, batched on any
device: the GPU run) or a speculor backend with hidden states (`BackendSource`: llama.cpp or torch on this CPU).
"""

from __future__ import annotations

import itertools
import math
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from tqdm import tqdm

from speculor.runtime.eagle_head import EagleConfig, EagleHead

SKIP = 2000  # ShareGPT records the bench's prompts come from: never trained on
DEPTHS = 4  # depths of the held-out acceptance


# ---------------------------------------------------------------- sequences


@dataclass(frozen=True)
class Seq:
    ids: list[int]
    mask: list[bool]  # positions whose NEXT token is a reply token (trained on)


def chat_sequences(tokenizer, records: Iterator[dict], max_len: int) -> Iterator[Seq]:
    """ShareGPT conversations in the target's chat template, turn by turn; reply tokens marked."""
    for r in records:
        msgs, ids, mask, text = [], [], [], ""
        for turn in r.get("conversations") or []:
            role = {"human": "user", "gpt": "assistant"}.get(turn.get("from"))
            if role is None or not turn.get("value"):
                break
            msgs.append({"role": role, "content": turn["value"]})
            full = tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=role == "user")
            piece = tokenizer(full[len(text):], add_special_tokens=False)["input_ids"]
            text = full
            mask += [role == "assistant"] * len(piece)
            ids += piece
            if len(ids) >= max_len:
                break
        if any(mask[:max_len]):
            # mask[t] is about the token at t; training position t predicts t + 1
            yield Seq(ids[:max_len], mask[1:max_len] + [False])


# ---------------------------------------------------------------- features


class FeatureSource:
    """What teacher forcing reads from a target: per sequence, (features [n, H], lse [n], greedy [n])."""

    hidden_size: int

    def run(self, seqs: Sequence[list[int]], progress: bool = True) -> list[tuple[torch.Tensor, ...]]: ...

    def out_rows(self, ids: torch.Tensor) -> torch.Tensor:
        """The target's output (lm head) rows W_v [len(ids), H] for the head's ids."""
        ...

    def embed(self, ids: torch.Tensor) -> torch.Tensor: ...

    def greedy(self, prompts: Sequence[list[int]], max_new: int, eos: Sequence[int]) -> list[list[int]]:
        """The target's own greedy answer to each prompt (up to and with its end token)."""
        ...


class HFSource(FeatureSource):
    """A transformers causal LM: sequences of similar length batched, right-padded, on the model's device."""

    def __init__(self, model, tokens_per_batch: int = 16384) -> None:
        self.model, self.tpb = model.eval(), tokens_per_batch
        self.hidden_size = model.config.hidden_size
        self.device = model.get_input_embeddings().weight.device

    @torch.inference_mode()
    def run(self, seqs, progress: bool = True):
        order = sorted(range(len(seqs)), key=lambda i: -len(seqs[i]))
        out: dict[int, tuple] = {}
        w = self.model.get_output_embeddings().weight
        bar = tqdm(total=sum(len(s) for s in seqs), desc="teacher forcing", unit="tok", disable=not progress)
        i = 0
        while i < len(order):
            n = len(seqs[order[i]])
            batch = order[i:i + max(1, self.tpb // n)]
            i += len(batch)
            ids, att = torch.zeros(len(batch), n, dtype=torch.long), torch.zeros(len(batch), n, dtype=torch.long)
            for j, k in enumerate(batch):
                ids[j, :len(seqs[k])], att[j, :len(seqs[k])] = torch.tensor(seqs[k]), 1
            h = self.model.model(input_ids=ids.to(self.device), attention_mask=att.to(self.device)).last_hidden_state
            for j, k in enumerate(batch):
                f = h[j, :len(seqs[k])]
                logits = [(f[c:c + 1024] @ w.T).float() for c in range(0, len(f), 1024)]  # full vocab, in chunks
                out[k] = (f, torch.cat([torch.logsumexp(x, -1) for x in logits]),
                          torch.cat([x.argmax(-1) for x in logits]))
                bar.update(len(seqs[k]))
        bar.close()
        return [out[k] for k in range(len(seqs))]

    @torch.inference_mode()
    def greedy(self, prompts, max_new, eos, batch: int = 256):
        answers = []
        for i in tqdm(range(0, len(prompts), batch), desc="greedy answers", unit="batch"):
            part = prompts[i:i + batch]
            n = max(len(p) for p in part)
            ids = torch.zeros(len(part), n, dtype=torch.long)
            att = torch.zeros(len(part), n, dtype=torch.long)
            for j, p in enumerate(part):  # left-padded
                ids[j, n - len(p):], att[j, n - len(p):] = torch.tensor(p), 1
            out = self.model.generate(input_ids=ids.to(self.device), attention_mask=att.to(self.device),
                                      do_sample=False, max_new_tokens=max_new, eos_token_id=list(eos),
                                      pad_token_id=int(eos[0]), temperature=None, top_p=None, top_k=None)
            for row in out[:, n:].tolist():
                cut = next((k + 1 for k, t in enumerate(row) if t in eos), len(row))
                answers.append(row[:cut])
        return answers

    def out_rows(self, ids):
        return self.model.get_output_embeddings().weight.detach()[ids.to(self.device)].float()

    def embed(self, ids):
        return self.model.get_input_embeddings().weight.detach()[ids.to(self.device)].float()


class BackendSource(FeatureSource):
    """A GGUF target on the llama.cpp backend (runtime/llama.py, its embeddings output): one sequence at a time, in
    chunks of `chunk` rows; greedy answers by the engine's plain decoding (this backend's own greedy tokens)."""

    def __init__(self, target, chunk: int = 256) -> None:
        from speculor.runtime.eagle_head import GGUFRows

        self.target, self.chunk = target, chunk
        self.hidden_size = target.hidden_size
        self.embed = GGUFRows(target.path, ["token_embd.weight"])
        self._out = GGUFRows(target.path, ["output.weight", "token_embd.weight"])

    def run(self, seqs, progress: bool = True):
        from speculor.runtime.backend import Block

        out = []
        for ids in tqdm(seqs, desc="teacher forcing", unit="seq", disable=not progress):
            cache, fs, lses, gs = self.target.new_cache(), [], [], []
            for c in range(0, len(ids), self.chunk):
                (logits, hidden), = self.target.forward([Block(cache, ids[c:c + self.chunk], hidden=True,
                                                              append=c > 0)])
                fs.append(hidden)
                lses.append(torch.logsumexp(logits.float(), -1))
                gs.append(logits.argmax(-1))
            out.append((torch.cat(fs), torch.cat(lses), torch.cat(gs)))
        return out

    def greedy(self, prompts, max_new, eos):
        from speculor.config import SamplingConfig
        from speculor.engine.loop import stream

        cfg = SamplingConfig(max_new_tokens=max_new)
        return [[t.id for t in stream(self.target, None, p, cfg, frozenset(eos))]
                for p in tqdm(prompts, desc="greedy answers", unit="prompt")]

    def out_rows(self, ids):
        return self._out(ids.cpu())

    def greedy_tokens(self, model, seqs: Sequence[list[int]]) -> torch.Tensor:
        """Another model's (a draft's) greedy token at every position of the sequences, concatenated."""
        from speculor.runtime.backend import Block

        out = []
        for ids in seqs:
            cache = model.new_cache()
            for c in range(0, len(ids), self.chunk):
                logits = model.forward([Block(cache, ids[c:c + self.chunk], append=c > 0)])[0]
                out.append(logits.argmax(-1))
        return torch.cat(out)


@dataclass
class Corpus:
    """Teacher-forced sequences, concatenated: tokens x [N], features f [N, H], lse [N], greedy g [N] (the target's
    argmax at t, i.e. its choice of x_{t+1}), `train` [N] (position t is a training position: it has t - 1 and
    t + DEPTHS in its sequence and predicts a reply token)."""

    x: torch.Tensor
    f: torch.Tensor
    lse: torch.Tensor
    g: torch.Tensor
    train: torch.Tensor
    seqs: int = 0

    @property
    def positions(self) -> torch.Tensor:
        return self.train.nonzero().squeeze(1)


def teacher_force(source: FeatureSource, seqs: Sequence[Seq], *, dtype=torch.bfloat16,
                  progress: bool = True) -> Corpus:
    """The corpus of `seqs` (features stored in `dtype`, on the source's device)."""
    xs, fs, lses, gs, train = [], [], [], [], []
    for s, (f, lse, g) in zip(seqs, source.run([s.ids for s in seqs], progress), strict=True):
        n = len(s.ids)
        ok = torch.tensor(s.mask, dtype=torch.bool)
        ok[0] = False
        ok[max(n - DEPTHS, 0):] = False
        xs.append(torch.tensor(s.ids))
        fs.append(f.to(dtype))
        lses.append(lse.float())
        gs.append(g.long().cpu())
        train.append(ok)
    dev = fs[0].device if fs else "cpu"
    return Corpus(torch.cat(xs).to(dev), torch.cat(fs), torch.cat(lses).to(dev), torch.cat(gs).to(dev),
                  torch.cat(train).to(dev), len(seqs))


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


def answered(prompts: Sequence[list[int]], answers: Sequence[list[int]]) -> list[Seq]:
    """Prompt + the target's answer, trained / evaluated on the answer's tokens."""
    return [Seq(p + a, [False] * (len(p) - 1) + [True] * len(a) + [False])
            for p, a in zip(prompts, answers, strict=True) if len(a) > DEPTHS]


def prepare(tokenizer, *, conversations: int, max_len: int, selfgen: int, heldout: int,
            vocab: int) -> dict[str, Any]:
    """Token ids for a run, made where the packages are (a GPU machine may have none): ShareGPT conversations from
    record SKIP on (train), first human turns of the records after them (the target answers them: selfgen), and
    `heldout` MT-Bench first turns and HumanEval prompts (as the bench encodes them); the head's `vocab` ids (the
    shipped FR-Spec list's most frequent, special tokens in)."""
    from speculor.bench import prompts as sets
    from speculor.runtime.draft_vocab import choose, shipped_list, special_ids

    records = sets.sharegpt_records(SKIP + conversations + 4 * selfgen)
    for _ in range(SKIP):
        next(records, None)
    train = list(chat_sequences(tokenizer, itertools.islice(records, conversations), max_len))
    asks = []
    for r in records:
        if len(asks) == selfgen:
            break
        conv = r.get("conversations") or []
        if conv and conv[0].get("from") == "human" and 20 <= len(conv[0].get("value", "")) <= 2000:
            asks.append(_chat(tokenizer, conv[0]["value"]))
    held = {}
    for name in ("mtbench", "humaneval"):
        ps = sets.load([name], heldout)
        held[name] = [_chat(tokenizer, p.text) if p.chat else tokenizer(p.text)["input_ids"] for p in ps]
    eos = sorted({t for t in (tokenizer.eos_token_id, tokenizer.convert_tokens_to_ids("<|im_end|>"),
                              tokenizer.convert_tokens_to_ids("<|endoftext|>")) if isinstance(t, int) and t >= 0})
    ids = choose(shipped_list()[0], vocab, len(tokenizer), special_ids(tokenizer)).tolist()
    return {"train": [(s.ids, s.mask) for s in train], "selfgen": asks, "heldout": held, "eos": eos, "ids": ids,
            "sharegpt_records": [SKIP, SKIP + conversations + selfgen]}


def _chat(tokenizer, text: str) -> list[int]:
    rendered = tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                             add_generation_prompt=True)
    return tokenizer(rendered, add_special_tokens=False)["input_ids"]


def own_vocab(corpus: Corpus, n: int, always: Sequence[int]) -> torch.Tensor:
    """The head's ids: the n tokens the target itself picks most often on the training positions (its greedy
    tokens), the end tokens always in."""
    counts = torch.bincount(corpus.g[corpus.positions].cpu(), minlength=max(always) + 1)
    ranked = [i for i in counts.argsort(descending=True).tolist() if i not in set(always)]
    return torch.tensor(sorted(ranked[:n - len(always)] + list(always)), dtype=torch.long)


def heldout_corpora(source: FeatureSource, data: dict[str, Any], answer_tokens: int, draft=None,
                    dtype=torch.bfloat16) -> tuple[dict[str, Corpus], dict[str, torch.Tensor]]:
    """The target's greedy answers to the held-out prompts, teacher-forced; a draft's greedy tokens over them."""
    heldout, drafts = {}, {}
    for name, prompts in data["heldout"].items():
        seqs = answered(prompts, source.greedy(prompts, answer_tokens, data["eos"]))
        heldout[name] = teacher_force(source, seqs, dtype=dtype)
        if draft is not None:
            drafts[name] = source.greedy_tokens(draft, [s.ids for s in seqs])
    return heldout, drafts


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
