"""Request schemas of the OpenAI-compatible API (/v1/completions, /v1/chat/completions).

OpenAI's fields with OpenAI's ranges (temperature 0-2, penalties -2..2, at most 4 stop strings,
top_logprobs 0-20, ...), plus SGLang's sampling extensions (top_k, min_p, stop_token_ids,
ignore_eos, rid, ...). Like the native schemas: strict types, unknown fields refused, and the
rules published in /openapi.json. Fields this server does not implement are accepted only at
their neutral value and refused by name otherwise (`check_unsupported`).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, Field

from sgl_dflash.entrypoints.protocol import STRICT, NonNegativeInt, StopString, TokenIds, is_neutral
from sgl_dflash.errors import InvalidRequestError
from sgl_dflash.sampling_params import SamplingParams

# OpenAI: "Up to 4 sequences where the API will stop generating further tokens."
MAX_OPENAI_STOP_STRINGS = 4

# Fields accepted only when they ask for nothing (field -> the values that do).
UNSUPPORTED_FIELDS: dict[str, tuple[Any, ...]] = {
    "n": (None, 1),
    "best_of": (None, 1),
    "logprobs": (None, False, 0),
    "top_logprobs": (None, 0),
    "echo": (None, False),
    "suffix": (None,),
    "seed": (None,),
    "logit_bias": (None, {}),
    "tools": (None, []),
    "tool_choice": (None, "none"),
    "response_format": (None, {"type": "text"}),
    "continue_final_message": (None, False),
    "min_p": (None, 0, 0.0),
    "min_tokens": (None, 0),
    "presence_penalty": (None, 0, 0.0),
    "frequency_penalty": (None, 0, 0.0),
    "repetition_penalty": (None, 1, 1.0),
    "skip_special_tokens": (None, True),
}


class StreamOptions(BaseModel):
    model_config = STRICT
    include_usage: bool | None = False


class _SamplingFields(BaseModel):
    """Fields shared by completions and chat. OpenAI's fields are nullable (null = default)."""

    model_config = STRICT

    model: str
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=-1)
    min_p: float | None = Field(None, ge=0, le=1)
    n: int | None = Field(None, ge=1, le=128)
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    stop: StopString | Annotated[list[StopString], Field(max_length=MAX_OPENAI_STOP_STRINGS)] | None = None
    stop_token_ids: list[NonNegativeInt] | None = None
    ignore_eos: bool | None = False
    skip_special_tokens: bool | None = True
    min_tokens: NonNegativeInt | None = None
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    repetition_penalty: float | None = Field(None, gt=0, le=2)
    logit_bias: dict[str, Annotated[float, Field(ge=-100, le=100)]] | None = None
    seed: int | None = None
    user: str | None = None
    rid: str | None = None

    def check_unsupported(self) -> None:
        for name, allowed in UNSUPPORTED_FIELDS.items():
            value = getattr(self, name, None)
            if not is_neutral(value, allowed):
                shown = repr(value) if len(repr(value)) <= 80 else repr(value)[:80] + "..."
                raise InvalidRequestError(f"'{name}'={shown} is not supported by this server", param=name,
                                          code="unsupported_parameter")

    @property
    def is_stream(self) -> bool:
        return bool(self.stream)

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    def sampling_params(self, max_tokens: int) -> SamplingParams:
        """The request's `SamplingParams` (ranges were checked by the schema; token ids against
        the vocabulary at admission)."""
        params = SamplingParams(max_new_tokens=max_tokens, stop=self.stop, ignore_eos=bool(self.ignore_eos))
        if self.stop_token_ids is not None:
            params.stop_token_ids = list(self.stop_token_ids)
        for name in ("temperature", "top_p", "top_k"):
            if getattr(self, name) is not None:
                setattr(params, name, getattr(self, name))
        params.verify()
        return params


Prompt = str | Annotated[list[str], Field(min_length=1)] | TokenIds | Annotated[list[TokenIds], Field(min_length=1)]


class CompletionRequest(_SamplingFields):
    prompt: Prompt
    max_tokens: NonNegativeInt | None = 16  # OpenAI's default for completions
    echo: bool | None = False
    logprobs: int | None = Field(None, ge=0, le=5)
    best_of: int | None = Field(None, ge=1, le=20)
    suffix: str | None = None


class ContentPart(BaseModel):
    model_config = STRICT
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    """A message: a role and its content, a string or a non-empty list of text parts. Tool and
    function messages (and tool calls) are not supported, so content is always required."""

    model_config = STRICT
    role: Literal["system", "developer", "user", "assistant"]
    content: str | Annotated[list[ContentPart], Field(min_length=1)]
    name: str | None = None

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


PositiveInt = Annotated[int, Field(ge=1)]


class ChatCompletionRequest(_SamplingFields):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_tokens: PositiveInt | None = None  # none: until EOS or the end of the context
    max_completion_tokens: PositiveInt | None = None
    logprobs: bool | None = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    response_format: dict[str, Any] | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    continue_final_message: bool | None = False
