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
    """

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    max_new_tokens: int = 128
    stop: tuple[str, ...] = ()
    stop_on_eos: bool = True

    def __post_init__(self) -> None:
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
