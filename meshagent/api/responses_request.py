"""The Responses API's request (`POST /v1/responses`): its input items as chat messages, its
options as a chat completion's, and the conversations of recent responses that a request may
go on from (`previous_response_id`)."""

from __future__ import annotations

from collections import OrderedDict
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from meshagent.api.errors import bad_request

KEEP_RESPONSES = 256  # conversations remembered for previous_response_id


class InputMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[dict[str, Any]]

    def chat(self) -> dict[str, Any]:
        role = "system" if self.role == "developer" else self.role
        return {"role": role, "content": self.text()}

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        parts = []
        for part in self.content:
            if part.get("type") not in ("input_text", "output_text", "text"):
                raise bad_request(
                    f"Only text content is supported (not '{part.get('type')}').",
                    param="input",
                    code="unsupported_parameter",
                )
            parts.append(str(part.get("text", "")))
        return "".join(parts)


class FunctionCallItem(BaseModel):
    """A call the model made earlier, sent back as input."""

    model_config = ConfigDict(extra="ignore")
    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str

    def chat(self) -> dict[str, Any]:
        call = {"id": self.call_id, "type": "function"}
        call["function"] = {"name": self.name, "arguments": self.arguments}  # type: ignore[assignment]
        return {"role": "assistant", "content": None, "tool_calls": [call]}


class FunctionOutputItem(BaseModel):
    """What a call returned."""

    model_config = ConfigDict(extra="ignore")
    type: Literal["function_call_output"]
    call_id: str
    output: str

    def chat(self) -> dict[str, Any]:
        return {"role": "tool", "tool_call_id": self.call_id, "content": self.output}


InputItem = Annotated[
    InputMessage | FunctionCallItem | FunctionOutputItem, Field(discriminator="type")
]


class ResponsesRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str = Field(min_length=1)
    input: str | list[InputItem]
    instructions: str | None = None
    max_output_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    stream: bool = False
    previous_response_id: str | None = None
    metadata: dict[str, str] | None = None
    store: bool | None = None
    user: str | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    text: dict[str, Any] | None = None
    # read only to refuse it: ignoring it would change the answer
    reasoning: dict[str, Any] | None = None

    def refuse_unsupported(self) -> None:
        if self.reasoning:
            raise bad_request(
                "Reasoning options are not supported.",
                param="reasoning",
                code="unsupported_parameter",
            )
        for i, tool in enumerate(self.tools or ()):
            if tool.get("type") != "function":
                raise bad_request(
                    f"Only function tools are supported (not '{tool.get('type')}').",
                    param=f"tools.{i}.type",
                    code="unsupported_parameter",
                )

    def messages(self, history: list[dict[str, Any]]) -> list[dict[str, Any]]:
        out = list(history)
        if self.instructions:
            out.insert(0, {"role": "system", "content": self.instructions})
        if isinstance(self.input, str):
            out.append({"role": "user", "content": self.input})
        else:
            out += [item.chat() for item in self.input]
        return out

    def chat_options(self) -> dict[str, Any]:
        """The tools, tool choice and format, as the chat endpoint takes them."""
        out: dict[str, Any] = {}
        if self.tools:
            out["tools"] = [
                {
                    "type": "function",
                    "function": {k: t[k] for k in ("name", "description", "parameters") if k in t},
                }
                for t in self.tools
            ]
        choice = self.tool_choice
        if isinstance(choice, dict) and choice.get("type") == "function":
            choice = {"type": "function", "function": {"name": choice.get("name")}}
        if choice is not None:
            out["tool_choice"] = choice
        if self.parallel_tool_calls is not None:
            out["parallel_tool_calls"] = self.parallel_tool_calls
        fmt = (self.text or {}).get("format")
        if fmt and fmt.get("type") == "json_schema":
            spec = {k: fmt[k] for k in ("name", "schema", "strict") if k in fmt}
            out["response_format"] = {"type": "json_schema", "json_schema": spec}
        elif fmt and fmt.get("type") != "text":
            out["response_format"] = {"type": fmt.get("type")}
        return out


class Remembered:
    """The conversations of recent responses (for `previous_response_id`), oldest dropped."""

    def __init__(self, keep: int = KEEP_RESPONSES) -> None:
        self.keep = keep
        self._by_id: OrderedDict[str, list[dict[str, str]]] = OrderedDict()

    def get(self, response_id: str) -> list[dict[str, str]]:
        try:
            return list(self._by_id[response_id])
        except KeyError:
            raise bad_request(
                f"Previous response '{response_id}' is not known to this agent (it remembers "
                f"the last {self.keep}).",
                param="previous_response_id",
                code="previous_response_not_found",
            ) from None

    def put(self, response_id: str, messages: list[dict[str, str]]) -> None:
        self._by_id[response_id] = messages
        while len(self._by_id) > self.keep:
            self._by_id.popitem(last=False)
