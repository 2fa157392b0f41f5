"""Request bodies of the OpenAI-compatible server, as strict pydantic models.

Contract: fields of the wrong type are refused (strict validation, no coercion), unknown fields are ignored
(`speculative` keeps them: they are the strategy's options, checked later by its builder). Semantic checks
that need the model (context length, token ids, strategy options) are the app's job, not these models'.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field

SEED_RANGE = (-(2**63), 2**64 - 1)  # what torch.Generator.manual_seed accepts


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


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
    seed: int | None = Field(None, ge=SEED_RANGE[0], le=SEED_RANGE[1])
    stop: str | Annotated[list[str], Field(max_length=16)] | None = None
    n: int = Field(1, ge=1, le=1, description="only one choice per request")
    stream: bool = False
    stream_options: StreamOptions | None = None
    speculative: SpeculativeOptions | None = None
    user: str | None = None


class CompletionRequest(GenerationRequest):
    prompt: str | list[int]
    max_tokens: int | None = Field(16, ge=1)
    echo: Literal[False] = False
    logprobs: None = None


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart] | None = None

    def flat(self) -> dict[str, str]:
        """The message as the chat template expects it: text parts joined, None as ''."""
        content = self.content or ""
        if isinstance(content, list):
            content = "".join(p.text for p in content)
        return {"role": self.role, "content": content}


class ChatRequest(GenerationRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: Literal[False] | None = None
