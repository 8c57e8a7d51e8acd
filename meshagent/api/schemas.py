"""Request bodies of the OpenAI endpoints, validated once at the edge."""

from __future__ import annotations

from typing import Annotated, Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from meshagent.api.errors import ApiError, bad_request
from meshagent.api.structured import response_format_grammar
from meshagent.api.tools import plan_tools

MAX_STOPS = 4
MAX_TOP_LOGPROBS = 20
MAX_N = 8  # completions of one prompt in one request


class MeshagentOptions(BaseModel):
    """The `meshagent` extension object of a request: this project's own choices."""

    model_config = ConfigDict(extra="forbid")  # a misspelt option is an error, not ignored
    speculation: Literal["auto", "on", "off"] | None = None
    # Sampling options of the other protocols, carried in a chat request (`messages.py`,
    # `ollama.py`): draw from the likeliest top_k tokens; penalise repeated tokens.
    top_k: Annotated[int, Field(ge=1)] | None = None
    repeat_penalty: Annotated[float, Field(gt=0.0)] | None = None


class _Request(BaseModel):
    # Unknown fields are ignored, as many clients send extras we have no use for.
    model_config = ConfigDict(extra="ignore")

    model: str = Field(min_length=1)
    stream: bool = False
    max_tokens: Annotated[int, Field(ge=1)] | None = None
    temperature: Annotated[float, Field(ge=0.0, le=2.0)] = 1.0
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] = 1.0
    n: Annotated[int, Field(ge=1, le=MAX_N)] = 1
    seed: int | None = None
    stop: str | list[str] | None = None
    presence_penalty: Annotated[float, Field(ge=-2.0, le=2.0)] = 0.0
    frequency_penalty: Annotated[float, Field(ge=-2.0, le=2.0)] = 0.0
    stream_options: dict[str, Any] | None = None
    meshagent: MeshagentOptions | None = None
    response_format: dict[str, Any] | None = None  # enforced by a grammar (api/structured.py)
    # Fields that would change the answer if ignored: read only to refuse them.
    logit_bias: dict[str, Any] | None = None

    @field_validator("stop")
    @classmethod
    def _stops(cls, v: str | list[str] | None) -> str | list[str] | None:
        if isinstance(v, list) and len(v) > MAX_STOPS:
            raise ValueError(f"at most {MAX_STOPS} stop sequences are supported")
        return v

    def stop_list(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)

    def speculation(self) -> str | None:
        return None if self.meshagent is None else self.meshagent.speculation

    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.get("include_usage"))


class TextPart(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["text"]
    text: str


class FunctionCall(BaseModel):
    model_config = ConfigDict(extra="ignore")
    name: str
    arguments: str | dict[str, Any] = "{}"


class ToolCall(BaseModel):
    model_config = ConfigDict(extra="ignore")
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class Message(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    tool_calls: list[ToolCall] | None = None  # an assistant's calls, earlier in the history
    tool_call_id: str | None = None  # a tool's result: the call it answers

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content)


class ChatCompletionRequest(_Request):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: Annotated[int, Field(ge=1)] | None = None
    logprobs: bool | None = None
    tools: list[Any] | None = None
    top_logprobs: Annotated[int, Field(ge=0, le=MAX_TOP_LOGPROBS)] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    functions: list[Any] | None = None
    function_call: Any = None
    modalities: list[str] | None = None

    def token_limit(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    def top_count(self) -> int | None:
        """How many likeliest tokens to report with each token's logprob (None: none)."""
        return (self.top_logprobs or 0) if self.logprobs else None


class CompletionRequest(_Request):
    prompt: str | list[str] | list[int]
    max_tokens: Annotated[int, Field(ge=1)] | None = 16  # the legacy endpoint's default
    echo: bool = False
    logprobs: Annotated[int, Field(ge=0, le=MAX_TOP_LOGPROBS)] | None = None
    suffix: str | None = None
    best_of: int | None = None

    def top_count(self) -> int | None:
        return self.logprobs


Req = TypeVar("Req", bound=_Request)
Body = TypeVar("Body", bound=BaseModel)


def parse(model: type[Req], body: object) -> Req:
    """Validate a decoded JSON body; the first problem becomes a 400 naming its field."""
    req = parse_body(model, body)
    _refuse_unsupported(req)
    return req


def parse_body(model: type[Body], body: object) -> Body:
    """`body` validated as `model`; the first problem becomes a 400 naming its field."""
    if not isinstance(body, dict):
        raise bad_request("The request body must be a JSON object.")
    try:
        return model.model_validate(body)
    except ValidationError as e:
        err = e.errors()[0]
        param = ".".join(str(p) for p in err["loc"]) or None
        if err["type"] == "missing":
            raise bad_request(f"Missing required parameter: '{param}'.", param=param) from e
        raise bad_request(f"Invalid value for '{param}': {err['msg']}.", param=param) from e


def _refuse_unsupported(req: _Request) -> None:
    def unsupported(param: str, why: str) -> ApiError:
        return bad_request(why, param=param, code="unsupported_parameter")

    response_format_grammar(req.response_format)  # a 400 now if it cannot be enforced
    if req.logit_bias:
        raise unsupported("logit_bias", "logit_bias is not supported yet.")
    if isinstance(req, ChatCompletionRequest):
        if req.top_logprobs is not None and not req.logprobs:
            raise bad_request("top_logprobs needs logprobs set to true.", param="top_logprobs")
        if req.functions or req.function_call is not None:
            param = "functions" if req.functions else "function_call"
            raise unsupported(param, f"The legacy {param} are not supported: use tools.")
        # Tools and tool_choice are checked here, before any model is chosen.
        plan = plan_tools(req.tools, req.tool_choice, req.parallel_tool_calls, "")
        fmt = req.response_format
        if plan is not None and fmt is not None and fmt.get("type", "text") != "text":
            raise unsupported(
                "response_format",
                "response_format with tools is not supported: a reply is either calls or "
                "text of the format. Leave one out.",
            )
        if req.modalities is not None and set(req.modalities) - {"text"}:
            raise unsupported("modalities", "Only text output is supported.")
    if isinstance(req, CompletionRequest):
        if req.logprobs is not None and req.echo:
            raise unsupported(
                "echo",
                "echo with logprobs is not supported: the prompt's tokens get no logprobs.",
            )
        if req.suffix and not isinstance(req.prompt, str):
            raise unsupported("suffix", "suffix (fill-in-the-middle) needs one text prompt.")
        if req.best_of is not None and req.best_of > 1:
            raise unsupported("best_of", "Only best_of=1 is supported.")
        if isinstance(req.prompt, list) and not req.prompt:
            raise bad_request("prompt must not be an empty list.", param="prompt")
        if isinstance(req.prompt, list) and isinstance(req.prompt[0], str) and len(req.prompt) > 1:
            raise unsupported("prompt", "Send one prompt per request (a list of one string).")
