"""A cheap small speculative model (SSM) on the target's own hidden states, EAGLE-style, as a `Backend`.

EAGLE's idea (2401.15077): the target's last hidden state f_{i-1} at position i - 1 already holds what the next
tokens depend on; a small network fed f_{i-1} and the embedding of the token x_i predicts the feature f_i and
the token after it, and drafting runs on its own predicted features (feature recurrence):

    s = (f - mu_f) / sigma_f                     the target feature, standardised (Qwen's span 0.15 .. 30)
    z = W_in [s_{i-1} ; (e(x_i) - mu_e) / sigma_e]                                    [r]
    z <- z + W_2 (SiLU(W_1 RMS(z)) * W_3 RMS(z))   per block                           [r]
    ŝ_i = W_f RMS(z)                             the next position's standardised feature   [H]
    q(x_{i+1}) = softmax(W_v RMS(z))             over the head's vocabulary ids (FR-Spec's most frequent tokens),
                                                 zero elsewhere: a real distribution, so every exact rule applies

Here the layer is an MLP, not EAGLE's decoder layer: no attention over earlier features, so a row needs only
its parent's feature, a cache is one feature per entry, and a head forward costs a few percent of a target step
on a CPU (the point of cheap SSMs, docs/algorithms.md §14). e is the target's own token embedding (frozen, read
from the target: its torch weights or its GGUF), so a head ships only its own few million weights.

A row's parent feature (position P - 1 for a row at P) is the target's own where the target has computed it
(a `FeatureStore`, filled from the verify forwards: the committed positions), else the head's prediction ŝ for
that row (draft rows, and the root: the bonus token the target has not seen yet). `HeadModel.bind(store)` is a
request's view: its caches read that request's store; the views of one head batch into one forward.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from speculor.config import check_int
from speculor.errors import SpeculorError
from speculor.runtime.backend import Block, Rows, Traits
from speculor.runtime.pending import PendingRows

FP32_KEYS = ("f_mu", "f_sigma", "e_mu", "e_sigma")  # kept in fp32 when saved: means ~100 beside stds ~0.2
KEEP = 8  # committed features a store keeps (a head row needs only its parent's)


@dataclass(frozen=True)
class EagleConfig:
    """hidden_size H of the target's feature; width r and ffn of the head's blocks; vocab V_r: the head's ids."""

    hidden_size: int
    width: int = 256
    ffn: int = 512
    blocks: int = 2
    vocab: int = 8192

    def __post_init__(self) -> None:
        check_int("hidden_size", self.hidden_size, 1, 1 << 16)
        check_int("width", self.width, 1, 1 << 14)
        check_int("ffn", self.ffn, 1, 1 << 16)
        check_int("blocks", self.blocks, 0, 16)
        check_int("vocab", self.vocab, 2, 1 << 20)


class _RMS(torch.nn.Module):
    def __init__(self, n: int) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.weight


class _Block(torch.nn.Module):
    """z + W_2 (SiLU(W_1 RMS(z)) * W_3 RMS(z))."""

    def __init__(self, r: int, ffn: int) -> None:
        super().__init__()
        self.norm = _RMS(r)
        self.w1, self.w3 = torch.nn.Linear(r, ffn, bias=False), torch.nn.Linear(r, ffn, bias=False)
        self.w2 = torch.nn.Linear(ffn, r, bias=False)

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        x = self.norm(z)
        return z + self.w2(torch.nn.functional.silu(self.w1(x)) * self.w3(x))


class EagleHead(torch.nn.Module):
    """(s_{i-1} standardised feature [N, H], e(x_i) raw embedding [N, H]) -> (ŝ_i [N, H], logits over `ids` [N, V_r])
    (module docstring)."""

    def __init__(self, cfg: EagleConfig, ids: torch.Tensor) -> None:
        super().__init__()
        if ids.shape != (cfg.vocab,):
            raise SpeculorError(f"the head's vocabulary has {tuple(ids.shape)} ids, its config says {cfg.vocab}")
        self.cfg = cfg
        h, r = cfg.hidden_size, cfg.width
        self.register_buffer("ids", ids.long())
        for name, value in (("f_mu", 0.0), ("f_sigma", 1.0), ("e_mu", 0.0), ("e_sigma", 1.0)):
            self.register_buffer(name, torch.full((h,), value))
        self.inp = torch.nn.Linear(2 * h, r)
        self.blocks = torch.nn.ModuleList(_Block(r, cfg.ffn) for _ in range(cfg.blocks))
        self.norm = _RMS(r)
        self.feat = torch.nn.Linear(r, h)
        self.out = torch.nn.Linear(r, cfg.vocab, bias=False)

    def standardize(self, f: torch.Tensor) -> torch.Tensor:
        return (f.float() - self.f_mu) / self.f_sigma

    def forward(self, s: torch.Tensor, e: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        z = self.inp(torch.cat([s, (e.float() - self.e_mu) / self.e_sigma], dim=-1))
        for block in self.blocks:
            z = block(z)
        z = self.norm(z)
        return self.feat(z), self.out(z)


# ---------------------------------------------------------------- saved pools


@torch.no_grad()
def as_saved(head: EagleHead) -> EagleHead:
    """The head's weights rounded to the fp16 they are saved in (in place): what is evaluated is what ships, and a
    resumed run continues from the same weights as an uninterrupted one."""
    for name, v in head.state_dict().items():
        if name not in FP32_KEYS and v.is_floating_point():
            v.copy_(v.half().float())
    return head


def save_pool(heads: Sequence[EagleHead], folder: Path, manifest: dict[str, Any]) -> None:
    """A pool of heads as `ssm{k}.safetensors` (fp16; the standardisation in fp32) + `manifest.json`."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    for k, head in enumerate(heads, 1):
        tensors = {n: v.detach().to("cpu", torch.float32 if n in FP32_KEYS else torch.float16).contiguous()
                   for n, v in head.state_dict().items() if n != "ids"}
        tensors["ids"] = head.ids.detach().to("cpu", torch.int32).contiguous()
        save_file(tensors, str(folder / f"ssm{k}.safetensors"), metadata={"format": "pt"})
    full = {**manifest, "config": asdict(heads[0].cfg), "ssms": len(heads),
            "weights": "float16 (standardisation: float32)"}
    (folder / "manifest.json").write_text(json.dumps(full, indent=1) + "\n")


def load_pool(folder: Path, device: str | torch.device = "cpu") -> tuple[list[EagleHead], dict[str, Any]]:
    """The heads of a pool folder (fp32, eval mode) and its manifest; a clear error for a missing or bad one."""
    folder = Path(folder).expanduser()
    try:
        manifest = json.loads((folder / "manifest.json").read_text())
        cfg = EagleConfig(**manifest["config"])
        heads = []
        for k in range(1, int(manifest["ssms"]) + 1):
            tensors = load_file(str(folder / f"ssm{k}.safetensors"))
            head = EagleHead(cfg, tensors.pop("ids").long())
            head.load_state_dict({n: v.float() for n, v in tensors.items()}, strict=False)
            heads.append(head.to(device).eval())
    except (OSError, ValueError, KeyError, TypeError, RuntimeError, SafetensorError) as exc:
        raise SpeculorError(f"cannot load a pool of heads from {folder}: {exc}; "
                            "train one with `speculor boost-tune`") from exc
    return heads, manifest


# ---------------------------------------------------------------- the target's features of a request


class FeatureStore:
    """One request's target features: position -> f (the last KEEP positions put)."""

    def __init__(self) -> None:
        self.f: dict[int, torch.Tensor] = {}

    def put(self, start: int, feats: torch.Tensor) -> None:
        """Features [k, H] of positions start .. start + k - 1 (rows the target computed and committed)."""
        top = start + len(feats)
        for i in range(max(len(feats) - KEEP, 0), len(feats)):  # a prompt's: only its last KEEP
            self.f[start + i] = feats[i]
        for p in [p for p in self.f if p < top - KEEP]:
            del self.f[p]

    def get(self, pos: int) -> torch.Tensor | None:
        return self.f.get(pos)

    def clear(self) -> None:
        self.f.clear()


class HeadCache(PendingRows):
    """A request's entries for a head, a `Cache` (runtime/backend.py): the pending rows' bookkeeping
    (runtime/pending.py) and per pending row its token and predicted feature ŝ; `tip` = ŝ of the last committed
    entry (None: unknown)."""

    def __init__(self, store: FeatureStore, hidden_size: int) -> None:
        super().__init__()
        self.store, self.zero = store, torch.zeros(hidden_size)
        self.tokens: list[int] = []
        self.s: list[torch.Tensor | None] = []  # predicted standardised features of the pending rows
        self.tip: torch.Tensor | None = None

    def append(self, tokens: list[int], parents: list[int]) -> None:
        if len(tokens) != len(parents):
            raise ValueError(f"{len(tokens)} tokens, {len(parents)} parents")
        self.add(parents)
        self.tokens += tokens
        self.s += [None] * len(tokens)

    def keep(self, rows: list[int]) -> None:
        """Commit the pending rows `rows` (a path down from the committed tip, ascending); drop the rest."""
        if rows:
            assert self.is_path(rows), "the rows kept form a path from the committed tip"
            self.tip = self.s[rows[-1]]
            self.length += len(rows)
        self.trim(self.length)

    def trim(self, n: int) -> None:
        """Forget every entry from slot n on (pending rows included: only a chain's may be partly kept)."""
        if n < self.length:
            self.tip = None
        keep = self.kept(n)
        assert self.is_chain(keep), "only a chain's pending rows are partly kept"
        del self.tokens[keep:], self.s[keep:]
        self.cut(n)

    def parent_feature(self, row: int) -> tuple[torch.Tensor, bool] | None:
        """What pending row `row`'s token follows: (the target's raw feature, True) where the target computed it,
        else (the predicted standardised one, False); None while unknown."""
        pos = self.length + self.depth[row] - 1
        if pos < 0:  # the first token has no position before it: the mean feature
            return self.zero, False
        if (f := self.store.get(pos)) is not None:
            return f, True
        p = self.parents[row]
        s = self.s[p] if p >= 0 else self.tip
        return None if s is None else (s, False)


class HeadModel:
    """One trained head over a target's token embedding `embed(ids) -> [n, H]`: the `Backend` of its drafts
    (runtime/backend.py). `bind(store)` makes a request's view; views batch with each other (`shared`)."""

    def __init__(self, head: EagleHead, embed: Callable[[torch.Tensor], torch.Tensor], *, vocab_size: int,
                 context_length: int, name: str = "eagle", first_rate: float | None = None) -> None:
        self.head, self.embed, self.name = head.eval(), embed, name
        self.first_rate = first_rate  # its held-out first-token acceptance (the pool's manifest), if measured
        self.vocab_size, self.context_length = vocab_size, context_length
        self.eos_ids: frozenset[int] = frozenset()
        self.device = head.ids.device
        self.weights = str(head.out.weight.dtype).removeprefix("torch.")
        self.hidden_size = head.cfg.hidden_size
        self.traits = Traits()  # a request's cache is its own
        self.kernel_s = self.call_times = None  # not counted
        self.shared = self
        self.ids = head.ids.cpu()

    def embedding(self) -> Callable[[torch.Tensor], torch.Tensor]:
        return self.embed

    @property
    def cost_key(self) -> str:
        c = self.head.cfg
        return f"{self.name} H{c.hidden_size} r{c.width} ffn{c.ffn} x{c.blocks} V{c.vocab}"

    def bind(self, store: FeatureStore) -> HeadView:
        return HeadView(self, store)

    def new_cache(self) -> HeadCache:
        return HeadCache(FeatureStore(), self.head.cfg.hidden_size)

    @torch.inference_mode()
    def forward(self, blocks: Sequence[Block], *, apart: bool = False) -> list[Rows]:
        """Per block its `Rows`: logits [n, V] (-inf outside the head's ids), [1, V] with `last`; no hidden states
        (`Block.hidden` is not read: a head's features are its cache's ŝ). Rows are computed in waves
        (a row once its parent's feature is known), every block's rows of a wave in one head forward; a row's
        result depends on its own inputs alone (`apart` holds always)."""
        need = [self._rows(b) for b in blocks]
        out: list[dict[int, torch.Tensor]] = [{} for _ in blocks]
        left = [list(rows) for rows in need]
        while any(left):
            wave = [(k, r, f) for k, rows in enumerate(left) for r in rows
                    if (f := blocks[k].cache.parent_feature(r)) is not None]
            if not wave:
                raise SpeculorError("a head row has no feature to start from (the target's features of the "
                                    "committed tokens were not given)")
            s = torch.stack([self.head.standardize(f.to(self.device)) if raw else f.to(self.device)
                             for _, _, (f, raw) in wave])
            e = self.embed(torch.tensor([blocks[k].cache.tokens[r] for k, r, _ in wave], dtype=torch.long))
            s_hat, logits = self.head(s, e.to(self.device))
            for j, (k, r, _) in enumerate(wave):
                blocks[k].cache.s[r] = s_hat[j]
                out[k][r] = logits[j]
                left[k].remove(r)
        result = []
        for b, lg in zip(blocks, out, strict=True):
            keep = [max(lg)] if b.last else sorted(lg)
            full = torch.full((len(keep), self.vocab_size), float("-inf"))
            full[:, self.ids] = torch.stack([lg[r] for r in keep]).float().cpu()
            result.append(Rows(full))
        return result

    @staticmethod
    def _rows(b: Block) -> list[int]:
        """Append the block's rows to its cache; the rows to compute: all, or with `last` the last and the
        in-block ancestors whose features it needs (none where the target's features are known)."""
        c = b.cache
        if not isinstance(c, HeadCache):
            raise SpeculorError("a head's forward takes the caches its own views made")
        if not b.append:
            c.trim(c.length)
        start, tokens = len(c.parents), [int(t) for t in (b.tokens.tolist() if torch.is_tensor(b.tokens)
                                                           else b.tokens)]
        parents = (list(range(start - 1, start + len(tokens) - 1)) if b.parents is None
                   else [int(p) for p in torch.as_tensor(b.parents).tolist()])
        c.append(tokens, parents)
        if not b.last:
            return list(range(start, len(c.parents)))
        rows, r = [], len(c.parents) - 1
        while r >= start:
            rows.append(r)
            if c.store.get(c.length + c.depth[r] - 1) is not None:
                break
            r = c.parents[r]
        return sorted(rows)


class HeadView:
    """A request's view of a `HeadModel`: its caches read the request's `FeatureStore`."""

    def __init__(self, model: HeadModel, store: FeatureStore) -> None:
        self.model, self.store, self.shared = model, store, model
        self.vocab_size, self.context_length = model.vocab_size, model.context_length
        self.eos_ids, self.device, self.weights = model.eos_ids, model.device, model.weights
        self.hidden_size, self.traits = model.hidden_size, model.traits
        self.kernel_s = self.call_times = None

    @property
    def cost_key(self) -> str:
        return self.model.cost_key

    def embedding(self) -> Callable[[torch.Tensor], torch.Tensor]:
        return self.model.embed

    def new_cache(self) -> HeadCache:
        return HeadCache(self.store, self.model.head.cfg.hidden_size)

    def forward(self, blocks: Sequence[Block], *, apart: bool = False) -> list[Rows]:
        return self.model.forward(blocks, apart=apart)
