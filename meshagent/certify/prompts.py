"""The certification prompts, shipped with the package: every report names which it used.

Kinds that stress different things: a chat turn through the model's own template, code,
text that repeats (attention to far positions, the pattern a model copies), several scripts
(the tokenizer's long tail, embeddings rarely seen), and a long context filled to the length
being certified.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Prompt:
    name: str
    text: str
    chat: bool = False  # rendered through the model's chat template as one user turn
    fill_to_ctx: bool = False  # repeated until it reaches the certified context length


PROMPTS: tuple[Prompt, ...] = (
    Prompt("chat", "Write one sentence about the sea.", chat=True),
    Prompt(
        "chat-reasoning",
        "A train leaves at 9:40 and the trip takes 2 hours 35 minutes. When does it arrive? "
        "Explain step by step.",
        chat=True,
    ),
    Prompt(
        "code",
        "def merge_sorted(a: list[int], b: list[int]) -> list[int]:\n"
        '    """Merge two sorted lists into one sorted list."""\n'
        "    out = []\n    i = j = 0\n",
    ),
    Prompt("repeated", "red green blue yellow, " * 24 + "red green"),
    Prompt(
        "multilingual",
        "English: The library opens at nine. Français : La bibliothèque ouvre à neuf heures. "
        "Deutsch: Die Bibliothek öffnet um neun. Español: La biblioteca abre a las nueve. "
        "日本語：図書館は九時に開きます。 Русский: Библиотека открывается в девять. "
        "Ελληνικά:",
    ),
    Prompt(
        "long-context",
        "The keeper of the northern lighthouse kept a log of every ship that passed, every "
        "storm that broke against the rocks and every letter that arrived by boat. ",
        fill_to_ctx=True,
    ),
)
