"""Closing any GBNF grammar's text before the token limit: the shortest text that completes
what has been written, tracked character by character.

`engine/json_close.py` does this for the one JSON grammar of `json_object`; a schema's grammar
(or a tool call's) also says which properties must still come and what each may hold, so its
shortest completion is the grammar's to say. `GbnfCloser` reads the GBNF text the sampler
enforces, follows the output through it as llama.cpp's grammar does (a set of parse stacks,
advanced one code point at a time), and gives the shortest text from there to a complete
parse: each open rule finished by its shortest alternative (a character class gives its
first character). `GrammarConstraint` then keeps the output within reach of that text, as for
JSON objects.

A grammar the parser does not follow (a construct it does not know) raises `ValueError` when
it is read; the constraint then has no closer, and a reply may be cut at the limit as before.
"""

from __future__ import annotations

import codecs
import re
from collections.abc import Iterable
from dataclasses import dataclass

MAX_STACKS = 256  # a grammar this ambiguous is not followed further (the closer gives up)
_MAX_CODE = 0x10FFFF


@dataclass(frozen=True)
class Chars:
    """A character element: code point ranges (inclusive), or all but them."""

    ranges: tuple[tuple[int, int], ...]
    negated: bool = False

    def matches(self, c: int) -> bool:
        inside = any(a <= c <= b for a, b in self.ranges)
        return inside != self.negated

    def first(self) -> int:
        """The character a shortest completion writes here: a printable one where it can."""
        for c in (*range(0x61, 0x7B), *range(0x30, 0x3A), 0x20, *range(0x21, 0x7F)):
            if self.matches(c):
                return c
        if not self.negated:
            return self.ranges[0][0]
        c = 0
        while not self.matches(c):
            c += 1
        return c


Element = Chars | str  # a character class, or a rule's name
Alt = tuple[Element, ...]


class Grammar:
    """GBNF rules, each a tuple of alternatives; groups and repetitions become rules of their
    own (as llama.cpp builds them)."""

    def __init__(self, text: str) -> None:
        self.rules: dict[str, list[Alt]] = {}
        self._n = 0
        for name, body in _split_rules(text):
            p = _Parser(body, self, name)
            self.rules[name] = p.alternatives()
            p.end()
        if "root" not in self.rules:
            raise ValueError("the grammar has no root rule")
        for alts in self.rules.values():
            for alt in alts:
                for el in alt:
                    if isinstance(el, str) and el not in self.rules:
                        raise ValueError(f"the grammar uses an undefined rule {el!r}")
        self.shortest = self._shortest_lengths()

    def new_rule(self, alts: list[Alt]) -> str:
        self._n += 1
        name = f"\x00{self._n}"
        self.rules[name] = alts
        return name

    def _shortest_lengths(self) -> dict[str, int]:
        inf = 1 << 40
        best = dict.fromkeys(self.rules, inf)
        changed = True
        while changed:
            changed = False
            for name, alts in self.rules.items():
                n = min((self.alt_length(a, 0, best) for a in alts), default=inf)
                if n < best[name]:
                    best[name], changed = n, True
        if best["root"] >= inf:
            raise ValueError("the grammar's root admits no finite text")
        return best

    def alt_length(self, alt: Alt, start: int, best: dict[str, int] | None = None) -> int:
        best = self.shortest if best is None else best
        return sum(1 if isinstance(el, Chars) else best[el] for el in alt[start:])

    def shortest_alt(self, name: str) -> Alt:
        return min(self.rules[name], key=lambda a: self.alt_length(a, 0))

    def write_shortest(self, alt: Alt, start: int, out: list[int]) -> None:
        for el in alt[start:]:
            if isinstance(el, Chars):
                out.append(el.first())
            else:
                self.write_shortest(self.shortest_alt(el), 0, out)


# A stack: frames (alternative, index of its next element), the innermost last.
Frame = tuple[Alt, int]
Stack = tuple[Frame, ...]


class GbnfCloser:
    """Follows text through a grammar and says the shortest text that completes it."""

    def __init__(self, grammar: Grammar | str) -> None:
        self.grammar = grammar if isinstance(grammar, Grammar) else Grammar(grammar)
        self._stacks = self._expand_all((alt, 0) for alt in self.grammar.rules["root"])
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self.lost = False  # the text left the grammar (or it grew too ambiguous)

    def copy(self) -> GbnfCloser:
        other = object.__new__(GbnfCloser)
        other.grammar = self.grammar
        other._stacks = self._stacks
        other._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        other._decoder.setstate(self._decoder.getstate())
        other.lost = self.lost
        return other

    def _expand_all(self, frames: Iterable[Frame]) -> frozenset[Stack]:
        out: set[Stack] = set()
        for frame in frames:
            self._expand((frame,), out)
        return frozenset(out)

    def _expand(self, stack: Stack, out: set[Stack], depth: int = 0) -> None:
        """Every stack `stack` stands for whose innermost frame is at a character element
        (or the empty stack: the text may end here)."""
        if depth > 4096:
            raise ValueError("the grammar recurses without consuming text")
        while stack and stack[-1][1] == len(stack[-1][0]):
            stack = stack[:-1]
            if stack:
                alt, i = stack[-1]
                stack = (*stack[:-1], (alt, i))
        if not stack:
            out.add(())
            return
        alt, i = stack[-1]
        el = alt[i]
        if isinstance(el, Chars):
            out.add(stack)
            return
        parent = (*stack[:-1], (alt, i + 1))
        for sub in self.grammar.rules[el]:
            self._expand((*parent, (sub, 0)), out, depth + 1)

    def feed(self, data: bytes) -> None:
        for ch in self._decoder.decode(data):
            self._char(ord(ch))

    def _char(self, c: int) -> None:
        if self.lost:
            return
        out: set[Stack] = set()
        for stack in self._stacks:
            if not stack:
                continue
            alt, i = stack[-1]
            el = alt[i]
            assert isinstance(el, Chars)
            if el.matches(c):
                self._expand((*stack[:-1], (alt, i + 1)), out)
        if not out or len(out) > MAX_STACKS:
            self.lost = True
        self._stacks = frozenset(out)

    @property
    def in_string(self) -> bool:
        """Whether the text is inside a JSON string: every way on is at a class of string
        characters (all but the quote and backslash), so plain text keeps the closing as
        short."""
        tops = [s[-1][0][s[-1][1]] for s in self._stacks if s]
        return (
            bool(tops)
            and len(tops) == len(self._stacks)
            and all(
                isinstance(t, Chars) and t.negated and not t.matches(34) and not t.matches(92)
                for t in tops
            )
        )

    @property
    def done(self) -> bool:
        """Whether the text may end here."""
        return () in self._stacks

    def closing(self) -> str:
        """The shortest text that completes what was fed ("" if it may end here)."""
        if self.lost or not self._stacks:
            return ""
        best = min(self._stacks, key=self._length)
        out: list[int] = []
        for alt, i in reversed(best):
            self.grammar.write_shortest(alt, i, out)
        return "".join(map(chr, out))

    def _length(self, stack: Stack) -> int:
        return sum(self.grammar.alt_length(alt, i) for alt, i in stack)


# ----- reading GBNF -----

_RULE = re.compile(r"^([a-zA-Z0-9_-]+)\s*::=", re.MULTILINE)


def _split_rules(text: str) -> list[tuple[str, str]]:
    text = "\n".join(_strip_comment(line) for line in text.splitlines())
    marks = list(_RULE.finditer(text))
    if not marks:
        raise ValueError("no rules in the grammar")
    out = []
    for m, nxt in zip(marks, [*marks[1:], None], strict=True):
        out.append((m.group(1), text[m.end() : nxt.start() if nxt else len(text)]))
    return out


def _strip_comment(line: str) -> str:
    """The line without a # comment (a # inside a literal or class is kept)."""
    quote = bracket = False
    i = 0
    while i < len(line):
        c = line[i]
        if c == "\\" and (quote or bracket):
            i += 2
            continue
        if c == '"' and not bracket:
            quote = not quote
        elif c == "[" and not quote:
            bracket = True
        elif c == "]" and bracket:
            bracket = False
        elif c == "#" and not quote and not bracket:
            return line[:i]
        i += 1
    return line


_ESCAPES = {"n": 10, "r": 13, "t": 9, "\\": 92, '"': 34, "[": 91, "]": 93, "-": 45, "^": 94}


class _Parser:
    def __init__(self, text: str, grammar: Grammar, name: str) -> None:
        self.s = text
        self.i = 0
        self.g = grammar
        self.name = name

    def _space(self) -> None:
        while self.i < len(self.s) and self.s[self.i] in " \t\r\n":
            self.i += 1

    def _peek(self) -> str:
        self._space()
        return self.s[self.i] if self.i < len(self.s) else ""

    def end(self) -> None:
        if self._peek():
            raise ValueError(f"rule {self.name}: unexpected {self.s[self.i :][:20]!r}")

    def alternatives(self) -> list[Alt]:
        alts = [self._sequence()]
        while self._peek() == "|":
            self.i += 1
            alts.append(self._sequence())
        return alts

    def _sequence(self) -> Alt:
        items: list[Element] = []
        while True:
            c = self._peek()
            if c in ("", "|", ")"):
                return tuple(items)
            atom = self._atom()
            items += self._repeat(atom)

    def _atom(self) -> list[Element]:
        c = self.s[self.i]
        if c == '"':
            self.i += 1
            out: list[Element] = []
            while self.s[self.i] != '"':
                code = self._char()
                out.append(Chars(((code, code),)))
            self.i += 1
            return out
        if c == "[":
            return [self._class()]
        if c == ".":
            self.i += 1
            return [Chars(((0, _MAX_CODE),))]
        if c == "(":
            self.i += 1
            alts = self.alternatives()
            if self._peek() != ")":
                raise ValueError(f"rule {self.name}: a group is not closed")
            self.i += 1
            return [self.g.new_rule(alts)]
        m = re.compile(r"[a-zA-Z0-9_-]+").match(self.s, self.i)
        if not m:
            raise ValueError(f"rule {self.name}: unexpected {self.s[self.i :][:20]!r}")
        self.i = m.end()
        return [m.group(0)]

    def _class(self) -> Chars:
        self.i += 1
        negated = self.s[self.i] == "^"
        if negated:
            self.i += 1
        ranges = []
        while self.s[self.i] != "]":
            a = self._char()
            b = a
            if self.s[self.i] == "-" and self.s[self.i + 1] != "]":
                self.i += 1
                b = self._char()
            ranges.append((a, b))
        self.i += 1
        return Chars(tuple(ranges), negated)

    def _char(self) -> int:
        c = self.s[self.i]
        if c != "\\":
            self.i += 1
            return ord(c)
        e = self.s[self.i + 1]
        if e in "xuU":
            n = {"x": 2, "u": 4, "U": 8}[e]
            code = int(self.s[self.i + 2 : self.i + 2 + n], 16)
            self.i += 2 + n
            return code
        if e not in _ESCAPES:
            raise ValueError(f"rule {self.name}: unknown escape \\{e}")
        self.i += 2
        return _ESCAPES[e]

    def _repeat(self, atom: list[Element]) -> list[Element]:
        """The atom with the repetition that follows it, as elements."""
        if self.i >= len(self.s):
            return atom
        c = self.s[self.i]  # a repetition follows its atom without space
        if c not in "*+?{":
            return atom
        if c == "{":
            m = re.compile(r"\{\s*(\d+)\s*(,\s*(\d*)\s*)?\}").match(self.s, self.i)
            if not m:
                raise ValueError(f"rule {self.name}: a bad repetition")
            self.i = m.end()
            low = int(m.group(1))
            high = low if m.group(2) is None else (int(m.group(3)) if m.group(3) else None)
        else:
            self.i += 1
            low, high = {"*": (0, None), "+": (1, None), "?": (0, 1)}[c]
        return self._repeated(tuple(atom), low, high)

    def _repeated(self, atom: Alt, low: int, high: int | None) -> list[Element]:
        out: list[Element] = list(atom * low)
        if high is None:
            star = self.g.new_rule([])
            self.g.rules[star] = [(*atom, star), ()]
            return [*out, star]
        tail: list[Element] = []
        for _ in range(high - low):  # (atom (atom (...)?)?)?
            tail = [self.g.new_rule([(*atom, *tail), ()])]
        return out + tail
