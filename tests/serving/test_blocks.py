"""Where an answer's copied block ends (`serving/blocks.py`), and that a draft stops there: a
JSON value the answer opened with, or a fenced block, closes, and the text the copy comes from
goes on with the request's own words, which the answer does not repeat."""

from __future__ import annotations

from meshagent.serving.blocks import BlockEnd
from meshagent.serving.copying import TokenNames
from meshagent.serving.drafting import SuffixDrafter

# A vocabulary of text pieces, one token each.
PIECES = [
    "{\n",
    '  "port": ',
    "9337",
    "9400",
    ",\n",
    '  "name": "',
    "a}b{",
    '"\n',
    "}",
    "\n",
    "Repeat",
    " it",
    ".",
    "```",
    "python",
    "\n",
    "def f():",
    "    return 1",
    "``",
    "`",
    "  ",
    "[",
    "]",
    "Sure",
    '"\\"',
    "here",
]
TOKEN = {p: i for i, p in enumerate(PIECES)}


def text(token: int) -> str:
    return PIECES[token]


def toks(*pieces: str) -> list[int]:
    return [TOKEN[p] for p in pieces]


def test_a_draft_stops_where_the_json_value_the_answer_opened_with_closes():
    block = BlockEnd(text, toks("{\n", '  "port": ', "9400", ",\n"))
    draft = toks('  "name": "', "a}b{", '"\n', "}", "\n", "Repeat", " it")
    # the braces inside the string do not count; the one that closes the object does
    assert block.keep(draft) == 4
    # nested values close first: only the outermost one ends the answer
    nested = BlockEnd(text, toks("[", "{\n"))
    assert nested.keep(toks("}", ",\n", "{\n", "}", "]", "\n", "Repeat")) == 5
    # a value split across drafts in flight (`after`) and the draft
    assert block.keep(toks("}", "\n"), after=toks('  "name": "', '"\n')) == 1
    # an escaped quote does not end a string
    assert BlockEnd(text, toks("{\n", '  "name": "', '"\\"', "a}b{")).keep(toks("}")) == 1


def test_a_draft_stops_where_the_fenced_block_closes():
    block = BlockEnd(text, toks("```", "python", "\n", "def f():", "\n"))
    assert block.keep(toks("    return 1", "\n", "```", "\n", "Repeat")) == 3
    # a fence split across tokens
    assert block.keep(toks("    return 1", "\n", "``", "`", "\n", "Repeat")) == 4
    # text before the fence: the block still closes at its fence
    later = BlockEnd(text, toks("Sure", "\n", "```", "python", "\n"))
    assert later.keep(toks("def f():", "\n", "```", "\n")) == 3


def test_other_answers_and_closed_blocks_draft_on():
    draft = toks("}", "\n", "Repeat", " it", ".")
    assert BlockEnd(text, toks("Sure", " it")).keep(draft) == len(draft)  # not JSON
    assert BlockEnd(text, toks("  ", "Sure")).keep(draft) == len(draft)
    closed = BlockEnd(text, toks("{\n", "}", "\n"))  # the value closed already
    assert closed.keep(draft) == len(draft)
    fenced = BlockEnd(text, toks("```", "\n", "```"))  # so has the block
    assert fenced.keep(toks("\n", "```", "\n")) == 3  # (an opening fence is no end)
    # leading white space is not the answer's start
    assert BlockEnd(text, toks("  ", "{\n")).keep(toks("}", "\n")) == 1


def test_the_drafter_stops_its_copy_at_the_close_and_only_with_the_vocabulary():
    doc = toks("{\n", '  "port": ', "9337", ",\n", '  "name": "', '"\n', "}")
    prompt = [*toks("Sure", "\n"), *doc, *toks("\n", "Repeat", " it", ".")]
    answer = toks("{\n", '  "port": ', "9400", ",\n", '  "name": "')
    vocabulary = TokenNames(lambda token: PIECES[token].encode())
    # (built with the answer so far, as a replayed sequence is: its block is open)
    d = SuffixDrafter.answering(prompt, answer, vocabulary)
    assert d.propose(6) == tuple(toks('"\n', "}"))
    # without the vocabulary it copies on into the request's words
    plain = SuffixDrafter.answering(prompt, answer)
    assert plain.propose(6) == tuple(toks('"\n', "}", "\n", "Repeat", " it", "."))
