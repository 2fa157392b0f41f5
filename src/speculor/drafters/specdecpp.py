"""SpecDec++ (docs/algorithms.md §7) as the `specdecpp` strategy: a trained acceptance-prediction head on the
draft decides the chain length.

Notation of the papers: p is the target distribution, q the draft's; Y_i ~ q the draft token at position i,
and P̂_i = P̂(Y_i accepted | Y_<i accepted, prefix) the head's output at the draft position whose *input* token
is Y_i. The head only decides how long to draft: verification is the standard lossless rule of §1 (the
engine's), so any head, trained or random, gives exactly the target's output.

    AcceptanceHead     L residual blocks x <- x + SiLU(W_l x + b_l) (separate weights), then Linear(H -> 2);
                       softmax index 1 = accept
    save_head/load_head  fp16 safetensors + a JSON record (draft identity, H, L, training temperature, data, losses)
    StopRule           stop drafting when 1 - prod P̂ > h, within (K_min, K_max), with the one-token lag
    SpecDecPPDrafter   one request's chain, its length decided on the fly; the head and thresholds are shared
    thresholds         tuned per temperature (`speculor tune-threshold`), saved in the cache, used by default
Training data, training and threshold tuning live in `methods/specdecpp_data.py` and `methods/specdecpp_train.py`.
"""

from __future__ import annotations

import hashlib
import json
import logging
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any, Protocol

import torch
import torch.nn.functional as F
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from speculor.config import SamplingConfig, check_int, is_int
from speculor.core import goodput
from speculor.core.goodput import MARGIN
from speculor.core.tree import EMPTY, DraftTree
from speculor.core.verify import Verdict
from speculor.drafters.base import Drafter, Forward, Proposal, Shared, catch_up, draw, keep_chain
from speculor.errors import SpeculorError
from speculor.runtime import embedded
from speculor.runtime.assets import cache_dir
from speculor.runtime.backend import Backend, Block, Pair
from speculor.runtime.model import Model
from speculor.runtime.profiling import machine_cost

logger = logging.getLogger(__name__)

HEAD_FILE = Path(__file__).parents[1] / "data" / "specdecpp_head.safetensors"  # trained for the embedded pair
DEFAULT_THRESHOLD = 0.3  # the README benchmark value of §7, used when no tuned threshold is found
BOUND = (2, 20)  # (K_min, K_max), the code's defaults (§7)



# ---------------------------------------------------------------- the head


@dataclass(frozen=True)
class HeadConfig:
    """hidden_size H of the draft's last hidden state; layers L residual blocks (0 = a linear probe)."""

    hidden_size: int
    layers: int = 3

    def __post_init__(self) -> None:
        if not is_int(self.hidden_size) or self.hidden_size < 1:
            raise SpeculorError(f"hidden_size must be a positive integer, got {self.hidden_size!r}")
        check_int("layers", self.layers, 0, 16)


class AcceptanceHead(torch.nn.Module):
    """h [..., H] -> logits [..., 2]: x = (h - mu) / sigma, x <- x + SiLU(W_l x + b_l) for l = 1..L (one Linear
    per block), then Linear(H -> 2). P̂(accept) = softmax(logits)[..., 1].

    (The SpecDec++ code repeats one block L times, i.e. shares the weights; here each block has its own.)
    mu and sigma [H] are fixed buffers, the per-feature mean and std of the training inputs (0 and 1 until set):
    Qwen's last hidden state has features of very different scales (docs/algorithms.md §7), and on raw inputs the
    few large ones drive the head into confident, badly generalising predictions (held-out loss above a constant
    predictor's).
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


FP32_KEYS = ("mu", "sigma")  # kept in fp32: (h - mu) / sigma magnifies mu's rounding where a mean is large against its
# std (docs/algorithms.md §7)


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

        from speculor.runtime.prepare import model_files

        files = model_files(spec)
        config = AutoConfig.from_pretrained(files.folder, gguf_file=files.gguf)
    text = config.to_json_string(use_diff=False)
    return {"name": spec, "sha256": hashlib.sha256(text.encode()).hexdigest(), "sha256_of": "config"}


def check_head_fits(record: dict[str, Any], draft: Model, draft_name: str, *, explicit: bool) -> None:
    """Refuse a head of another hidden size; a head trained for another draft is refused when it is the
    packaged default (the user did not choose it) and only warned about when given explicitly."""
    config = getattr(getattr(draft, "model", None), "config", None)  # a transformers draft's (none on llama.cpp)
    hidden = getattr(config if config is not None else draft, "hidden_size", None)
    if hidden is not None and int(record["hidden_size"]) != int(hidden):
        raise SpeculorError(f"the SpecDec++ head takes hidden size {record['hidden_size']}, the draft has {hidden}; "
                            "train a head for this draft with `speculor train-head`")
    want = record.get("draft", {})
    have = model_identity(draft_name, config) if draft_name else {}
    if want.get("sha256") and have.get("sha256") != want.get("sha256"):
        msg = (f"the SpecDec++ head was trained for the draft {want.get('name')!r}, not {draft_name or 'this one'!r}"
               "; train one with `speculor train-head` and pass head=PATH")
        if not explicit:
            raise SpeculorError(msg)
        warnings.warn(msg, stacklevel=3)


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
        if not is_int(self.k_min) or not is_int(self.k_max) or not 1 <= self.k_min <= self.k_max <= 64:
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


class SpecDecPPDrafter(Drafter):
    """A chain from a draft model whose length is decided on the fly by an acceptance-prediction head (§7).

    Step j draws Y_j from the draft logits, then asks the rule; to go on it feeds Y_j, which gives the logits
    of Y_{j+1} and the hidden state whose input token is Y_j, hence P̂_j. Like `ChainDrafter`, the last token
    is not fed (it is fed on the next step if accepted): forwards = K. `thresholds` maps a temperature to h;
    a generation uses the entry nearest its temperature (greedy prefers the 0 entry).
    """

    def __init__(self, model: Backend, head: Head, thresholds: dict[float, float] | float = DEFAULT_THRESHOLD,
                 k_min: int = BOUND[0], k_max: int = BOUND[1], declines: bool = False) -> None:
        self.declines = declines  # the request decodes plainly and the draft is never fed (`make_specdecpp`)
        table = (thresholds if isinstance(thresholds, dict) else {0.0: thresholds}) or {0.0: DEFAULT_THRESHOLD}
        self.rules = {float(t): StopRule(h, k_min, k_max) for t, h in table.items()}
        self.model, self.head, self.forwards, self.k = model, head, 0, 0
        self.cache = model.new_cache()
        self.p_hat: list[float] = []  # P̂_1..P̂_{K-1} of the last proposal

    def rule(self, cfg: SamplingConfig) -> StopRule:
        return self.rules[nearest_temperature(list(self.rules), cfg.temperature)]

    def reset(self) -> None:
        self.cache = self.model.new_cache()

    @torch.inference_mode()
    def propose(self, seq: list[int], cfg: SamplingConfig, generator: torch.Generator | None) -> Proposal:
        if self.declines:
            self.forwards = self.k = 0
            return EMPTY
        rule = self.rule(cfg)
        logits = yield from catch_up(self.model, self.cache, seq)
        tokens, qs, cum, self.p_hat = [], [], 1.0, []
        while True:
            y, q = draw(logits, cfg, generator)
            tokens.append(y)
            qs.append(q)
            if rule.stop(len(tokens), cum):
                break
            rows = yield Forward(self.model, Block(self.cache, [y], hidden=True))
            self.cache.keep([0])
            self.p_hat.append(float(self.head.accept_prob(rows.hidden[-1])))
            cum *= self.p_hat[-1]
            logits = rows.logits[-1]
        self.forwards = self.k = len(tokens)
        return DraftTree.chain(tokens, None if cfg.greedy else torch.stack(qs))

    def observe(self, n_committed: int, verdict: Verdict) -> None:
        if self.k:
            keep_chain(self.cache, n_committed, len(verdict.path), self.k - 1)


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
    head: a head file (default: the packaged head trained for the embedded pair); budget: "auto" declines to draft
    where the machine's cost curve says no chain of k_max tokens could pay (goodput.chain_can_pay), "none" always
    drafts."""

    threshold: float | None = None
    k_min: int = BOUND[0]
    k_max: int = BOUND[1]
    head: str | None = None
    budget: str = "auto"

    def __post_init__(self) -> None:
        if self.budget not in ("auto", "none"):
            raise SpeculorError(f"specdecpp's budget is 'auto' or 'none', got {self.budget!r}")
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
                   head: str | None = None, budget: str = "auto") -> Shared:
    """The `specdecpp` strategy: per request a SpecDecPPDrafter on the pair's draft with the chosen (shared) head and
    threshold(s); with budget "auto", gated by the machine's cost curve."""
    opts = SpecDecPPOptions(threshold, k_min, k_max, head, budget)
    if pair.draft is None:
        raise SpeculorError("strategy 'specdecpp' needs a draft model")
    path = Path(opts.head).expanduser() if opts.head else HEAD_FILE
    module, record, sha = cached_head(path, pair.draft.device)
    check_head_fits(record, pair.draft, pair.draft_name, explicit=opts.head is not None)
    table = {0.0: opts.threshold} if opts.threshold is not None else resolve_thresholds(path, sha)
    # auto: no chain of k_max tokens could pay on this machine's cost curve (decided from the curve alone: exact)
    declines = opts.budget == "auto" and not goodput.chain_can_pay(machine_cost(pair), opts.k_max, MARGIN)
    return Shared(partial(SpecDecPPDrafter, pair.draft, module, table, opts.k_min, opts.k_max, declines))
