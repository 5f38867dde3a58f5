"""Chat messages -> prompt text, through the checkpoint's jinja2 chat template.

The template comes from the checkpoint's `tokenizer_config.json` (`chat_template`: a string, or
a list of {"name", "template"} of which "default" is used), or from `--chat-template FILE`, or,
for a checkpoint without one (the bundled pair, trained on Python source), `BUILTIN_TEMPLATE`:
each message as a comment line, then the assistant's turn. Rendering runs in jinja2's immutable
sandbox with the variables Hugging Face templates expect (messages, add_generation_prompt,
bos_token, eos_token, raise_exception), plus a request's `chat_template_kwargs`. The rendered
text already holds any special tokens, so it is encoded without adding them again.
"""
from __future__ import annotations

import json
from pathlib import Path

from tandem.config import ConfigError

BUILTIN_TEMPLATE = (
    "{% for m in messages %}# {{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}# assistant:\n{% endif %}"
)


class TemplateError(ValueError):
    """The template refused the messages (its raise_exception) or failed to render them."""


def _token_text(value) -> str:
    if isinstance(value, dict):  # {"content": "<s>", "lstrip": ...}
        return str(value.get("content", ""))
    return str(value or "")


class ChatTemplate:
    def __init__(self, source: str, bos_token: str = "", eos_token: str = "", builtin: bool = False):
        from jinja2 import TemplateSyntaxError
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = _raise
        try:
            self.template = env.from_string(source)
        except TemplateSyntaxError as e:
            raise ConfigError(f"the chat template does not parse: {e.message} (line {e.lineno})") from None
        self.source, self.bos_token, self.eos_token, self.builtin = source, bos_token, eos_token, builtin

    @classmethod
    def for_checkpoint(cls, directory: str | Path, override: str | Path | None = None) -> "ChatTemplate":
        """The override file, else the checkpoint's tokenizer_config.json template, else the built-in one."""
        cfg: dict = {}
        f = Path(directory) / "tokenizer_config.json"
        if f.is_file():
            try:
                cfg = json.loads(f.read_text(encoding="utf-8"))
            except (OSError, ValueError) as e:
                raise ConfigError(f"cannot read {f}: {e}") from None
        bos, eos = _token_text(cfg.get("bos_token")), _token_text(cfg.get("eos_token"))
        if override is not None:
            try:
                return cls(Path(override).read_text(encoding="utf-8"), bos, eos)
            except OSError as e:
                raise ConfigError(f"cannot read --chat-template {str(override)!r}: {e.strerror}") from None
        source = cfg.get("chat_template")
        if isinstance(source, list):  # named templates: the default one
            source = next((t.get("template") for t in source if isinstance(t, dict) and t.get("name") == "default"),
                          None)
        if isinstance(source, str) and source:
            return cls(source, bos, eos)
        return cls(BUILTIN_TEMPLATE, bos, eos, builtin=True)

    def render(self, messages: list[dict], add_generation_prompt: bool = True, extra: dict | None = None) -> str:
        """extra: more variables for the template (a request's chat_template_kwargs, e.g. Qwen3's
        enable_thinking); they never replace the four above."""
        from jinja2 import TemplateError as JinjaError

        try:
            return self.template.render({**(extra or {}), "messages": messages,
                                         "add_generation_prompt": add_generation_prompt,
                                         "bos_token": self.bos_token, "eos_token": self.eos_token})
        except TemplateError:
            raise
        except (JinjaError, TypeError, ValueError, KeyError, AttributeError) as e:
            raise TemplateError(f"the chat template failed on these messages: {e}") from None


def _raise(message: str):
    raise TemplateError(message)
