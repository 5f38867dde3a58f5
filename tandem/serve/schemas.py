"""The request records, with OpenAI's field names, and their bounds (pydantic v2).

Fields OpenAI clients send that the engine does not implement are either ignored when they
cannot change the output (`user`) or refused when set to anything but their neutral value
(`presence_penalty`, `frequency_penalty`, `logit_bias`, `n` other than 1, `echo`, `best_of`, and
the fields of `UNSUPPORTED`: vLLM's sampling extensions, tools, structured output). A field
OpenAI types "X or null" takes its default when sent as null (LangChain-style clients send
nulls). A field no one defines is ignored with a warning in the server's log, as vLLM does
(OpenAI's own API refuses it; a client written for vLLM sends vLLM's extras).
"""
from __future__ import annotations

from typing import Any, Callable, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt, StrictStr, model_validator

Number = StrictFloat  # (a strict float takes a JSON integer too, never a string or a bool)

# fields OpenAI types "X or null": null means the field's default
NULL_IS_DEFAULT = frozenset({"temperature", "top_p", "n", "stream", "presence_penalty", "frequency_penalty",
                             "logprobs", "echo", "ignore_eos", "add_generation_prompt"})


def _neutral(*values) -> Callable[[Any], bool]:
    return lambda v: any(v == x and type(v) is type(x) for x in values)  # (False is not 0, 1.0 is 1.0)


# fields this server knows and does not implement -> (is the value neutral?, the neutral value in words).
# A neutral value changes nothing and passes; anything else is refused with a 400 naming the field
# (a silently ignored top_k or response_format would return an output the client did not ask for)
UNSUPPORTED: dict[str, tuple[Callable[[Any], bool], str]] = {
    # vLLM's sampling extensions
    "top_k": (_neutral(0, -1), "0 or -1"),
    "min_p": (_neutral(0, 0.0), "0"),
    "repetition_penalty": (_neutral(1, 1.0), "1"),
    "length_penalty": (_neutral(1, 1.0), "1"),
    "use_beam_search": (_neutral(False), "false"),
    "min_tokens": (_neutral(0), "0"),
    "stop_token_ids": (_neutral([]), "[]"),
    "bad_words": (_neutral([]), "[]"),
    "allowed_token_ids": (_neutral(), "null"),
    "include_stop_str_in_output": (_neutral(False), "false"),
    "skip_special_tokens": (_neutral(True), "true"),
    "spaces_between_special_tokens": (_neutral(True), "true"),
    "truncate_prompt_tokens": (_neutral(), "null"),
    "prompt_logprobs": (_neutral(), "null"),
    "return_tokens_as_token_ids": (_neutral(False), "false"),
    "logits_processors": (_neutral(), "null"),
    "priority": (_neutral(0), "0"),
    # structured output and tools
    "response_format": (_neutral({"type": "text"}), '{"type": "text"}'),
    "guided_json": (_neutral(), "null"),
    "guided_regex": (_neutral(), "null"),
    "guided_choice": (_neutral(), "null"),
    "guided_grammar": (_neutral(), "null"),
    "structured_outputs": (_neutral(), "null"),
    "tools": (_neutral([]), "[]"),
    "tool_choice": (_neutral("none"), '"none"'),
    "functions": (_neutral([]), "[]"),
    "function_call": (_neutral("none"), '"none"'),
    # chat
    "echo": (_neutral(False), "false"),
    "continue_final_message": (_neutral(False), "false"),
    "chat_template": (_neutral(), "null (the server's template applies)"),
    "modalities": (_neutral(["text"]), '["text"]'),
    "audio": (_neutral(), "null"),
    "prediction": (_neutral(), "null"),
}


def unsupported(body: BaseModel) -> tuple[str, str] | None:
    """The first field of `body` this server knows and refuses at the value sent: (name, its
    neutral value in words); None when there is none."""
    for name, value in (body.model_extra or {}).items():
        rule = UNSUPPORTED.get(name)
        if rule is not None and value is not None and not rule[0](value):
            return name, rule[1]
    return None


def unknown_fields(body: BaseModel) -> list[str]:
    """The fields of `body` that no one defines (ignored, with a warning in the server's log)."""
    return [name for name in (body.model_extra or {}) if name not in UNSUPPORTED]


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")

    include_usage: StrictBool = False
    continuous_usage_stats: StrictBool = False  # vLLM's extension: token counts in every chunk (with include_usage)


class _Common(BaseModel):
    model_config = ConfigDict(extra="allow")  # (the extras are checked: `unsupported`, `unknown_fields`)

    @model_validator(mode="before")
    @classmethod
    def _null_is_default(cls, data):
        if isinstance(data, dict):
            return {k: v for k, v in data.items() if not (v is None and k in NULL_IS_DEFAULT)}
        return data

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

    @model_validator(mode="before")
    @classmethod
    def _text_only(cls, data):
        if isinstance(data, dict) and data.get("type") != "text":
            kind = data.get("type")
            raise ValueError(f"only text content parts are supported (got {kind!r})" if isinstance(kind, str)
                             else 'a content part needs "type": "text" and "text"')
        return data


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "user", "assistant", "developer", "tool"]

    @model_validator(mode="before")
    @classmethod
    def _no_tool_calls(cls, data):
        if isinstance(data, dict) and (data.get("tool_calls") or data.get("function_call")):
            raise ValueError("tool calls are not supported (this server runs no tools)")
        return data

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
    # vLLM's chat extensions: end the prompt with the assistant's turn (the template's own switch),
    # and more variables for the template (e.g. Qwen3's enable_thinking)
    add_generation_prompt: StrictBool = True
    chat_template_kwargs: dict[str, Any] | None = None
