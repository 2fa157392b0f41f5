"""transformers' own speculative generation, run as peers in the same benchmark.

    hf-assisted       generate(assistant_model=draft)            (assisted generation, same draft)
    hf-prompt-lookup  generate(prompt_lookup_num_tokens=10)      (n-gram lookup in the prompt)
"""

from __future__ import annotations

import time

import torch

from speculor.config import SamplingConfig
from speculor.errors import SpeculorError
from speculor.kernels import eager
from speculor.models import Pair

PEERS = ("hf-assisted", "hf-prompt-lookup")


@torch.inference_mode()
def hf_generate(pair: Pair, name: str, prompt: list[int], cfg: SamplingConfig,
                eos_ids: frozenset[int]) -> tuple[list[int], float]:
    """(new token ids, wall seconds) of transformers' generate with the peer's option."""
    kwargs: dict = {"max_new_tokens": cfg.max_new_tokens, "do_sample": not cfg.greedy}
    if name == "hf-assisted":
        if pair.draft is None:
            raise SpeculorError("hf-assisted needs a draft model")
        kwargs["assistant_model"] = pair.draft.model
    elif name == "hf-prompt-lookup":
        kwargs["prompt_lookup_num_tokens"] = 10
    else:
        raise SpeculorError(f"unknown peer {name!r}")
    if not cfg.greedy:
        kwargs |= {"temperature": cfg.temperature, "top_p": cfg.top_p, "top_k": cfg.top_k or None}
        if cfg.seed is not None:
            torch.manual_seed(cfg.seed)
    else:
        kwargs |= {"temperature": None, "top_p": None, "top_k": None}
    eos = sorted(eos_ids) if cfg.stop_on_eos else None
    ids = torch.tensor([prompt], device=pair.target.device)
    t0 = time.perf_counter()
    with eager(pair.target.model, pair.draft.model if pair.draft else None):  # the models as the user gave them
        out = pair.target.model.generate(ids, attention_mask=torch.ones_like(ids), eos_token_id=eos,
                                         pad_token_id=(eos or [0])[0], **kwargs)
    wall = time.perf_counter() - t0
    return out[0, len(prompt):].tolist(), wall
