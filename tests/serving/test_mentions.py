"""What a request's words name outside the documents it quotes (`serving/mentions.py`): the
names and numbers where its copy will likely change."""

from __future__ import annotations

import json

from meshagent.serving.mentions import (
    mentioned_names,
    mentioned_numbers,
    number_positions,
    words,
)

DOC = json.dumps({"api": {"port": 9337, "version": "0.4.2", "slots": 12}}, indent=2)


def test_the_words_leave_out_fenced_blocks_and_json_values_that_open_a_line():
    text = (
        f"Here is a document:\n{DOC}\nand code:\n```python\nx = 12\n```\n"
        'Change "port" 9337 to 9400. Keep {"inline": 1} as is.'
    )
    got = words(text)
    assert "api" not in got and "x = 12" not in got
    assert 'Change "port" 9337 to 9400.' in got and '{"inline": 1}' in got  # (not a line's start)
    # a value left open runs to the end; an open fence too
    assert words('say\n{"a": [1, 2\nmore') == "say\n "
    assert words("say ```python\nx = 1") == "say  "


def test_names_in_backticks_and_numbers_of_two_digits_or_more_are_mentioned():
    text = (
        "Here is a function:\n```python\ndef f(total):\n    return `x2`\n```\n"
        "Rename `total` to `running_sum` and keep `fn(x)`, nothing else. `a` is no name."
    )
    assert mentioned_names(text) == {"total", "running_sum", "fn"}
    assert mentioned_names("```\nan open block `x1`") == set()
    request = f"{DOC}\nSet 9337 to 9400 and version 0.4.2 to 0.5.0, 1 slot, not x86 or 12b."
    assert mentioned_numbers(request) == {"9337", "9400", "0.4.2", "0.5.0"}


def test_a_number_is_found_in_the_tokens_that_spell_it_where_it_stands_whole():
    texts = ["port", '": ', "9", "3", "3", "7", ",", " 19337", " 9337", ".5", " x9337", " 93", "37"]
    assert number_positions(texts, {"9337"}) == {2, 3, 4, 5, 11, 12}
    assert number_positions(texts, set()) == set()


def test_a_drafter_for_an_answer_knows_what_its_request_mentions():
    from meshagent.serving.copying import TokenNames
    from meshagent.serving.drafting import SuffixDrafter

    pieces = ['{"port": ', "9", "3", "3", "7", "}\n", "Rename `", "total", "`, set ", "9337"]
    vocabulary = TokenNames(lambda token: pieces[token].encode())
    d = SuffixDrafter.answering(list(range(len(pieces))), (), vocabulary)
    assert d.copier.mentioned == {"total"}
    assert d.copier.doubtful == {1, 2, 3, 4, 9}
    assert SuffixDrafter.answering(list(range(len(pieces)))).copier.doubtful == set()
