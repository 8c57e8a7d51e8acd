"""From a parsed completion request to what a model generates: prompt tokens (the chat template
applied), limits, sampling and stops, and the shape of the reply. The agent that holds a
client's connection and the entry that computes for it both prepare the same request the same
way, which is what lets a request lost with its entry continue on another."""

from __future__ import annotations

from dataclasses import dataclass

from meshagent.api import errors
from meshagent.api.schemas import ChatCompletionRequest, CompletionRequest, parse
from meshagent.api.structured import response_format_grammar
from meshagent.api.tools import ToolPlan, call_grammar, history_message, plan_tools, render_history
from meshagent.errors import EngineError
from meshagent.serving.chat import TemplateError
from meshagent.serving.generation import GenerationRequest
from meshagent.serving.local_model import LocalModel
from meshagent.serving.sampling import SamplingParams

CompletionKind = ChatCompletionRequest | CompletionRequest

# The endpoints that generate, and the request each takes.
KINDS: dict[str, type[ChatCompletionRequest] | type[CompletionRequest]] = {
    "/v1/chat/completions": ChatCompletionRequest,
    "/v1/completions": CompletionRequest,
}


@dataclass(frozen=True)
class Asked:
    """A completion request as the client asked it: the endpoint, the JSON it sent (what
    travels to another agent) and what that parses to."""

    path: str
    body: bytes
    req: CompletionKind


@dataclass(frozen=True)
class Prepared:
    """One request ready to generate on `model`, and how its reply is shaped."""

    model: LocalModel
    gen: GenerationRequest
    chat: bool
    stream: bool
    include_usage: bool
    prompt_param: str  # the request field the prompt came in, for errors about it
    echo: str = ""  # text completions with echo: the prompt, sent before the completion
    tools: ToolPlan | None = None  # a chat request that may call tools
    n: int = 1  # completions of the prompt (prefilled once: `GenerationRequest.share`)

    @property
    def tool_syntax(self) -> str | None:
        return None if self.tools is None else self.tools.syntax.name


def parse_completion(path: str, body: object) -> CompletionKind:
    """The request of a generating endpoint (`KINDS`); an OpenAI-shaped 400 if malformed."""
    return parse(KINDS[path], body)


def prepare(req: CompletionKind, model: LocalModel) -> Prepared:
    if isinstance(req, ChatCompletionRequest):
        return _chat(req, model)
    return _completion(req, model)


def _chat(req: ChatCompletionRequest, model: LocalModel) -> Prepared:
    template = model.template
    plan = plan_tools(req.tools, req.tool_choice, req.parallel_tool_calls, template.source)
    messages = [
        history_message(
            m.role,
            m.text(),
            [c.model_dump() for c in m.tool_calls or ()],
            m.tool_call_id,
        )
        for m in req.messages
    ]
    messages, extra = render_history(messages, plan, native=template.reads_tools)
    try:
        tokens = model.chat_tokens(messages, **extra)
    except TemplateError as e:
        raise errors.bad_request(str(e), param="messages") from e
    gen = _generation_request(req, model, tokens, req.token_limit(), plan)
    return Prepared(
        model, gen, True, req.stream, req.include_usage(), "messages", tools=plan, n=req.n
    )


def _completion(req: CompletionRequest, model: LocalModel) -> Prepared:
    if req.suffix:
        tokens = _fill_in_the_middle(model, str(req.prompt), req.suffix)
        gen = _generation_request(req, model, tokens, req.max_tokens)
        echo = str(req.prompt) if req.echo else ""
        return Prepared(model, gen, False, req.stream, req.include_usage(), "prompt", echo, n=req.n)
    if isinstance(req.prompt, str):
        prompt_text = req.prompt
        tokens = model.text_tokens(prompt_text)
    elif isinstance(req.prompt[0], str):
        prompt_text = str(req.prompt[0])
        tokens = model.text_tokens(prompt_text)
    else:
        tokens = tuple(int(t) for t in req.prompt)
        bad = [t for t in tokens if not 0 <= t < model.info.n_vocab]
        if bad:
            raise errors.bad_request(
                f"Token id {bad[0]} is outside the vocabulary (0-{model.info.n_vocab - 1}).",
                param="prompt",
            )
        prompt_text = b"".join(model.engine.token_bytes(t) for t in tokens).decode(errors="replace")
    if not tokens:
        raise errors.bad_request("The prompt is empty.", param="prompt")
    gen = _generation_request(req, model, tokens, req.max_tokens)
    echo = prompt_text if req.echo else ""
    return Prepared(model, gen, False, req.stream, req.include_usage(), "prompt", echo, n=req.n)


def _fill_in_the_middle(model: LocalModel, prefix: str, suffix: str) -> tuple[int, ...]:
    """The prompt that asks the model for what goes between `prefix` and `suffix`: its
    fill-in-the-middle tokens around them (prefix, suffix, middle: llama.cpp's order)."""
    fim = model.info.fim
    if fim is None:
        raise errors.bad_request(
            f"The model '{model.info.id}' has no fill-in-the-middle tokens: 'suffix' needs a "
            "model trained for it (a code model such as Qwen2.5-Coder).",
            param="suffix",
            code="unsupported_parameter",
        )
    pre, suf, mid = fim
    head = model.engine.tokenize(prefix, add_bos=True)
    bos = head[:1] if head and model.engine.tokenize("", add_bos=True) == head[:1] else []
    body = head[len(bos) :]
    tail = model.engine.tokenize(suffix, add_bos=False)
    return (*bos, pre, *body, suf, *tail, mid)


def _generation_request(
    req: CompletionKind,
    model: LocalModel,
    tokens: tuple[int, ...],
    limit: int | None,
    tools: ToolPlan | None = None,
) -> GenerationRequest:
    grammar, trigger = response_format_grammar(req.response_format), None
    param = "response_format"
    if tools is not None:
        (grammar, trigger), param = call_grammar(tools), "tools"
    if grammar is not None:
        try:
            model.engine.check_grammar(grammar, trigger)
        except EngineError as e:
            raise errors.bad_request(
                f"The {param} cannot be enforced on this model: {e}", param=param
            ) from e
    close_within = None
    structured = (req.response_format or {}).get("type") in ("json_object", "json_schema")
    if structured or (tools is not None and tools.forced):
        # The reply (a JSON object, one that follows the schema, the forced calls) closes
        # before the limit cuts it (`engine/json_close.py`, `engine/gbnf_close.py`).
        close_within = limit if limit is not None else model.engine.slot_ctx - len(tokens)
    sampling = SamplingParams(
        temperature=req.temperature,
        top_p=req.top_p,
        seed=req.seed,
        presence_penalty=req.presence_penalty,
        frequency_penalty=req.frequency_penalty,
        grammar=grammar,
        grammar_trigger=trigger,
        close_within=close_within,
        logprobs=req.top_count(),
        top_k=(req.meshagent.top_k or 0) if req.meshagent else 0,
        repeat_penalty=(req.meshagent.repeat_penalty or 1.0) if req.meshagent else 1.0,
    )
    return GenerationRequest(
        tokens, limit, sampling, req.stop_list(), speculation=req.speculation()
    )
