"""The data of boost-tuning (methods/boost_tune.py): the target teacher-forced over sequences.

    sequences  ShareGPT conversations from record SKIP on, in the target's chat template, loss on the replies
               (the bench samples its ShareGPT prompts from the first 2000; MT-Bench and HumanEval are never trained
               on); the target's own greedy answers to prompts (`answered`); `prepare` makes the token ids where
               the prompt packages are (a GPU machine may have none).
    features   per position t: the target's feature f_t (its last hidden state, after the final norm), the
               log-normaliser lse_t of its logits and its greedy token, from a `FeatureSource`: a transformers model
               batched on any device (`HFSource`) or a GGUF on the llama.cpp backend (`BackendSource`).
    corpus     the sequences concatenated (`Corpus`), and the held-out prompts' answers (`heldout_corpora`).
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from tqdm import tqdm

from speculor.errors import SpeculorError

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


def lse_greedy(logits: Sequence[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """(log-normaliser, argmax) of every row of full-vocabulary logits given in consecutive chunks."""
    return torch.cat([torch.logsumexp(x, -1) for x in logits]), torch.cat([x.argmax(-1) for x in logits])


class HFSource(FeatureSource):
    """A transformers causal LM: sequences of similar length batched, right-padded, on the model's device."""

    def __init__(self, model, tokens_per_batch: int = 16384) -> None:
        from speculor.runtime.model import token_embedding

        self.model, self.tpb = model.eval(), tokens_per_batch
        self.hidden_size = model.config.hidden_size
        self.device = model.get_input_embeddings().weight.device
        self.embed = token_embedding(model)

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
                out[k] = (f, *lse_greedy(logits))
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


class BackendSource(FeatureSource):
    """A GGUF target on the llama.cpp backend (runtime/llama/, its embeddings output): one sequence at a time, in
    chunks of `chunk` rows; greedy answers by the engine's plain decoding (this backend's own greedy tokens)."""

    def __init__(self, target, chunk: int = 256) -> None:
        from speculor.runtime.gguf_rows import GGUFRows

        self.target, self.chunk = target, chunk
        self.hidden_size = target.hidden_size
        self.embed = target.embedding()
        self._out = GGUFRows(target.path, ["output.weight", "token_embd.weight"])

    def run(self, seqs, progress: bool = True):
        out = []
        for ids in tqdm(seqs, desc="teacher forcing", unit="seq", disable=not progress):
            parts = self._chunks(self.target, ids, hidden=True)
            out.append((torch.cat([r.hidden for r in parts]), *lse_greedy([r.logits.float() for r in parts])))
        return out

    def _chunks(self, model, ids: list[int], hidden: bool = False) -> list:
        """A model's results (`Rows`) over a sequence in blocks of `chunk` rows (each continuing the pending
        chain)."""
        from speculor.runtime.backend import Block

        cache = model.new_cache()
        return [model.forward([Block(cache, ids[c:c + self.chunk], hidden=hidden, append=c > 0)])[0]
                for c in range(0, len(ids), self.chunk)]

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
        return torch.cat([r.logits.argmax(-1) for ids in seqs for r in self._chunks(model, ids)])


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
    if not seqs:
        raise SpeculorError(f"no sequence to teacher-force (every answer shorter than {DEPTHS + 1} tokens?)")
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
    dev = fs[0].device
    return Corpus(torch.cat(xs).to(dev), torch.cat(fs), torch.cat(lses).to(dev), torch.cat(gs).to(dev),
                  torch.cat(train).to(dev), len(seqs))


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
