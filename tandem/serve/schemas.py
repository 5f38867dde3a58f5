"""The request records, with OpenAI's field names, and their bounds (pydantic v2).

Fields OpenAI clients send that the engine does not implement are either ignored when they
cannot change the output (`user`) or refused when set to anything but their neutral value
(`presence_penalty`, `frequency_penalty`, `logit_bias`, `n` other than 1, `echo`, `best_of`).
Unknown fields are ignored, as OpenAI's own server does for forward compatibility.
"""
from __future__ import annotations

from typing import Literal, Union

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt, StrictStr

Number = Union[StrictInt, StrictFloat]


class StreamOptions(BaseModel):
    include_usage: StrictBool = False
    continuous_usage_stats: StrictBool = False  # vLLM's extension: token counts in every chunk (with include_usage)


class _Common(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: StrictStr | None = None  # when given, must be the served name
    max_tokens: StrictInt | None = None
    temperature: Number = 1.0  # OpenAI's default; 0 is greedy
    top_p: Number = 1.0
    seed: StrictInt | None = None  # None: a fresh random seed
    stop: StrictStr | list[StrictStr] | None = None
    n: StrictInt = 1
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    presence_penalty: Number = 0.0
    frequency_penalty: Number = 0.0
    logit_bias: dict[str, Number] | None = None
    user: StrictStr | None = None
    # extensions (vLLM's names where vLLM has one)
    method: StrictStr | None = None  # ar | chain | tree, among the server's --methods
    ignore_eos: StrictBool = False


class CompletionRequest(_Common):
    prompt: StrictStr | list[StrictStr] | list[StrictInt] | list[list[StrictInt]]  # text or token ids, as OpenAI's
    max_tokens: StrictInt | None = 16  # OpenAI's default for completions
    logprobs: StrictInt | None = None  # top alternatives per token, 0..5
    echo: StrictBool = False
    best_of: StrictInt | None = None
    suffix: StrictStr | None = None


class TextPart(BaseModel):
    type: Literal["text"]
    text: StrictStr


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: StrictStr | list[TextPart] | None = None
    name: StrictStr | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content)


class ChatCompletionRequest(_Common):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: StrictInt | None = None  # OpenAI's newer name for max_tokens
    logprobs: StrictBool = False
    top_logprobs: StrictInt | None = None  # 0..20 alternatives per token, with logprobs: true
