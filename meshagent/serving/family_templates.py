"""Chat templates for GGUFs that carry none: the turn format of the model's family.

A GGUF normally carries its own Jinja template (`tokenizer.chat_template`); one converted
without it would otherwise get ChatML, which a Gemma, Phi, Mistral or Llama 3 model was never
trained on. The family is told by the architecture and, where one architecture serves several
formats (`llama`: Llama 2 and Mistral's [INST], Llama 3's headers; `deepseek2`: V2's plain
turns, V3's markers), by the special tokens its vocabulary holds. Each template below writes the
family's turn format as its model cards give it; system messages go where the family puts them
(Gemma and Mistral have no system turn: it opens the first user turn).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

CHATML = (
    "{% for m in messages %}"
    "{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

# The system text is held back and opens the first user turn.
_SYSTEM_INTO_FIRST_USER = (
    "{% set ns = namespace(system='') %}"
    "{% for m in messages if m['role'] == 'system' %}"
    "{% set ns.system = ns.system + m['content'] + '\\n\\n' %}"
    "{% endfor %}"
)

GEMMA = (
    "{{ bos_token }}" + _SYSTEM_INTO_FIRST_USER + "{% for m in messages if m['role'] != 'system' %}"
    "{% set role = 'model' if m['role'] == 'assistant' else 'user' %}"
    "{{ '<start_of_turn>' + role + '\\n' }}"
    "{% if loop.first %}{{ ns.system }}{% endif %}"
    "{{ m['content'] | trim }}{{ '<end_of_turn>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<start_of_turn>model\\n' }}{% endif %}"
)

PHI3 = (
    "{% for m in messages %}"
    "{{ '<|' + m['role'] + '|>\\n' + m['content'] + '<|end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}"
)

MISTRAL = (
    "{{ bos_token }}" + _SYSTEM_INTO_FIRST_USER + "{% for m in messages if m['role'] != 'system' %}"
    "{% if m['role'] == 'assistant' %}{{ ' ' + m['content'] + eos_token }}"
    "{% else %}{{ '[INST] ' }}{% if loop.first %}{{ ns.system }}{% endif %}"
    "{{ m['content'] + ' [/INST]' }}{% endif %}"
    "{% endfor %}"
)

LLAMA3 = (
    "{{ bos_token }}"
    "{% for m in messages %}"
    "{{ '<|start_header_id|>' + m['role'] + '<|end_header_id|>\\n\\n' }}"
    "{{ m['content'] | trim }}{{ '<|eot_id|>' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}"
    "{% endif %}"
)

COMMAND_R = (
    "{{ bos_token }}"
    "{% for m in messages %}"
    "{% set turn = {'user': '<|USER_TOKEN|>', 'assistant': '<|CHATBOT_TOKEN|>'}"
    ".get(m['role'], '<|SYSTEM_TOKEN|>') %}"
    "{{ '<|START_OF_TURN_TOKEN|>' + turn + m['content'] + '<|END_OF_TURN_TOKEN|>' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|START_OF_TURN_TOKEN|><|CHATBOT_TOKEN|>' }}{% endif %}"
)

DEEPSEEK2 = (
    "{{ bos_token }}"
    "{% for m in messages %}"
    "{% if m['role'] == 'system' %}{{ m['content'] + '\\n\\n' }}"
    "{% elif m['role'] == 'user' %}{{ 'User: ' + m['content'] + '\\n\\n' }}"
    "{% else %}{{ 'Assistant: ' + m['content'] + eos_token }}{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ 'Assistant:' }}{% endif %}"
)

DEEPSEEK3 = (
    "{{ bos_token }}"
    "{% for m in messages %}"
    "{% if m['role'] == 'system' %}{{ m['content'] }}"
    "{% elif m['role'] == 'user' %}{{ '<｜User｜>' + m['content'] }}"
    "{% else %}{{ '<｜Assistant｜>' + m['content'] + '<｜end▁of▁sentence｜>' }}{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<｜Assistant｜>' }}{% endif %}"
)

HARMONY = (
    "{% for m in messages %}"
    "{% set role = 'developer' if m['role'] == 'system' else m['role'] %}"
    "{{ '<|start|>' + role + '<|message|>' + m['content'] + '<|end|>' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start|>assistant' }}{% endif %}"
)


@dataclass(frozen=True)
class FamilyTemplate:
    name: str  # as `models inspect` and the status say it
    source: str


TEMPLATES = {
    t.name: t
    for t in (
        FamilyTemplate("chatml", CHATML),
        FamilyTemplate("gemma", GEMMA),
        FamilyTemplate("phi3", PHI3),
        FamilyTemplate("mistral", MISTRAL),
        FamilyTemplate("llama3", LLAMA3),
        FamilyTemplate("command-r", COMMAND_R),
        FamilyTemplate("deepseek2", DEEPSEEK2),
        FamilyTemplate("deepseek3", DEEPSEEK3),
        FamilyTemplate("harmony", HARMONY),
    )
}

_BY_ARCH = {
    "gemma": "gemma",
    "gemma2": "gemma",
    "gemma3": "gemma",
    "phi3": "phi3",
    "cohere2": "command-r",
    "command-r": "command-r",
    "gpt-oss": "harmony",
}


def family_template(arch: str, has_token: Callable[[str], bool]) -> FamilyTemplate:
    """The template for a model of `arch` whose file has none; `has_token(text)`: whether its
    vocabulary holds that special token."""
    if arch in _BY_ARCH:
        return TEMPLATES[_BY_ARCH[arch]]
    if arch == "llama":
        if has_token("<|start_header_id|>"):
            return TEMPLATES["llama3"]
        if has_token("[INST]") or not has_token("<|im_start|>"):
            return TEMPLATES["mistral"]  # Mistral's and Llama 2's [INST] turns
    if arch == "deepseek2":
        return TEMPLATES["deepseek3" if has_token("<｜User｜>") else "deepseek2"]
    return TEMPLATES["chatml"]
