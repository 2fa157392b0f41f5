"""transformers' own speculative generation, run as peers in the same benchmark.

    hf-assisted             generate(assistant_model=draft)       (assisted generation, same draft, the
                            draft's generation config: transformers' defaults are 20 tokens, constant schedule,
                            confidence threshold 0.4)
    hf-assisted-heuristic   the same with num_assistant_tokens_schedule="heuristic" from 5 tokens (+2 after a fully
                            accepted draft, -1 otherwise) and the confidence stop off
    hf-assisted-confidence  the same with a constant 20-token budget cut short when the draft's top probability
                            falls below assistant_confidence_threshold = 0.4
    hf-prompt-lookup        generate(prompt_lookup_num_tokens=10)      (n-gram lookup in the prompt)

transformers reads the assisted-generation settings from the draft model's generation_config (and the heuristic
schedule writes its last draft length back there); the peers set them for the call and restore them after.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

from speculor.config import SamplingConfig
from speculor.errors import SpeculorError
from speculor.runtime.kernels import eager
from speculor.runtime.loading import Pair

PEERS = ("hf-assisted", "hf-assisted-heuristic", "hf-assisted-confidence", "hf-prompt-lookup")
ASSISTANT_SETTINGS: dict[str, dict[str, Any]] = {
    "hf-assisted": {},
    "hf-assisted-heuristic": {"num_assistant_tokens_schedule": "heuristic", "num_assistant_tokens": 5,
                              "assistant_confidence_threshold": 0.0},
    "hf-assisted-confidence": {"num_assistant_tokens_schedule": "constant", "num_assistant_tokens": 20,
                               "assistant_confidence_threshold": 0.4},
}


@contextmanager
def generation_settings(model: torch.nn.Module | None, settings: dict[str, Any]) -> Iterator[None]:
    """Set attributes of model.generation_config inside the block; restore their values (or absence) after."""
    config = getattr(model, "generation_config", None)
    if config is None or not settings:
        yield
        return
    missing = object()
    saved = {k: getattr(config, k, missing) for k in settings}
    for k, v in settings.items():
        setattr(config, k, v)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is missing:
                delattr(config, k)
            else:
                setattr(config, k, v)


@torch.inference_mode()
def hf_generate(pair: Pair, name: str, prompt: list[int], cfg: SamplingConfig,
                eos_ids: frozenset[int]) -> tuple[list[int], float]:
    """(new token ids, wall seconds) of transformers' generate with the peer's option."""
    kwargs: dict = {"max_new_tokens": cfg.max_new_tokens, "do_sample": not cfg.greedy}
    if name in ASSISTANT_SETTINGS:
        if pair.draft is None:
            raise SpeculorError(f"{name} needs a draft model")
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
    draft = pair.draft.model if pair.draft else None
    with eager(pair.target.model, draft), generation_settings(draft, ASSISTANT_SETTINGS.get(name, {})):
        out = pair.target.model.generate(ids, attention_mask=torch.ones_like(ids), eos_token_id=eos,
                                         pad_token_id=(eos or [0])[0], **kwargs)
    wall = time.perf_counter() - t0
    return out[0, len(prompt):].tolist(), wall
