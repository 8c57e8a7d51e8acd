"""What a request's own words name, outside the documents it quotes: where its copy will change.

A request that asks for a document back with changes names what changes: "rename `total` to
`running_sum`", '"port" 9337 becomes 9400', '"ttl" from 300 to 600'. Where the document
spells such a name or number, the answer's copy is likely to differ, so a draft stops before
it (`Copier.unsure`, `Copier.doubtful`) and the model's own token there comes with the window,
instead of a miss that wastes the rest of the window and makes the copy look less sure than
it is. The words are the request's text outside fenced code blocks and outside JSON values
that open a line (the documents themselves). Names count where the words give them as code,
in backticks; numbers of two digits or more count as they are written.

No I/O, no model: functions of text, tested alone (`SuffixDrafter.answering` uses them).
"""

from __future__ import annotations

import bisect
import itertools
import re
from collections.abc import Sequence

from meshagent.serving.blocks import scan_json

_FENCED = re.compile(r"```.*?(```|$)", re.S)
_INLINE = re.compile(r"`([^`\n]+)`")
_NAME = re.compile(r"[A-Za-z_][A-Za-z_0-9]+")
_NUMBER = re.compile(r"(?<![\w.])\d+(?:\.\d+)*(?![\w.])")


def words(text: str) -> str:
    """`text` without its fenced blocks and the JSON values that open a line in it."""
    text = _FENCED.sub(" ", text)
    out, at = [], 0
    for line in re.finditer(r"^[ \t]*[\[{]", text, re.M):
        if line.start() < at:
            continue  # inside a value already cut
        out.append(text[at : line.start()])
        end = scan_json(text, start=line.end() - 1)[3]  # (the value's opening bracket on)
        at = len(text) if end is None else end
    out.append(text[at:])
    return " ".join(out)


def mentioned_names(text: str) -> set[str]:
    """The names of two characters or more a request's words give in backticks."""
    return {n for span in _INLINE.findall(words(text)) for n in _NAME.findall(span)}


def mentioned_numbers(text: str) -> set[str]:
    """The numbers of two digits or more a request's words give (versions with their dots)."""
    return {n for n in _NUMBER.findall(words(text)) if sum(c.isdigit() for c in n) >= 2}


def number_positions(texts: Sequence[str], numbers: set[str]) -> set[int]:
    """The indices of the tokens (`texts`: each one's text) that spell part of one of
    `numbers` where it stands whole (not inside a longer number or name)."""
    if not numbers:
        return set()
    ends = list(itertools.accumulate(map(len, texts)))  # where each token's text ends
    text = "".join(texts)
    found: set[int] = set()
    for m in _NUMBER.finditer(text):
        if m.group() not in numbers:
            continue
        i = bisect.bisect_right(ends, m.start())  # the token that holds its first digit
        while i < len(ends) and (i == 0 or ends[i - 1] < m.end()):
            found.add(i)
            i += 1
    return found
