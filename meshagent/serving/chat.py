"""Rendering chat messages with the model's own Jinja chat template (from the GGUF)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment

from meshagent.errors import ModelError
from meshagent.serving.family_templates import CHATML, family_template

OWN = "the model's own"  # `ChatTemplate.name` of a template the GGUF carries


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
    """`source`: the GGUF's template; without one, `fallback` (a family's, as
    `for_model` chooses: family_templates.py), else ChatML. `name` says which."""

    def __init__(
        self,
        source: str | None,
        *,
        bos_token: str,
        eos_token: str,
        fallback: tuple[str, str] = ("chatml", CHATML),
    ) -> None:
        self.name = OWN if source else fallback[0]
        self.source = source or fallback[1]
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = _raise
        try:
            self._template = env.from_string(self.source)
        except jinja2.TemplateSyntaxError as e:
            raise ModelError(f"the model's chat template does not parse: {e}") from e
        self.bos_token = bos_token
        self.eos_token = eos_token

    @classmethod
    def for_model(cls, model: Any) -> ChatTemplate:
        """The template of a loaded model (a `TokenModel`): its file's, or its family's."""
        info = model.info

        def has_token(text: str) -> bool:
            return len(model.tokenize(text, add_bos=False)) == 1

        family = family_template(info.architecture, has_token)
        return cls(
            info.chat_template,
            bos_token=info.bos_token,
            eos_token=info.eos_token,
            fallback=(family.name, family.source),
        )

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
