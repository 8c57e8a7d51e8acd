"""Rendering chat messages with the model's own Jinja chat template (from the GGUF)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment

from meshagent.errors import ModelError

# Used when a GGUF carries no template: ChatML, the most common instruct format.
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


class TemplateError(ValueError):
    """The template refused the conversation (it called raise_exception)."""


def _raise(message: str) -> None:
    raise TemplateError(message)


@dataclass(frozen=True)
class ChatMessage:
    role: str
    content: str
    # An assistant's calls, as chat templates read them: {"type": "function", "function":
    # {"name", "arguments" (a dict)}, "id"}; a tool's reply names the call it answers.
    tool_calls: tuple[dict[str, Any], ...] = ()
    tool_call_id: str | None = None
    name: str | None = None

    def as_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"role": self.role, "content": self.content}
        if self.tool_calls:
            out["tool_calls"] = list(self.tool_calls)
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        if self.name is not None:
            out["name"] = self.name
        return out


class ChatTemplate:
    def __init__(self, source: str | None, *, bos_token: str, eos_token: str) -> None:
        self.source = source or CHATML_TEMPLATE
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = _raise
        try:
            self._template = env.from_string(self.source)
        except jinja2.TemplateSyntaxError as e:
            raise ModelError(f"the model's chat template does not parse: {e}") from e
        self.bos_token = bos_token
        self.eos_token = eos_token

    @property
    def reads_tools(self) -> bool:
        """Whether the template renders a `tools` list itself (its own tool-call format)."""
        return "tools" in self.source

    def render(self, messages: Sequence[ChatMessage], **extra: Any) -> str:
        try:
            return self._template.render(
                messages=[m.as_dict() for m in messages],
                add_generation_prompt=True,
                bos_token=self.bos_token,
                eos_token=self.eos_token,
                **extra,
            )
        except TemplateError:
            raise
        except jinja2.TemplateError as e:
            raise TemplateError(f"the chat template failed on these messages: {e}") from e
