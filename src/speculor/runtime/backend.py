"""The seam between the engine and whatever runs a model's forward passes: a `Backend`.

Everything above `runtime/` (drafters, engine, serving, bench) talks to a model through this protocol only:

    backend.forward(blocks)  -> per block its `Rows`: logits [n, V] (fp32, on the host), hidden [n, H] or None
    backend.new_cache()      -> a request's `Cache` (`keep(rows)` commits pending rows, `trim(n)` forgets from n on)
    backend.context_length, backend.vocab_size, backend.eos_ids (its end tokens)
    backend.device, backend.hidden_size, backend.embedding() (what a head over its features reads)
    backend.cost_key, backend.weights (what its measured cost curve depends on), backend.kernel_s and
    backend.call_times (its kernels' seconds, its calls' by rows, where it counts them)
    backend.traits           -> `Traits`: the facts the engine's policy reads (shared cells, the cost of rows,
                                how prompts are cut into chunks, whether a prompt's call scores the root)

A `Block` is one request's new rows against that request's cache: tokens with parents inside the block (-1 =
attends only to the cache), a chain for a prompt, [root] + nodes for a draft tree. One call may carry many
requests' blocks; how they are run (one stacked forward, or one after the other) is the backend's own choice, and
a block's result never depends on the blocks beside it at temperature > 0 (`apart`). A single request is a batch
of one. `Pair` (a target, a draft and the tokenizer) lives here too, beside the protocol its models follow.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, runtime_checkable

import torch

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from speculor.runtime.cache import KVCache
    from speculor.runtime.call_times import CallTimes


class Cache(Protocol):
    """A request's entries for one backend (what `new_cache()` returns; runtime/pending.py keeps the bookkeeping):
    `length` committed entries, then the pending rows of the blocks forwarded since."""

    length: int

    @property
    def pending(self) -> torch.Tensor:
        """The pending rows' parents (region indices, -1 = the committed tip)."""
        ...

    def keep(self, rows: list[int]) -> None:
        """Commit the pending rows `rows` (ascending) after the committed entries; drop the rest."""
        ...

    def trim(self, n: int) -> None:
        """Forget every entry from slot n on (pending rows included)."""
        ...


@dataclass(frozen=True)
class Block:
    """One request's rows in a forward. The rows become pending entries b..b+n-1 of the cache's pending region,
    b = 0 (the region emptied first) unless `append` (b = entries already pending); parents[i] is the region index
    of row i's parent (< b + i, -1 = none), None = a chain (continuing the last pending entry with `append`).
    hidden: also the last hidden states (`Rows.hidden`); last: only the last row's logits ([1, V])."""

    cache: Cache
    tokens: torch.Tensor | list[int]
    parents: torch.Tensor | None = None
    hidden: bool = False
    append: bool = False
    last: bool = False


@dataclass(frozen=True)
class Segment:
    """Rows [start, stop) of a torch model's stacked forward belong to `cache`; `mask` is their additive tree mask
    against that cache (None: every row sees every entry); last: only the last row's logits are wanted."""

    cache: KVCache
    start: int
    stop: int
    mask: torch.Tensor | None
    last: bool = False


@dataclass(frozen=True)
class Rows:
    """One block's result: logits [n, V] (fp32, on the host; [1, V], the last row's, with `Block.last`) and, with
    `Block.hidden`, the last hidden states [n, H] (with `last` at least the last row's: llama.cpp gives that row's
    alone), else None."""

    logits: torch.Tensor
    hidden: torch.Tensor | None = None


    def ratio(self, k: int) -> float | None: ...


@dataclass(frozen=True)
class Traits:
    """What the engine's policy reads of a backend, fixed when it is made (its defaults: torch's `Model`)."""

    cells: int | None = None  # the entries every live request's cache may hold together (llama.cpp's one shared
    # memory: a server admits by it); None: each request's cache is its own
    cheap_rows: bool = True  # whether a few more rows in a forward cost little beside the forward (torch: t(n)
    # nearly flat for the rows a draft adds); False: t(n) grows with n (llama.cpp's CPU kernels), so strategies'
    # default budgets are sized by t(n)
    min_chunk: int = 1  # the fewest rows a prompt filled in chunks may end with (a shorter rest joins the chunk
    # before): llama.cpp's TILED, which its prompt calls take in one piece (runtime/llama/calls.py `parts`)
    fill_rows: int = 0  # the prompt rows a step may give the requests filling their prompts while none decodes, in
    # whole chunks (engine/batch.py `step`): llama.cpp's N_BATCH, whose prompt rows keep their bits in any calls on
    # the chunks' grid (docs/algorithms.md §10.5.2); 0: one chunk a step
    root_in_prompt: bool = False  # whether the prompt's last call also gives its last token's logits, the first
    # step's root (engine/steps.py `start`): llama.cpp, where that row has the same bits however the prompt was cut
    # into calls on the grid (§10.5.2), as llama.cpp itself does, saving a call a request; False: the first step
    # scores the root (torch, whose rows' bits depend on their call's size: its fp32 records stay bit for bit)


class Backend(Protocol):
    """Runs forward passes of one model over blocks of rows against per-request caches (module docstring)."""

    context_length: int
    vocab_size: int
    eos_ids: frozenset[int]  # the model's own end-of-sequence tokens
    device: torch.device  # where its forwards run (its results are on the host whatever it is)
    weights: str  # the number format its weights run in: a torch dtype's name ("float32"), or "gguf" (llama.cpp's)
    traits: Traits  # what the engine's policy reads of it
    kernel_s: float | None  # seconds spent in its own kernels so far (llama.cpp's llama_decode), None: not counted
    call_times: CallTimes | None  # its calls' seconds by rows (runtime/cost.py), where a call's rows are few and
    # its cost grows with them (llama.cpp's exact calls); None: not timed

    @property
    def hidden_size(self) -> int:
        """H of its hidden states (`Rows.hidden`)."""
        ...

    @property
    def shared(self) -> Backend:
        """The backend whose forward runs this one's blocks: itself, or for a request's view of a model (a head's,
        runtime/eagle_head.py) that model, so that the views' blocks batch in one forward (engine/drafting.py)."""
        ...

    def embedding(self) -> Callable[[torch.Tensor], torch.Tensor]:
        """e(ids) -> [n, H] fp32: its input token embedding (what a head over its features reads)."""
        ...

    def forward(self, blocks: Sequence[Block], *, apart: bool = False) -> list[Rows]: ...

    def new_cache(self) -> Cache: ...

    @property
    def cost_key(self) -> str: ...


@dataclass
class Pair:
    """A target, an optional draft model, and the target's tokenizer; `draft_tokenizer` is the draft's own where it
    differs (then only text-level drafting can use it)."""

    target: Backend
    draft: Backend | None
    tokenizer: PreTrainedTokenizerBase
    target_name: str = ""
    draft_name: str = ""
    backend: str = "torch"  # what runs the forwards: "torch" (runtime/model.py) or "llama.cpp" (runtime/llama/)
    draft_tokenizer: PreTrainedTokenizerBase | None = None  # a draft with another tokenizer (drafters/cross_vocab.py)


@runtime_checkable
class PromptMemory(Protocol):
    """A backend that keeps the cells of the prompts it filled chunk by chunk and lends them to a later prompt that
    starts with the same chunks (llama.cpp's shared memory): the same calls over the same tokens, so the same bits.
    A prompt kept with its last call's result (the root's: `Traits.root_in_prompt`) lends the same prompt all its
    cells and that result: how many cells `reuse` lent, and the result where they are the whole prompt."""

    def remember(self, cache: Cache, tokens: list[int], chunk: int, ready: Rows | None = None) -> None: ...

    def reuse(self, cache: Cache, tokens: list[int], chunk: int) -> tuple[int, Rows | None]: ...


def forward1(backend: Backend, cache: Cache, tokens: torch.Tensor | list[int], parents: torch.Tensor | None = None,
             **flags: bool) -> Rows:
    """The result of one block: `backend.forward([Block(cache, tokens, parents, **flags)])[0]`."""
    return backend.forward([Block(cache, tokens, parents, **flags)])[0]


def fit_vocab(logits: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """The logits on the host, the last dimension cut or padded (with -inf, i.e. zero probability) to `vocab_size`.

    Verification, sampling and every drafter's choice run on the host, with each request's CPU generator, over this
    one copy per forward: on a GPU that is one transfer a forward, not a sync for every token read (a no-op on CPU).
    """
    v = logits.shape[-1]
    logits = logits[..., :vocab_size].cpu()
    if v >= vocab_size:
        return logits
    pad = logits.new_full((*logits.shape[:-1], vocab_size - v), float("-inf"))
    return torch.cat([logits, pad], dim=-1)
