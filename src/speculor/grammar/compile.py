"""Constraints compiled for one tokenizer by llguidance, once per constraint, and a fresh matcher per request.

A `Constraint` names what the output must match: a JSON schema, any JSON object, a Lark grammar (llguidance's
dialect: `%json {...}` inlines a schema, `<tool_call>` names a special token, `[lazy]` lexemes trigger a call), a
GBNF grammar (llama.cpp's, converted by llguidance's gbnf_to_lark) or a regular expression. `Grammars` builds the
llguidance tokenizer once (~1 s on a 151,936-token vocabulary) and keeps each compiled constraint as a template
matcher; a request gets `deep_copy()` of it (no state is shared between requests).

Why llguidance and not xgrammar (both in the registry, docs/bench/grammar/README.md): no dependency beyond itself
(xgrammar pulls triton, 286 MB, and a tvm runtime), Lark with inline schemas and lazy triggers (tool_choice auto),
GBNF conversion, rollback and fast-forward tokens; its mask time is measured in that README.
"""

from __future__ import annotations

import json
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Literal

from speculor.errors import SpeculorError

Kind = Literal["json_schema", "json_object", "lark", "gbnf", "regex"]
# the separators this model family writes (`{"a": 1, "b": 2}`), fixed: the spaces become forced bytes, not choices
JSON_STYLE = {"item_separator": ", ", "key_separator": ": ", "whitespace_flexible": False}
CACHE_SIZE = 256  # compiled constraints kept per tokenizer (a template matcher each)


@dataclass(frozen=True)
class Constraint:
    """What the output must match: `kind` and its `source` (a schema as JSON text, or a grammar's text)."""

    kind: Kind
    source: str = ""

    @staticmethod
    def json_schema(schema: dict[str, Any] | bool) -> Constraint:
        if not isinstance(schema, (dict, bool)):
            raise SpeculorError(f"a JSON schema is an object, got {type(schema).__name__}")
        return Constraint("json_schema", json.dumps(schema))  # as given: the order of properties is the output's

    def grammar(self) -> str:
        """The llguidance grammar (its JSON form) of this constraint; SpeculorError when it cannot be written."""
        import llguidance as ll

        try:
            if self.kind == "json_object":
                return ll.LLMatcher.grammar_from_json_schema({"type": "object"}, overrides=JSON_STYLE)
            if self.kind == "json_schema":
                return ll.LLMatcher.grammar_from_json_schema(self.source, defaults=JSON_STYLE)
            if self.kind == "regex":
                return ll.LLMatcher.grammar_from_regex(self.source)
            if self.kind == "gbnf":
                from llguidance.gbnf_to_lark import GbnfToLarkError, any_to_lark

                try:
                    return ll.LLMatcher.grammar_from_lark(any_to_lark(self.source))
                except GbnfToLarkError as exc:
                    raise ValueError(str(exc)) from exc
            return ll.LLMatcher.grammar_from_lark(self.source)
        except (ValueError, TypeError, AssertionError) as exc:  # gbnf_to_lark asserts on what it cannot read
            raise SpeculorError(f"invalid {self.kind.replace('_', ' ')}: {exc}") from exc


class Grammars:
    """A tokenizer's compiled constraints: `matcher(constraint)` is a fresh matcher, compiled on first use."""

    def __init__(self, tokenizer: Any, vocab_size: int) -> None:
        """`tokenizer`: a transformers fast tokenizer, or an object with llguidance's TokenizerWrapper fields
        (`tokens` as bytes, `eos_token_id`, `bos_token_id`, and tokenizing when called: tests' byte vocabularies)."""
        import llguidance as ll
        import llguidance.hf

        if hasattr(tokenizer, "backend_tokenizer"):
            self.tokenizer = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size)
        else:
            self.tokenizer = ll.LLTokenizer(ll.TokenizerWrapper(tokenizer), n_vocab=vocab_size)
        self.vocab_size = vocab_size
        self._templates: OrderedDict[Constraint, Any] = OrderedDict()

    def special(self, text: str) -> bool:
        """Whether `text` is one token of the vocabulary that llguidance holds special (it then matches no text: a
        grammar names it `<text>`)."""
        ids = self.tokenizer.tokenize_str(text)
        return len(ids) == 1 and self.tokenizer.is_special_token(ids[0])

    def matcher(self, constraint: Constraint) -> Any:
        """A new llguidance matcher at the start of `constraint`; SpeculorError naming the problem if it does not
        compile."""
        template = self._templates.get(constraint)
        if template is None:
            import llguidance as ll

            template = ll.LLMatcher(self.tokenizer, constraint.grammar(), log_level=0)
            if template.is_error():
                raise SpeculorError(f"the {constraint.kind.replace('_', ' ')} does not compile: "
                                    f"{template.get_error()}")
            self._templates[constraint] = template
            if len(self._templates) > CACHE_SIZE:
                self._templates.popitem(last=False)
        else:
            self._templates.move_to_end(constraint)
        return template.deep_copy()
