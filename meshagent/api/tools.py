"""Tool calls: the request's functions into the prompt, a grammar that makes a call follow
its function's parameter schema, and the model's output back into `tool_calls`.

A model calls a tool in its own syntax (`Syntax`): the chat template says which. Templates
that render a `tools` list get it and the history's calls as they are; for one that does not
(SmolLM2's), a system message describes the functions and asks for the Hermes syntax, calls
in the history are written in it, and tool results come back as user messages
(docs/api.md). `tool_choice` "required" or a named function constrains the whole reply to
calls (`call_grammar`); "auto" lets the model write text, and constrains what follows once it
opens a call (a lazy grammar, triggered by the syntax's opening).
"""

from __future__ import annotations

import json
import re
import secrets
from dataclasses import dataclass
from typing import Any

from meshagent.api import errors
from meshagent.api.structured import MAX_GRAMMAR, schema_grammar
from meshagent.engine.json_close import JsonCloser
from meshagent.serving.chat import ChatMessage

MAX_PARALLEL = 4  # the most calls one reply may make
FREE = ("auto", "required")  # tool choices that leave the model which function, and how many
_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
_CALL_RULE = "tool-call-json"


@dataclass(frozen=True)
class Syntax:
    """How a model family writes calls: each call's JSON object (`{"name": ..., <args_key>:
    {...}}`) between `open` and `close`, several calls one after another (`sep` between
    blocks), or, with `listed`, one block holding a JSON list of them."""

    name: str
    open: str
    close: str
    args_key: str = "arguments"
    sep: str = "\n"
    listed: bool = False
    parallel: bool = True


HERMES = Syntax("hermes", "<tool_call>\n", "\n</tool_call>")
MISTRAL = Syntax("mistral", "[TOOL_CALLS]", "", listed=True)
LLAMA3 = Syntax("llama3", "", "", args_key="parameters", parallel=False)
SYNTAXES = {s.name: s for s in (HERMES, MISTRAL, LLAMA3)}


def syntax_for(template_source: str) -> Syntax:
    """The call syntax of the family a chat template belongs to (Hermes where it is none
    that is known, and for templates without tools: the fallback prompt asks for it)."""
    if "[TOOL_CALLS]" in template_source:
        return MISTRAL
    if "<|python_tag|>" in template_source or "ipython" in template_source:
        return LLAMA3
    return HERMES


@dataclass(frozen=True)
class Function:
    name: str
    description: str
    parameters: dict[str, Any]

    def spec(self) -> dict[str, Any]:
        """As the request gave it (what templates and the fallback prompt show)."""
        fn = {"name": self.name, "description": self.description, "parameters": self.parameters}
        return {"type": "function", "function": fn}


@dataclass(frozen=True)
class ToolPlan:
    """What a chat request's tools ask of generation: the functions, which choice, and the
    syntax the model writes calls in."""

    functions: tuple[Function, ...]
    choice: str  # "auto", "required", or a function's name
    parallel: bool
    syntax: Syntax

    @property
    def forced(self) -> bool:
        return self.choice != "auto"


def parse_functions(tools: list[Any]) -> tuple[Function, ...]:
    out = []
    for i, tool in enumerate(tools):
        param = f"tools.{i}"
        if not isinstance(tool, dict) or tool.get("type") != "function":
            raise errors.bad_request("Each tool must be {'type': 'function', ...}.", param=param)
        fn = tool.get("function")
        if not isinstance(fn, dict):
            raise errors.bad_request("A tool needs a 'function' object.", param=param)
        name = fn.get("name")
        if not isinstance(name, str) or not _NAME.match(name):
            raise errors.bad_request(
                "A function's name must be 1-64 letters, digits, '_' or '-'.",
                param=f"{param}.function.name",
            )
        params = fn.get("parameters", {"type": "object", "properties": {}})
        if not isinstance(params, dict):
            raise errors.bad_request(
                "A function's parameters must be a JSON schema object.",
                param=f"{param}.function.parameters",
            )
        schema_grammar(params, param=f"{param}.function.parameters")  # a 400 if unenforceable
        out.append(Function(name, str(fn.get("description") or ""), params))
    if len({f.name for f in out}) != len(out):
        raise errors.bad_request("Two tools have the same name.", param="tools")
    return tuple(out)


def plan_tools(
    tools: list[Any] | None, choice: Any, parallel: bool | None, template_source: str
) -> ToolPlan | None:
    """The request's tools and tool_choice, checked; None when no call can be made."""
    functions = parse_functions(tools or [])
    if choice is None:
        choice = "auto"
    if isinstance(choice, dict):
        fn = choice.get("function")
        name = fn.get("name") if isinstance(fn, dict) else None
        if choice.get("type") != "function" or not isinstance(name, str):
            raise errors.bad_request(
                "tool_choice must be 'none', 'auto', 'required' or "
                "{'type': 'function', 'function': {'name': ...}}.",
                param="tool_choice",
            )
        if name not in {f.name for f in functions}:
            raise errors.bad_request(
                f"tool_choice names '{name}', which is not among the tools.", param="tool_choice"
            )
        choice = name
    elif choice not in ("none", "auto", "required"):
        raise errors.bad_request(
            "tool_choice must be 'none', 'auto', 'required' or a function.", param="tool_choice"
        )
    if choice == "required" and not functions:
        raise errors.bad_request("tool_choice 'required' needs tools.", param="tool_choice")
    if choice == "none" or not functions:
        return None
    syntax = syntax_for(template_source)
    # A named function is called once; "required" and "auto" may make parallel calls.
    allow_parallel = (parallel is None or parallel) and syntax.parallel and choice in FREE
    return ToolPlan(functions, choice, allow_parallel, syntax)


# ----- the prompt -----


def _arguments(raw: Any) -> Any:
    """A call's arguments as templates want them: the object, not its JSON text."""
    if isinstance(raw, str):
        try:
            return json.loads(raw)
        except ValueError:
            return raw
    return raw


def call_text(syntax: Syntax, calls: list[tuple[str, Any]]) -> str:
    """Calls (name, arguments object) written in `syntax`."""
    objs = [json.dumps({"name": n, syntax.args_key: a}, ensure_ascii=False) for n, a in calls]
    if syntax.listed:
        return syntax.open + "[" + ", ".join(objs) + "]" + syntax.close
    return syntax.sep.join(syntax.open + o + syntax.close for o in objs)


def fallback_prompt(functions: tuple[Function, ...]) -> str:
    listing = "\n".join(
        json.dumps(f.spec()["function"], ensure_ascii=False, separators=(",", ":"))
        for f in functions
    )
    return (
        "You may call functions to help with the user's request. They are:\n"
        f"{listing}\n"
        "To call one, reply with <tool_call>\n"
        '{"name": <the function\'s name>, "arguments": <its arguments as a JSON object>}\n'
        "</tool_call> and nothing else. Results come back as <tool_response> messages."
    )


def render_history(
    messages: list[ChatMessage], plan: ToolPlan | None, *, native: bool
) -> tuple[list[ChatMessage], dict[str, Any]]:
    """Messages (and extra template variables) for the chat template. A template that reads
    tools gets them and the calls as they are; otherwise calls and results become text, and
    a system message lists the functions."""
    if native:
        extra = {} if plan is None else {"tools": [f.spec() for f in plan.functions]}
        return messages, extra
    syntax = HERMES
    out: list[ChatMessage] = []
    for m in messages:
        if m.tool_calls:
            calls = [(c["function"]["name"], c["function"]["arguments"]) for c in m.tool_calls]
            text = (m.content + "\n" if m.content else "") + call_text(syntax, calls)
            out.append(ChatMessage("assistant", text))
        elif m.role == "tool":
            out.append(ChatMessage("user", f"<tool_response>\n{m.content}\n</tool_response>"))
        else:
            out.append(m)
    if plan is not None:
        prompt = fallback_prompt(plan.functions)
        if out and out[0].role == "system":
            out[0] = ChatMessage("system", out[0].content + "\n\n" + prompt)
        else:
            out.insert(0, ChatMessage("system", prompt))
    return out, {}


def history_message(role: str, content: str, tool_calls: Any, tool_call_id: Any) -> ChatMessage:
    """A request message as the template reads it (calls with their arguments as objects)."""
    calls = tuple(
        {
            "id": c.get("id"),
            "type": "function",
            "function": {
                "name": c["function"]["name"],
                "arguments": _arguments(c["function"].get("arguments", {})),
            },
        }
        for c in tool_calls or ()
    )
    return ChatMessage(role, content, calls, tool_call_id)


# ----- the grammar -----


def call_grammar(plan: ToolPlan) -> tuple[str, str | None]:
    """GBNF that admits calls of the plan's functions with arguments that follow their
    schemas, and the text that triggers it (None: it holds from the first token)."""
    key = plan.syntax.args_key
    chosen = [f for f in plan.functions if plan.choice in ("auto", "required", f.name)]
    shapes = [
        {
            "type": "object",
            "properties": {"name": {"const": f.name}, key: f.parameters},
            "required": ["name", key],
            "additionalProperties": False,
        }
        for f in chosen
    ]
    schema = shapes[0] if len(shapes) == 1 else {"anyOf": shapes}
    body = schema_grammar(schema, param="tools")
    body = re.sub(r"^root ::=", f"{_CALL_RULE} ::=", body, count=1, flags=re.MULTILINE)
    s = plan.syntax
    more = MAX_PARALLEL - 1 if plan.parallel else 0
    if s.listed:
        root = f'root ::= {_lit(s.open + "[")} {_CALL_RULE} ("," " "? {_CALL_RULE}){{0,{more}}} "]"'
        if s.close:
            root += f" {_lit(s.close)}"
    else:
        block = f"{_lit(s.open)} {_CALL_RULE} {_lit(s.close)}" if s.open else _CALL_RULE
        root = f"root ::= {block}"
        if more:
            root += f" ({_lit(s.sep)} {block}){{0,{more}}}"
    grammar = root + "\n" + body
    if len(grammar) > MAX_GRAMMAR:
        raise errors.bad_request(
            f"These tools are too large to enforce ({len(grammar)} bytes of grammar).",
            param="tools",
        )
    trigger = None
    if not plan.forced:
        trigger = re.escape(s.open) if s.open else re.escape('{"name"')
    return grammar, trigger


def _lit(text: str) -> str:
    return json.dumps(text)  # a GBNF literal: JSON's string escapes are GBNF's


# ----- the output -----


@dataclass(frozen=True)
class Call:
    id: str
    name: str
    arguments: str  # JSON text

    def as_dict(self) -> dict[str, Any]:
        fn = {"name": self.name, "arguments": self.arguments}
        return {"id": self.id, "type": "function", "function": fn}


@dataclass(frozen=True)
class Text:
    text: str


@dataclass(frozen=True)
class CallStart:
    """A call's name is known (`CallParser(partial=True)`): its arguments follow as
    `ArgsDelta`s, then the whole `Call` (same id) ends it."""

    index: int
    id: str
    name: str


@dataclass(frozen=True)
class ArgsDelta:
    index: int
    text: str  # the next characters of the call's arguments, as the model writes them


Part = Text | Call | CallStart | ArgsDelta


class CallParser:
    """Turns streamed output into text and calls: text is passed on as it comes, except what
    could be the start of a call (held back, as a stop string is); a call is passed on whole,
    once its JSON is complete. At the end, whatever was held back is text after all.

    With `partial`, a call written name first (as the call grammars make them) is also passed
    on as it comes: its start once the name is complete, then its arguments' text as it is
    generated; joined, those deltas are the whole call's `arguments`."""

    def __init__(self, syntax: Syntax, *, partial: bool = False) -> None:
        self.syntax = syntax
        self.opener = syntax.open or '{"name"'
        self._buf = ""
        self._in_call = False
        self._after_call = False  # the newlines that separate calls are not text
        self.calls: list[Call] = []
        self._partial = partial and not syntax.listed
        self._head = re.compile(
            r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"'
            + re.escape(syntax.args_key)
            + r'"\s*:\s*'
        )
        self._started: CallStart | None = None  # the call being streamed
        self._args_at = 0  # where its arguments start in the buffer
        self._scan: JsonCloser | None = None  # ...and how far they are complete
        self._scanned = 0
        self._sent = 0  # characters of its arguments passed on

    def feed(self, text: str) -> list[Part]:
        self._buf += text
        out: list[Part] = []
        while True:
            if self._after_call:
                self._buf = self._buf.lstrip("\n")
                if not self._buf:
                    return out
                self._after_call = False
            if not self._in_call:
                at = self._buf.find(self.opener)
                if at < 0:
                    cut = len(self._buf) - _partial(self._buf, self.opener)
                    if cut:
                        out.append(Text(self._buf[:cut]))
                    self._buf = self._buf[cut:]
                    return out
                if at:
                    out.append(Text(self._buf[:at]))
                self._buf = self._buf[at:]
                self._in_call = True
            got = self._block()
            if got is None:
                return out + self._stream()
            parsed, used = got
            if isinstance(parsed, list):
                out += self._ending(parsed)
                self.calls += parsed
                self._after_call = True
            else:
                out.append(parsed)
            self._buf, self._in_call = self._buf[used:], False
            self._started = None

    def _stream(self) -> list[Part]:
        """What an incomplete call adds to the stream: its start once the name is whole,
        then its arguments as far as they go (never past their end)."""
        if not self._partial:
            return []
        out: list[Part] = []
        if self._started is None:
            m = self._head.match(self._buf, len(self.syntax.open))
            if m is None or m.end() == len(self._buf):
                return out  # (what follows the colon may still be more space)
            name = json.loads(f'"{m.group(1)}"')
            self._started = CallStart(len(self.calls), "call_" + secrets.token_hex(12), name)
            self._args_at = self._scanned = m.end()
            self._scan, self._sent = JsonCloser(), 0
            out.append(self._started)
        assert self._scan is not None
        while self._scanned < len(self._buf) and not self._scan.done:
            self._scan.feed(self._buf[self._scanned].encode())
            self._scanned += 1
        new = self._buf[self._args_at + self._sent : self._scanned]
        if new:
            self._sent += len(new)
            out.append(ArgsDelta(self._started.index, new))
        return out

    def _ending(self, calls: list[Call]) -> list[Part]:
        """Complete calls as the stream passes them on: a streamed one's last arguments."""
        if self._started is None:
            return list(calls)
        first, started = calls[0], self._started
        rest = first.arguments[self._sent :]
        return [*([ArgsDelta(started.index, rest)] if rest else []), *calls]

    def _block(self) -> tuple[list[Call] | Text, int] | None:
        """The block at the start of the buffer: its calls (or, if it is no call after all,
        its text) and how many characters it took; None while it may not be complete."""
        s = self.syntax
        at = len(s.open)
        at += len(self._buf[at:]) - len(self._buf[at:].lstrip())
        try:
            value, at = json.JSONDecoder().raw_decode(self._buf, at)
        except ValueError:
            return None  # not complete yet (a grammar makes it JSON in the end)
        close = s.close.strip("\n")
        if close:
            gap = len(self._buf[at:]) - len(self._buf[at:].lstrip(" \n"))
            tail = self._buf[at + gap : at + gap + len(close)]
            if tail != close:
                if close.startswith(tail):
                    return None  # the closing may still come
                return Text(self._buf[:at]), at
            at += gap + len(close)
        items = value if s.listed and isinstance(value, list) else [value]
        calls = [self._call(v) for v in items]
        if not s.listed and calls[0] is not None:
            calls[0] = self._as_written(calls[0])
        if not items or any(c is None for c in calls):
            return Text(self._buf[:at]), at
        return [c for c in calls if c is not None], at

    def _call(self, value: Any) -> Call | None:
        if not isinstance(value, dict) or not isinstance(value.get("name"), str):
            return None
        args = value.get(self.syntax.args_key, value.get("arguments", {}))
        text = json.dumps(args, ensure_ascii=False)
        return Call("call_" + secrets.token_hex(12), value["name"], text)

    def _as_written(self, call: Call) -> Call:
        """The call with its arguments' text as the model wrote it (what a stream of its
        deltas joins into), and the id its start was streamed with."""
        m = self._head.match(self._buf, len(self.syntax.open))
        if m is None:
            return call
        try:
            _, end = json.JSONDecoder().raw_decode(self._buf, m.end())
        except ValueError:
            return call
        ident = self._started.id if self._started is not None else call.id
        return Call(ident, call.name, self._buf[m.end() : end])

    def finish(self) -> list[Part]:
        """The end of the output: a call left incomplete is text after all (never lost)."""
        out: list[Part] = [Text(self._buf)] if self._buf else []
        self._buf, self._in_call, self._started = "", False, None
        return out


def _partial(buf: str, opener: str) -> int:
    """Length of the longest suffix of buf that is a proper prefix of `opener`."""
    for n in range(min(len(opener) - 1, len(buf)), 0, -1):
        if buf.endswith(opener[:n]):
            return n
    return 0
