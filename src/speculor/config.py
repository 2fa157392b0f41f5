"""Sampling configuration: validated at construction, immutable."""

from __future__ import annotations

import math
from dataclasses import dataclass

from speculor.errors import SpeculorError


def is_int(x: object) -> bool:
    """An int that is not a bool (options are validated with this and `is_num`)."""
    return isinstance(x, int) and not isinstance(x, bool)


def is_num(x: object) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def check_int(name: str, value: object, low: int, high: int) -> None:
    """SpeculorError unless `value` is an int (not a bool) in [low, high]."""
    if not is_int(value) or not low <= value <= high:
        raise SpeculorError(f"{name} must be an integer in [{low}, {high}], got {value!r}")


@dataclass(frozen=True)
class SamplingConfig:
    """How tokens are chosen. temperature 0 means greedy decoding (argmax, lowest id on ties).

    top_k = 0 and top_p = 1 disable those filters. `stop` holds stop strings; generation also stops
    on the tokenizer's end-of-sequence tokens when `stop_on_eos` is set.

    The target's logits are transformed before any choice, at every tree node with that node's own history
    (core/logits.py, in this order): `logit_bias` {token id: added logit}, `repetition_penalty` (a logit z of a token
    in the prompt or output becomes z / r if z > 0 else z · r; 1 = off), `frequency_penalty` and `presence_penalty`
    (z - f · count - p · [count > 0] over the output's tokens; 0 = off); then temperature, top-k, top-p and `min_p`
    (drops tokens whose probability is below min_p times the largest; 0 = off). `logprobs`: None, or the number of
    alternatives (0..20) reported beside each emitted token's log-probability under that transformed distribution.
    """

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    max_new_tokens: int = 128
    stop: tuple[str, ...] = ()
    stop_on_eos: bool = True
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias) pairs; a dict is accepted
    min_p: float = 0.0
    logprobs: int | None = None

    def __post_init__(self) -> None:
        if isinstance(self.logit_bias, dict):
            object.__setattr__(self, "logit_bias", tuple(sorted(self.logit_bias.items())))
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not is_num(value) or not -2 <= value <= 2:
                raise SpeculorError(f"{name} must be a number in [-2, 2], got {value!r}")
        if not is_num(self.repetition_penalty) or not 0 < self.repetition_penalty < math.inf:
            raise SpeculorError(f"repetition_penalty must be a finite number > 0 (1 = off), got "
                                f"{self.repetition_penalty!r}")
        if not is_num(self.min_p) or not 0 <= self.min_p <= 1:
            raise SpeculorError(f"min_p must be in [0, 1], got {self.min_p!r}")
        for pair in self.logit_bias:
            token, bias = pair if len(pair) == 2 else (None, None)
            if not is_int(token) or token < 0 or not is_num(bias) or not -100 <= bias <= 100:
                raise SpeculorError(f"logit_bias maps token ids (>= 0) to numbers in [-100, 100], got {pair!r}")
        if self.logprobs is not None:
            check_int("logprobs", self.logprobs, 0, 20)
        if not isinstance(self.temperature, (int, float)) or math.isnan(self.temperature) or self.temperature < 0:
            raise SpeculorError(f"temperature must be a number >= 0 (0 = greedy), got {self.temperature!r}")
        if math.isinf(self.temperature):
            raise SpeculorError("temperature must be finite")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise SpeculorError(f"top_k must be an integer >= 0 (0 = off), got {self.top_k!r}")
        if not isinstance(self.top_p, (int, float)) or not 0 < self.top_p <= 1:
            raise SpeculorError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not isinstance(self.max_new_tokens, int) or self.max_new_tokens <= 0:
            raise SpeculorError(f"max_new_tokens must be a positive integer, got {self.max_new_tokens!r}")
        if self.seed is not None and not isinstance(self.seed, int):
            raise SpeculorError(f"seed must be an integer, got {self.seed!r}")
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise SpeculorError("stop strings must be non-empty strings")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def transforms(self) -> bool:
        """Whether the target's logits are changed before the choice (bias or penalties)."""
        return bool(self.logit_bias) or self.repetition_penalty != 1 or bool(self.presence_penalty or
                                                                             self.frequency_penalty)
