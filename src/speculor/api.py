"""The user-facing API: `Speculor(pair).generate(prompt, ...)` and `.stream_text(...)`.

    from speculor import Speculor, SamplingConfig, load_pair
    sp = Speculor(load_pair())                      # the default strategy; or e.g. strategy="chain", k=4
    out = sp.generate("Write a haiku about trees.", SamplingConfig(max_new_tokens=64), chat=True)
    print(out.text, out.tau, out.tokens_per_s)
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from speculor import engine
from speculor.config import SamplingConfig
from speculor.drafters.base import Strategy
from speculor.drafters.registry import make_strategy
from speculor.errors import SpeculorError
from speculor.grammar import tools as tool_calls
from speculor.grammar.compile import Constraint, Grammars
from speculor.grammar.state import GrammarState
from speculor.runtime.backend import Pair


@dataclass
class Generation:
    text: str
    token_ids: list[int]
    stats: engine.Stats
    total_s: float
    finish_reason: str  # "stop" (EOS or a stop string), "length", or "tool_calls" (calls were read back)
    tokens: list[engine.Token] = field(default_factory=list)  # with their logprobs when cfg.logprobs is set
    tool_calls: list[tool_calls.Call] = field(default_factory=list)  # with `tools`: the calls read from the text
    content: str | None = None  # with `tools`: the text less the calls (None when nothing is left)

    @property
    def tau(self) -> float:
        return self.stats.tau

    @property
    def tokens_per_s(self) -> float:
        return len(self.token_ids) / self.total_s if self.total_s > 0 else 0.0


def _key(name: str, options: dict[str, Any]) -> tuple[str, str]:
    return name, repr(sorted(options.items()))


class Speculor:
    """A model pair with a default strategy; every call may name another strategy and its options.

    A strategy's shared part (its plans, cost model, head) is built once per (name, options) and kept; every
    generation gets a fresh drafter from it, with its own caches: generations never share request state.
    """

    def __init__(self, pair: Pair, strategy: str = "default", **options: Any) -> None:
        self.pair, self.strategy, self.options = pair, strategy, options
        self._strategies: dict[tuple[str, str], Strategy | None] = {}
        self.strategy_for(strategy, **options)  # validate now
        ids = list(pair.target.eos_ids)
        if pair.tokenizer.eos_token_id is not None:
            ids.append(pair.tokenizer.eos_token_id)
        self.eos_ids = frozenset(ids)
        self._grammars: Grammars | None = None
        self._grammars_made = threading.Lock()

    @property
    def grammars(self) -> Grammars:
        """The tokenizer's compiled constraints (built on first use: ~1 s for llguidance's view of the vocabulary)."""
        with self._grammars_made:
            if self._grammars is None:
                self._grammars = Grammars(self.pair.tokenizer, self.pair.target.vocab_size)
        return self._grammars

    def grammar(self, constraint: Constraint | None) -> GrammarState | None:
        """A request's state of `constraint` (compiled once per constraint), None without one; SpeculorError when
        it does not compile."""
        if constraint is None:
            return None
        return GrammarState(self.grammars.matcher(constraint), self.pair.target.vocab_size, self.eos_ids)

    def tool_constraint(self, tools: list[tool_calls.Tool], tool_choice: Any = None,
                        parallel: bool = True) -> Constraint | None:
        """The constraint of a chat request with `tools` (grammar/tools.py), in this tokenizer's call syntax."""
        mode, allowed = tool_calls.chosen(tools, tool_choice)
        return tool_calls.tool_constraint(allowed, mode, parallel, self.grammars.special("<tool_call>"))

    def encode(self, prompt: str | list[int], chat: bool = False) -> list[int]:
        if isinstance(prompt, list):
            return prompt
        if not isinstance(prompt, str) or not prompt.strip():
            raise SpeculorError("the prompt is empty")
        if chat:
            messages = [{"role": "user", "content": prompt}]
            return self.encode_chat(messages)
        return self.pair.tokenizer(prompt, add_special_tokens=True)["input_ids"]

    def encode_chat(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None) -> list[int]:
        """The model's own chat template over `messages` (tool calls and tool results included) and its `tools`."""
        text = self.pair.tokenizer.apply_chat_template(tool_calls.history(messages), tools=tools, tokenize=False,
                                                       add_generation_prompt=True)
        return self.pair.tokenizer(text, add_special_tokens=False)["input_ids"]

    def strategy_for(self, name: str, **options: Any) -> Strategy | None:
        """The shared part of strategy `name` with `options` (built on first use; SpeculorError if invalid)."""
        key = _key(name, options)
        if key not in self._strategies:
            self._strategies[key] = make_strategy(name, self.pair, **options)
        return self._strategies[key]

    def built(self, name: str, **options: Any) -> bool:
        """Whether strategy `name` with `options` is built already (`strategy_for` then returns at once)."""
        return _key(name, options) in self._strategies

    def forget(self) -> None:
        """Empty what the strategies built so far learned across requests (suffix's trie of outputs): the calls that
        follow start as on a fresh pair (a bench round)."""
        for strategy in self._strategies.values():
            if strategy is not None:  # plain decoding has none
                strategy.forget()

    def options_for(self, strategy: str | None, options: dict[str, Any]) -> tuple[str, dict[str, Any]]:
        """(name, options) of a call: the named strategy with the given options, or the default one with its
        options overridden by the given ones."""
        return (strategy, options) if strategy else (self.strategy, {**self.options, **options})

    def tokens(self, prompt: str | list[int], cfg: SamplingConfig, *, chat: bool = False,
               strategy: str | None = None, stats: engine.Stats | None = None, constraint: Constraint | None = None,
               **options: Any) -> Iterator[engine.Token]:
        """Token events of one generation (no stop-string handling), under `constraint` if given."""
        name, opts = self.options_for(strategy, options)
        shared = self.strategy_for(name, **opts)
        drafter = shared.drafter() if shared is not None else None
        return engine.stream(self.pair.target, drafter, self.encode(prompt, chat), cfg, self.eos_ids, stats,
                             grammar=self.grammar(constraint))

    def stream_text(self, prompt: str | list[int], cfg: SamplingConfig, *, chat: bool = False,
                    strategy: str | None = None, stats: engine.Stats | None = None,
                    constraint: Constraint | None = None, **options: Any) -> Iterator[tuple[str, list[engine.Token]]]:
        """Yield (new text, tokens) as tokens arrive; stops at a stop string (not included in the text)."""
        detok = Detokenizer(self.pair.tokenizer, cfg.stop)
        for tok in self.tokens(prompt, cfg, chat=chat, strategy=strategy, stats=stats, constraint=constraint,
                               **options):
            delta = detok.add(tok)
            if delta or detok.stopped:
                yield delta, detok.pop_tokens()
            if detok.stopped:
                return
        yield detok.flush(), detok.pop_tokens()

    def generate(self, prompt: str | list[int] | list[dict[str, Any]], cfg: SamplingConfig | None = None, *,
                 chat: bool = False, strategy: str | None = None, response_format: dict[str, Any] | None = None,
                 tools: list[dict[str, Any]] | None = None, tool_choice: Any = None,
                 constraint: Constraint | None = None, **options: Any) -> Generation:
        """One generation. `prompt`: text, token ids, or chat messages (then `chat` is implied). Structured output:
        `response_format` as OpenAI's, `tools` (OpenAI's; rendered by the chat template) with `tool_choice`, or any
        `constraint` (grammar/compile.py); with tools the calls come back parsed (`tool_calls`, `content`)."""
        cfg = cfg or SamplingConfig()
        read = tool_calls.read_tools(tools) if tools is not None else []
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], dict):
            prompt, chat = self.encode_chat(prompt, tools), False
        elif tools is not None:
            prompt, chat = self.encode_chat([{"role": "user", "content": prompt}], tools), False
        constraint = (constraint or (self.tool_constraint(read, tool_choice) if read else None)
                      or (tool_calls.response_constraint(response_format) if response_format else None))
        stats = engine.Stats()
        t0 = time.perf_counter()
        text, tokens = [], []
        for delta, toks in self.stream_text(prompt, cfg, chat=chat, strategy=strategy, stats=stats,
                                            constraint=constraint, **options):
            text.append(delta)
            tokens.extend(toks)
        total = time.perf_counter() - t0
        ids = [t.id for t in tokens]
        stopped = len(ids) < cfg.max_new_tokens or (ids and ids[-1] in self.eos_ids)
        out = Generation("".join(text), ids, stats, total, "stop" if stopped else "length", tokens)
        if read and tool_choice != "none":
            out.content, out.tool_calls = tool_calls.calls(out.text, read)
            out.finish_reason = "tool_calls" if out.tool_calls and stopped else out.finish_reason
        return out


class Detokenizer:
    """Incremental decoding with stop strings: text is released only once no stop string can begin in it."""

    def __init__(self, tokenizer: Any, stop: tuple[str, ...]) -> None:
        self.tokenizer, self.stop = tokenizer, stop
        self.ids: list[int] = []
        self.pending: list[engine.Token] = []
        self.sent = 0  # characters of the decoded text already released
        self.stopped = False

    def add(self, tok: engine.Token) -> str:
        self.ids.append(tok.id)
        self.pending.append(tok)
        text = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        if text.endswith("\ufffd"):  # an incomplete UTF-8 sequence: wait for the next token
            return ""
        for s in self.stop:
            at = text.find(s, max(self.sent - len(s), 0))
            if at >= 0:
                self.stopped = True
                return self._release(text[:at])
        hold = max((len(s) - 1 for s in self.stop), default=0)
        return self._release(text[: len(text) - hold] if hold else text)

    def flush(self) -> str:
        return self._release(self.tokenizer.decode(self.ids, skip_special_tokens=True))

    def pop_tokens(self) -> list[engine.Token]:
        toks, self.pending = self.pending, []
        return toks

    def _release(self, text: str) -> str:
        delta = text[self.sent:] if len(text) > self.sent else ""
        self.sent = max(self.sent, len(text))
        return delta
