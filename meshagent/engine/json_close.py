"""Closing a JSON object before the token limit cuts it: the shortest text that completes
what has been written, tracked byte by byte.

A grammar makes every prefix of the output valid JSON so far, but a model that runs on
(repeating an item, or a long string) reaches its token limit mid-object, and the reply does
not parse. With the number of tokens left, `JsonCloser` says when to stop writing new
content: near the end only tokens that keep the closing text as short (text inside a string)
or that write a prefix of it are allowed, and at the very end only the latter, then the end
of generation. Each such token writes at least one character of the closing text, so it
always fits.
"""

from __future__ import annotations

_LITERALS = ("true", "false", "null")
_SPACE = b" \t\n\r"


class JsonCloser:
    def __init__(self) -> None:
        self._stack: list[str] = []  # "{" or "["
        self._modes: list[str] = []  # per container: what comes next in it
        self._started = False
        self._done = False
        self._in_string = False
        self._key = False  # the open string is an object's key
        self._escape = 0  # 1: after a backslash; 2-5: hex digits of \u still to come + 1
        self._scalar = ""  # a number or literal being written

    def copy(self) -> JsonCloser:
        other = JsonCloser()
        other.__dict__.update(self.__dict__)
        other._stack, other._modes = list(self._stack), list(self._modes)
        return other

    @property
    def done(self) -> bool:
        """Whether one whole JSON value was fed."""
        return self._done

    @property
    def in_string(self) -> bool:
        return self._in_string and self._escape == 0

    def feed(self, data: bytes) -> None:
        for byte in data:
            self._byte(chr(byte) if byte < 0x80 else "\x80")

    def _byte(self, c: str) -> None:
        if self._in_string:
            if self._escape == 1:
                self._escape = 5 if c == "u" else 0
            elif self._escape > 1:
                self._escape = self._escape - 1 if self._escape > 2 else 0
            elif c == "\\":
                self._escape = 1
            elif c == '"':
                self._in_string = False
                if self._key:
                    self._modes[-1] = "colon"
                else:
                    self._after_value()
            return
        if self._scalar:
            if c.isalnum() or c in "+-.":
                self._scalar += c
                return
            self._scalar = ""
            self._after_value()
        if c.encode() in _SPACE:
            return
        mode = self._modes[-1] if self._modes else "start"
        if c in "{[":
            self._started = True
            self._stack.append(c)
            self._modes.append("first" if c == "{" else "first-value")
        elif c == '"':
            self._in_string = True
            self._key = mode in ("first", "key")
        elif c == ":":
            self._modes[-1] = "value"
        elif c == ",":
            self._modes[-1] = "key" if self._stack[-1] == "{" else "value"
        elif c in "}]":
            self._stack.pop()
            self._modes.pop()
            self._after_value()
        else:
            self._scalar = c

    def _after_value(self) -> None:
        if self._modes:
            self._modes[-1] = "next"
        else:
            self._done = True

    def closing(self) -> str:
        """The shortest text that makes what was fed one complete JSON value."""
        if self._done:
            return ""
        if not self._started:
            return "{}"
        out = ""
        mode = self._modes[-1]
        if self._in_string:
            if self._escape == 1:
                out += "n"
            elif self._escape > 1:
                out += "0" * (self._escape - 1)
            out += '"'
            if self._key:
                out += ":null"
        elif self._scalar:
            out += _complete_scalar(self._scalar)
        elif mode == "key":
            out += '"":null'
        elif mode == "colon":
            out += ":null"
        elif mode == "value":
            out += "null"
        for c in reversed(self._stack):
            out += "}" if c == "{" else "]"
        return out


def _complete_scalar(s: str) -> str:
    for lit in _LITERALS:
        if lit.startswith(s):
            return lit[len(s) :]
    return "0" if s[-1] in "+-.eE" else ""
