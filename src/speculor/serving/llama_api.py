"""llama-server's own routes, answered as llama-server answers them (its tools/server/README.md; checked against the
binary built from the llama.cpp source llama-cpp-python vendors): POST /completion (also /completions), POST /tokenize,
POST /detokenize, GET /props. GET /health is the app's own ({"status": "ok", ...}).

/completion takes the job path every generation takes (serving/app.py `_Server.submit`, /v1/completions' own): its
request becomes a `CompletionRequest` (`as_completion`) with llama-server's defaults (temperature 0.8, top_k 40, top_p
0.95, min_p 0.05; n_predict -1: the server's `-n`, else the rest of the context). `prompt` is text (tokenized with the
model's special tokens, as llama-server does) or token ids. Answers: `content`, `tokens` (ids; with `return_tokens`, or
each streamed chunk's), `stop`, `model`, `tokens_predicted`, `tokens_evaluated`, `tokens_cached`, `prompt`,
`has_new_line`, `truncated` (never: no context shift here), `stop_type` (eos, word, limit), `stopping_word`,
`generation_settings` (the settings that apply here) and `timings`; `stream: true` sends each new piece of text as
`data: {"content", "tokens", "stop": false, ...}` and ends with the whole answer's fields and `"stop": true`.

Fields: those above; llama-server's sampler fields are accepted at their off values only (a 400 names one set
otherwise: they would change the answer and are not implemented), and its fields that act only through those
samplers, or only on its own cache (`cache_prompt`, `n_keep`), are accepted with no effect. `presence_penalty` and
`frequency_penalty` are among the refused: llama.cpp counts them over its last `repeat_last_n` tokens, not as
/v1/completions does. Any other field is a 400 naming it. Sampling applies temperature before top-k, top-p and
min-p (transformers' order, core/logits.py); llama.cpp applies it after them: greedy answers are the same, sampled
ones are drawn from a slightly different distribution wherever a truncation and a temperature other than 1 combine.
"""

from __future__ import annotations

import functools
import json
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from speculor.serving.errors import APIError
from speculor.serving.formats import sse
from speculor.serving.scheduler import Delta, Done, Failed, Job
from speculor.serving.schemas import CompletionRequest, SpeculativeOptions

RANDOM_SEEDS = (-1, 0xFFFFFFFF)  # llama-server's "a random seed" (LLAMA_DEFAULT_SEED)
# llama-server's sampler fields at the values that turn them off: accepted only so
NEUTRAL = {"typical_p": 1.0, "dynatemp_range": 0.0, "xtc_probability": 0.0, "mirostat": 0, "dry_multiplier": 0.0,
           "top_n_sigma": -1.0, "repeat_penalty": 1.0, "presence_penalty": 0.0, "frequency_penalty": 0.0,
           "ignore_eos": False, "n_probs": 0, "id_slot": -1, "n_indent": 0, "t_max_predict_ms": 0,
           "post_sampling_probs": False, "timings_per_token": False, "return_progress": False, "samplers": None}


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")


class LlamaCompletion(_Strict):
    """POST /completion's body (llama-server's names and defaults)."""

    prompt: str | list[int]
    n_predict: int = Field(-1, ge=-1)
    temperature: float = Field(0.8, ge=0, allow_inf_nan=False)
    top_k: int = Field(40, ge=0)
    top_p: float = Field(0.95, gt=0, le=1, allow_inf_nan=False)
    min_p: float = Field(0.05, ge=0, le=1, allow_inf_nan=False)
    seed: int = Field(-1, ge=-1, le=0xFFFFFFFF)
    stop: list[str] = Field(default_factory=list, max_length=16)
    stream: bool = False
    return_tokens: bool = False
    logit_bias: list[tuple[int, float]] | dict[str, float] | None = None
    json_schema: dict[str, Any] | None = None
    grammar: str = ""
    model: str | None = None
    speculative: SpeculativeOptions | None = None  # this server's extension, as on /v1/completions
    # no effect here: llama-server's own prompt cache, and the settings of samplers that are off
    cache_prompt: bool | None = None
    n_keep: int | None = None
    repeat_last_n: int | None = None
    dynatemp_exponent: float | None = None
    xtc_threshold: float | None = None
    mirostat_tau: float | None = None
    mirostat_eta: float | None = None
    dry_base: float | None = None
    dry_allowed_length: int | None = None
    dry_penalty_last_n: int | None = None
    dry_sequence_breakers: list[str] | None = None
    min_keep: int | None = None
    # accepted at their off values only (NEUTRAL)
    typical_p: Any = None
    dynatemp_range: Any = None
    xtc_probability: Any = None
    mirostat: Any = None
    dry_multiplier: Any = None
    top_n_sigma: Any = None
    repeat_penalty: Any = None
    presence_penalty: Any = None
    frequency_penalty: Any = None
    ignore_eos: Any = None
    n_probs: Any = None
    id_slot: Any = None
    n_indent: Any = None
    t_max_predict_ms: Any = None
    post_sampling_probs: Any = None
    timings_per_token: Any = None
    return_progress: Any = None
    samplers: Any = None


class TokenizeRequest(_Strict):
    content: str
    add_special: bool = False
    parse_special: bool = True
    with_pieces: bool = False


class DetokenizeRequest(_Strict):
    tokens: list[int]


def as_completion(req: LlamaCompletion, n_predict: int | None) -> CompletionRequest:
    """The /v1/completions request a /completion request is (`n_predict`: the server's default, None: the rest of the
    context). Raises APIError 400 for a field set to what this server does not implement."""
    for name, off in NEUTRAL.items():
        value = getattr(req, name)
        if name in req.model_fields_set and value != off and not (off is None and value in ([], "")):
            raise APIError(400, f"{name} is not supported by this server (only {json.dumps(off)}, llama-server's "
                           "value that turns it off)", param=name, code="unsupported_field")
    if req.n_predict == 0:
        raise APIError(400, "n_predict must be -1 (the server's default) or at least 1", param="n_predict")
    bias = req.logit_bias
    body: dict[str, Any] = {
        "prompt": req.prompt, "max_tokens": req.n_predict if req.n_predict > 0 else n_predict,
        "temperature": req.temperature, "top_k": req.top_k, "top_p": req.top_p, "min_p": req.min_p,
        "seed": None if req.seed in RANDOM_SEEDS else req.seed, "stop": req.stop or None, "stream": req.stream,
        "logit_bias": {str(i): b for i, b in bias} if isinstance(bias, list) else bias,
        "json_schema": req.json_schema, "grammar": req.grammar or None, "speculative": req.speculative}
    return CompletionRequest.model_validate({k: v for k, v in body.items() if v is not None or k == "max_tokens"})


def settings(req: CompletionRequest, n_ctx: int) -> dict[str, Any]:
    """`generation_settings`: what applies to this request, by llama-server's names."""
    return {"n_ctx": n_ctx, "n_predict": req.max_tokens or -1, "max_tokens": req.max_tokens or -1,
            "seed": 0xFFFFFFFF if req.seed is None else req.seed, "temperature": req.temperature,
            "top_k": req.top_k, "top_p": req.top_p, "min_p": req.min_p, "stop": list(req.stop or []),
            "stream": req.stream, "n_probs": 0, "grammar": req.grammar or "",
            "samplers": ["temperature", "top_k", "top_p", "min_p"],
            "speculative": req.speculative.model_dump() if req.speculative else None}


@dataclass
class Answer:
    """One /completion answer being made: the request's fixed fields, and its text, tokens and clock so far."""

    model: str
    prompt: str
    prompt_n: int
    generation_settings: dict[str, Any]
    return_tokens: bool = False
    t0: float = field(default_factory=time.perf_counter)
    t_first: float | None = None
    text: str = ""
    ids: list[int] = field(default_factory=list)

    def partial(self, delta: Delta) -> dict[str, Any]:
        """A streamed piece (and the answer's text and tokens so far)."""
        self.text += delta.text
        self.ids.extend(t.id for t in delta.tokens)
        if self.t_first is None:
            self.t_first = time.perf_counter()
        return {"index": 0, "content": delta.text, "tokens": [t.id for t in delta.tokens], "stop": False,
                "id_slot": -1, "tokens_predicted": len(self.ids), "tokens_evaluated": self.prompt_n}

    def final(self, done: Done, whole: bool) -> dict[str, Any]:
        """The answer's fields once done: with its content (and tokens, if asked) when `whole`, else without (a
        stream's last event)."""
        n = done.usage["completion_tokens"]
        stop_type = {"length": "limit", "cancelled": "none"}.get(done.finish_reason,
                                                                 "eos" if done.stop_word is None else "word")
        return {"index": 0, "content": self.text if whole else "",
                "tokens": self.ids if whole and self.return_tokens else [], "id_slot": -1, "stop": True,
                "model": self.model, "tokens_predicted": n, "tokens_evaluated": self.prompt_n,
                "generation_settings": self.generation_settings, "prompt": self.prompt,
                "has_new_line": "\n" in self.text, "truncated": False, "stop_type": stop_type,
                "stopping_word": done.stop_word or "", "tokens_cached": self.prompt_n + n - 1,
                "timings": self.timings(n)}

    def timings(self, n: int) -> dict[str, Any]:
        """llama-server's timings, measured here: the prompt's to the first text, the rest the tokens'."""
        now = time.perf_counter()
        first = self.t_first or now
        prompt_ms, predicted_ms = (first - self.t0) * 1e3, (now - first) * 1e3
        return {"cache_n": 0, "prompt_n": self.prompt_n, "prompt_ms": prompt_ms,
                "prompt_per_token_ms": prompt_ms / self.prompt_n,
                "prompt_per_second": 1e3 * self.prompt_n / prompt_ms if prompt_ms > 0 else 0.0,
                "predicted_n": n, "predicted_ms": predicted_ms,
                "predicted_per_token_ms": predicted_ms / n if n else 0.0,
                "predicted_per_second": 1e3 * n / predicted_ms if predicted_ms > 0 else 0.0}

    async def whole(self, job: Job) -> dict[str, Any]:
        """The answer once the job is done (the caller watches the client). Raises the job's APIError."""
        async for event in job.stream():
            if isinstance(event, Delta):
                self.partial(event)
            elif isinstance(event, Failed):
                raise event.error
            else:
                return self.final(event, whole=True)
        raise APIError(500, "the generation ended without a result", type="server_error")  # unreachable

    async def events(self, job: Job) -> AsyncIterator[str]:
        """The server-sent events of a streamed answer: its pieces, then its last event (`stop: true`); an error
        after the headers went out is an `{"error": ...}` event."""
        async for event in job.stream():
            if isinstance(event, Delta):
                yield sse(self.partial(event))
            elif isinstance(event, Failed):
                yield sse(event.error.body())
            else:
                yield sse(self.final(event, whole=False))


def piece(tokenizer: Any, token: int) -> str | list[int]:
    """A token's piece as llama-server's /tokenize gives it: its text, or its bytes where they are not whole UTF-8
    (a character split over tokens)."""
    text = tokenizer.decode([token], skip_special_tokens=False)
    if "\ufffd" not in text:
        return text
    raw = _byte_level(tokenizer.convert_ids_to_tokens(token))
    return text if raw is None else list(raw)


def _byte_level(symbol: str) -> bytes | None:
    """The bytes of a byte-level BPE symbol (GPT-2's byte-to-character table); None for another kind of symbol."""
    table = _byte_table()
    if not all(c in table for c in symbol):
        return None
    return bytes(table[c] for c in symbol)


@functools.cache
def _byte_table() -> dict[str, int]:
    """GPT-2's byte-level BPE table (transformers'), character to byte."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    return {c: b for b, c in bytes_to_unicode().items()}
