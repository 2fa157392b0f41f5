"""Request bodies of the OpenAI-compatible server, as strict pydantic models.

Contract: fields of the wrong type are refused (strict validation, no coercion), and so is every field these
models do not declare (a 400 naming it: a request field is never silently ignored). Declared but harmless:
`user`, `metadata`, `store`, `service_tier` (accepted, no effect on the answer). Declared and refused when set
(`UNSUPPORTED`): the app answers 400 naming them. `speculative` keeps unknown keys: they are the strategy's
options, checked later by its builder. Semantic checks that need the model (context length, token ids, strategy
options) are the app's job, not these models'.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

SEED_RANGE = (-(2**63), 2**64 - 1)  # what torch.Generator.manual_seed accepts
MAX_N = 8  # choices per request
MAX_TOP_LOGPROBS = 20


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")


class SpeculativeOptions(BaseModel):
    """`{"strategy": name, **options}`; the options are checked by the strategy's builder."""

    model_config = ConfigDict(strict=True, extra="allow")
    strategy: str | None = None


class StreamOptions(_Strict):
    include_usage: bool = False


class GenerationRequest(_Strict):
    """The fields shared by /v1/completions and /v1/chat/completions."""

    model: str | None = None
    temperature: float = Field(1.0, ge=0, allow_inf_nan=False)
    top_p: float = Field(1.0, gt=0, le=1, allow_inf_nan=False)
    top_k: int = Field(0, ge=0)
    min_p: float = Field(0.0, ge=0, le=1, allow_inf_nan=False)
    presence_penalty: float = Field(0.0, ge=-2, le=2, allow_inf_nan=False)
    frequency_penalty: float = Field(0.0, ge=-2, le=2, allow_inf_nan=False)
    repetition_penalty: float = Field(1.0, gt=0, allow_inf_nan=False)
    logit_bias: dict[str, Annotated[float, Field(ge=-100, le=100, allow_inf_nan=False)]] | None = None
    seed: int | None = Field(None, ge=SEED_RANGE[0], le=SEED_RANGE[1])
    stop: str | Annotated[list[str], Field(max_length=16)] | None = None
    n: int = Field(1, ge=1, le=MAX_N, description="independent choices, each with its own seed")
    stream: bool = False
    stream_options: StreamOptions | None = None
    speculative: SpeculativeOptions | None = None
    # harmless: accepted, no effect on the answer
    user: str | None = None
    metadata: dict[str, str] | None = None
    store: bool | None = None
    service_tier: str | None = None
    # structured output (grammar/): OpenAI's response_format, and llama-server's json_schema and grammar (GBNF)
    response_format: dict[str, Any] | None = None
    json_schema: dict[str, Any] | None = None
    grammar: str | None = None
    # refused when set (UNSUPPORTED): they would change the answer and are not implemented
    functions: Any = None
    function_call: Any = None


class CompletionRequest(GenerationRequest):
    prompt: str | list[int]
    max_tokens: int | None = Field(16, ge=1)
    echo: Literal[False] = False
    logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    suffix: Any = None
    best_of: Any = None


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class FunctionCall(_Strict):
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class ToolCall(_Strict):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    tool_calls: list[ToolCall] | None = None  # an assistant's calls
    tool_call_id: str | None = None  # a tool message: the call it answers

    def flat(self) -> dict[str, Any]:
        """The message as the chat template expects it: text parts joined, None as ''; calls and call ids kept."""
        content = self.content or ""
        if isinstance(content, list):
            content = "".join(p.text for p in content)
        out: dict[str, Any] = {"role": self.role, "content": content}
        if self.tool_calls:
            out["tool_calls"] = [c.model_dump() for c in self.tool_calls]
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        return out


class ChatRequest(GenerationRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    tools: list[dict[str, Any]] | None = None  # checked by grammar/tools.py `read_tools`
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None


UNSUPPORTED = ("functions", "function_call", "suffix", "best_of")
