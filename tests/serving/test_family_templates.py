"""A GGUF without a chat template gets its family's turn format, not ChatML."""

from __future__ import annotations

import pytest

from meshagent.cli.main import main
from meshagent.engine.llama import LlamaEngine
from meshagent.serving.chat import OWN, ChatMessage, ChatTemplate
from meshagent.serving.family_templates import TEMPLATES, family_template
from meshagent.testing.tiny_gguf import FAMILIES

TALK = [
    ChatMessage("system", "Be brief."),
    ChatMessage("user", "Hi"),
    ChatMessage("assistant", "Hello."),
    ChatMessage("user", "Bye"),
]

RENDERED = {
    "chatml": "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
    "<|im_start|>assistant\nHello.<|im_end|>\n<|im_start|>user\nBye<|im_end|>\n"
    "<|im_start|>assistant\n",
    "gemma": "<s><start_of_turn>user\nBe brief.\n\nHi<end_of_turn>\n<start_of_turn>model\n"
    "Hello.<end_of_turn>\n<start_of_turn>user\nBye<end_of_turn>\n<start_of_turn>model\n",
    "phi3": "<|system|>\nBe brief.<|end|>\n<|user|>\nHi<|end|>\n<|assistant|>\nHello.<|end|>\n"
    "<|user|>\nBye<|end|>\n<|assistant|>\n",
    "mistral": "<s>[INST] Be brief.\n\nHi [/INST] Hello.</s>[INST] Bye [/INST]",
    "llama3": "<s><|start_header_id|>system<|end_header_id|>\n\nBe brief.<|eot_id|>"
    "<|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|>"
    "<|start_header_id|>assistant<|end_header_id|>\n\nHello.<|eot_id|>"
    "<|start_header_id|>user<|end_header_id|>\n\nBye<|eot_id|>"
    "<|start_header_id|>assistant<|end_header_id|>\n\n",
    "command-r": "<s><|START_OF_TURN_TOKEN|><|SYSTEM_TOKEN|>Be brief.<|END_OF_TURN_TOKEN|>"
    "<|START_OF_TURN_TOKEN|><|USER_TOKEN|>Hi<|END_OF_TURN_TOKEN|>"
    "<|START_OF_TURN_TOKEN|><|CHATBOT_TOKEN|>Hello.<|END_OF_TURN_TOKEN|>"
    "<|START_OF_TURN_TOKEN|><|USER_TOKEN|>Bye<|END_OF_TURN_TOKEN|>"
    "<|START_OF_TURN_TOKEN|><|CHATBOT_TOKEN|>",
    "deepseek2": "<s>Be brief.\n\nUser: Hi\n\nAssistant: Hello.</s>User: Bye\n\nAssistant:",
    "deepseek3": "<s>Be brief.<｜User｜>Hi<｜Assistant｜>Hello.<｜end▁of▁sentence｜>"
    "<｜User｜>Bye<｜Assistant｜>",
    "harmony": "<|start|>developer<|message|>Be brief.<|end|><|start|>user<|message|>Hi<|end|>"
    "<|start|>assistant<|message|>Hello.<|end|><|start|>user<|message|>Bye<|end|>"
    "<|start|>assistant",
}


@pytest.mark.parametrize("name", sorted(TEMPLATES))
def test_each_family_template_renders_its_turns(name):
    t = TEMPLATES[name]
    template = ChatTemplate(None, bos_token="<s>", eos_token="</s>", fallback=(t.name, t.source))
    assert template.name == name
    assert template.render(TALK) == RENDERED[name]


def test_the_family_is_told_by_architecture_then_by_special_tokens():
    def holds(*tokens):
        return set(tokens).__contains__

    assert family_template("gemma3", holds()).name == "gemma"
    assert family_template("phi3", holds()).name == "phi3"
    assert family_template("cohere2", holds()).name == "command-r"
    assert family_template("gpt-oss", holds()).name == "harmony"
    assert family_template("qwen2", holds()).name == "chatml"
    assert family_template("llama", holds("<|start_header_id|>")).name == "llama3"
    assert family_template("llama", holds("[INST]")).name == "mistral"
    assert family_template("llama", holds("<|im_start|>")).name == "chatml"
    assert family_template("deepseek2", holds("<｜User｜>")).name == "deepseek3"
    assert family_template("deepseek2", holds()).name == "deepseek2"


def test_a_loaded_model_without_a_template_renders_its_familys_and_inspect_says_so(
    tmp_path, capsys, model_path
):
    path = FAMILIES["gemma3"](tmp_path / "tiny-gemma3.gguf")
    engine = LlamaEngine(path, slots=1, slot_ctx=128, flash_attn=False)
    try:
        template = ChatTemplate.for_model(engine)
        assert template.name == "gemma"
        assert template.render([ChatMessage("user", "Hi")]).endswith("<start_of_turn>model\n")
    finally:
        engine.close()
    assert main(["models", "inspect", str(path)]) == 0
    assert "chat template  gemma (the file has none: its family's)" in capsys.readouterr().out
    # SmolLM2 carries its own.
    assert main(["models", "inspect", str(model_path)]) == 0
    assert f"chat template  {OWN}" in capsys.readouterr().out
