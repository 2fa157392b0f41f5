"""The peers a user would pick instead, run in the same benchmark: llama.cpp's own plain decoding of the target's
GGUF file, and transformers' own speculative generation.

    llama.cpp               llama-cpp-python's high-level `Llama` over the target's GGUF, greedy (or its own
                            sampler at T > 0), the same threads: what CPU users run (loaded per call, not timed)
    llama.cpp-lookup        the same with llama-cpp-python's own model-free drafting, prompt lookup
                            (`LlamaPromptLookupDecoding(num_pred_tokens=2)`, its README's advice for CPUs)

    hf-assisted             generate(assistant_model=draft)       (assisted generation, same draft, the
                            draft's generation config: transformers' defaults are 20 tokens, constant schedule,
                            confidence threshold 0.4)
    hf-assisted-heuristic   the same with num_assistant_tokens_schedule="heuristic" from 5 tokens (+2 after a fully
                            accepted draft, -1 otherwise) and the confidence stop off
    hf-assisted-confidence  the same with a constant 20-token budget cut short when the draft's top probability
                            falls below assistant_confidence_threshold = 0.4
    hf-prompt-lookup        generate(prompt_lookup_num_tokens=10)      (n-gram lookup in the prompt)

    llama-server            llama.cpp's own server over the target's GGUF, the same threads, one request at a time
    llama-server:CONFIG     through its /completion with the prompt's token ids: plain decoding, or its own
                            speculation (CONFIG: ngram-mod, draft, ngram-simple, ...; bench/peer_server.py CONFIGS);
                            each configuration's server started once a round and kept for it (bench/run.py)

transformers reads the assisted-generation settings from the draft model's generation_config (and the heuristic
schedule writes its last draft length back there); the peers set them for the call and restore them after.

The peers run the models as the user gave them: plain nn.Linear arithmetic over the original fp32 weights. The fast
kernels (runtime/kernels.py) keep only packed copies of those weights, so for a pair loaded with them `as_given`
loads the models again from disk for the one call and frees them after it (the load is not timed); a pair of stock
models (`--kernels eager`, a GPU, bf16) is used as it is. Only one extra copy lives, and only during a peer's call.
"""

from __future__ import annotations

import gc
import time
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import Any

import torch

from speculor.bench import peer_server
from speculor.config import SamplingConfig
from speculor.errors import SpeculorError
from speculor.runtime.backend import Pair
from speculor.runtime.kernels import is_packed
from speculor.runtime.lean import is_joined
from speculor.runtime.load import load_model
from speculor.runtime.model import Model

SERVER_PEERS = tuple(peer_server.label(c) for c in peer_server.CONFIGS)  # llama-server, llama-server:ngram-mod, ...
PEERS = ("llama.cpp", "llama.cpp-lookup", "hf-assisted", "hf-assisted-heuristic", "hf-assisted-confidence",
         "hf-prompt-lookup", *SERVER_PEERS)
LLAMA_PEERS = ("llama.cpp", "llama.cpp-lookup")  # the peers that run llama-cpp-python over the target's GGUF
LOOKUP_TOKENS = 2  # llama.cpp-lookup's num_pred_tokens: llama-cpp-python's README advises 2 on CPU-only machines
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


def _model_as_given(lm: Model, spec: str) -> torch.nn.Module:
    """lm's transformers model if its linears are stock, else the same model loaded again from `spec` (the
    fast kernels released the original weights; joined projections changed its structure)."""
    if not is_packed(lm.model) and not is_joined(lm.model):
        return lm.model
    if not spec:
        raise SpeculorError("the transformers peers need the models as given, but this pair was built with the fast "
                            "kernels and without model names to load them again from; load it with packed=False "
                            "(--kernels eager)")
    model, _ = load_model(spec, device=str(lm.device), dtype=lm.dtype)
    return model.eval()


def models_as_given(pair: Pair, with_draft: bool) -> tuple[torch.nn.Module, torch.nn.Module | None]:
    """(target, draft or None) with plain nn.Linear arithmetic over the original weights: the pair's own models where
    they are stock, else copies loaded from disk, which the caller drops (and `gc.collect()`s) after its call."""
    target = _model_as_given(pair.target, pair.target_name)
    draft = _model_as_given(pair.draft, pair.draft_name) if with_draft and pair.draft is not None else None
    return target, draft


def _generate(pair: Pair, name: str, ids: torch.Tensor, kwargs: dict) -> tuple[torch.Tensor, float]:
    """(output ids, wall seconds) of the peer's generate call; the models reloaded for it go when this returns."""
    assisted = name in ASSISTANT_SETTINGS
    target, draft = models_as_given(pair, with_draft=assisted)
    if assisted:
        kwargs = kwargs | {"assistant_model": draft}
    with generation_settings(draft, ASSISTANT_SETTINGS.get(name, {})):
        t0 = time.perf_counter()
        out = target.generate(ids, attention_mask=torch.ones_like(ids), **kwargs)
        return out, time.perf_counter() - t0


def unfit(pair: Pair, name: str, binary: str | None = None) -> str:
    """Why peer `name` cannot run beside this pair ('' where it can): llama.cpp's needs the target's GGUF file and
    llama-cpp-python (llama-server: its binary, `binary` or found; its `draft` configuration: the draft's GGUF
    file too),
    transformers' peers a pair on torch."""
    from speculor.runtime import llama

    if name in SERVER_PEERS:
        try:
            peer_server.find_binary(binary)
        except SpeculorError:
            return "no llama-server binary (`make llama-server`)"
        target, draft = server_ggufs(pair)
        if target is None:
            return "the target is not a GGUF file"
        return "the draft is not a GGUF file" if draft is None and peer_server.config_of(name) == "draft" else ""
    if name in LLAMA_PEERS:
        if not llama.available():
            return "llama-cpp-python is not installed"
        return "" if is_gguf(pair.target_name) else "the target is not a GGUF file"
    return "" if pair.backend == "torch" else f"it runs the models in transformers, the pair is on {pair.backend}"


def is_gguf(spec: str | None) -> bool:
    """Whether a model spec names a GGUF file (an embedded model's or a .gguf path)."""
    from speculor.runtime import embedded

    return bool(spec) and (spec in embedded.EMBEDDED or spec.endswith(".gguf"))


def server_ggufs(pair: Pair) -> tuple[Path | None, Path | None]:
    """The GGUF files llama-server runs beside this pair: the target's and the draft's (None where not GGUF)."""
    from speculor.runtime.prepare import gguf_file

    return tuple(gguf_file(name) if is_gguf(name) else None  # type: ignore[return-value]
                 for name in (pair.target_name, pair.draft_name))


def open_servers(pair: Pair, labels: list[str], context: int, log_dir: Path | None,
                 binary: str | None = None) -> peer_server.Servers | nullcontext[None]:
    """The llama-servers bench's peer rows `labels` ask (bench/peer_server.py `Servers`: each started at its first
    request of a round, stopped at the round's end and the run's), or a nullcontext where none is asked; a
    SpeculorError where they cannot run."""
    if not any(label in SERVER_PEERS for label in labels):
        return nullcontext()
    target, draft = server_ggufs(pair)
    if target is None:
        raise SpeculorError("the llama-server peers run the target's GGUF file: the target is not one")
    if draft is None and f"{peer_server.SERVER}:draft" in labels:
        raise SpeculorError("llama-server:draft runs the draft's GGUF file (-md): the draft is not one")
    return peer_server.Servers(peer_server.find_binary(binary), target, draft, threads=torch.get_num_threads(),
                               context=context, log_dir=log_dir)


def peer_generate(pair: Pair, name: str, prompt: list[int], cfg: SamplingConfig,
                  eos_ids: frozenset[int]) -> tuple[list[int], float, float | None]:
    """(new token ids, wall seconds, seconds to the first token or None where the peer does not say) of `name`."""
    if name in LLAMA_PEERS:
        return llama_generate(pair, prompt, cfg, eos_ids, lookup=name == "llama.cpp-lookup")
    return *hf_generate(pair, name, prompt, cfg, eos_ids), None


def llama_generate(pair: Pair, prompt: list[int], cfg: SamplingConfig, eos_ids: frozenset[int],
                   lookup: bool = False) -> tuple[list[int], float, float]:
    """(new token ids, wall seconds prefill included, seconds to the first token: the prompt's evaluation) of
    llama.cpp's plain decoding of the target's GGUF, or with `lookup` its prompt-lookup drafting."""
    from speculor.runtime.llama.model import quiet_llama
    from speculor.runtime.prepare import gguf_file

    options = {}
    if lookup:
        from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

        options["draft_model"] = LlamaPromptLookupDecoding(num_pred_tokens=LOOKUP_TOKENS)
    llm = quiet_llama(gguf_file(pair.target_name), threads=torch.get_num_threads(),
                      n_ctx=len(prompt) + cfg.max_new_tokens + 8, seed=cfg.seed or 0, **options)
    sample = ({"temp": 0.0, "top_k": 1} if cfg.greedy else
              {"temp": cfg.temperature, "top_p": cfg.top_p, "top_k": cfg.top_k or 0, "min_p": 0.0})
    out: list[int] = []
    t0 = time.perf_counter()
    first = None
    for tok in llm.generate(prompt, reset=True, repeat_penalty=1.0, **sample):
        first = first or time.perf_counter() - t0
        if cfg.stop_on_eos and tok in eos_ids:
            break
        out.append(tok)
        if len(out) == cfg.max_new_tokens:
            break
    wall = time.perf_counter() - t0
    llm.close()
    return out, wall, first or wall


@torch.inference_mode()
def hf_generate(pair: Pair, name: str, prompt: list[int], cfg: SamplingConfig,
                eos_ids: frozenset[int]) -> tuple[list[int], float]:
    """(new token ids, wall seconds) of transformers' generate with the peer's option."""
    if pair.backend != "torch":
        raise SpeculorError(f"the transformers peer {name!r} runs the models in transformers: use --backend torch "
                            "(the llama.cpp peer runs beside either backend)")
    kwargs: dict = {"max_new_tokens": cfg.max_new_tokens, "do_sample": not cfg.greedy}
    if name in ASSISTANT_SETTINGS:
        if pair.draft is None:
            raise SpeculorError(f"{name} needs a draft model")
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
    kwargs |= {"eos_token_id": eos, "pad_token_id": (eos or [0])[0]}
    out, wall = _generate(pair, name, torch.tensor([prompt], device=pair.target.device), kwargs)
    gc.collect()  # a reloaded copy of the models goes now, not at some later collection
    return out[0, len(prompt):].tolist(), wall
