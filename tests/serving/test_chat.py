import pytest

from meshagent.errors import ModelError
from meshagent.serving.chat import ChatMessage, ChatTemplate, TemplateError


def test_chatml_fallback_renders_a_generation_prompt():
    t = ChatTemplate(None, bos_token="<s>", eos_token="</s>")
    text = t.render([ChatMessage("system", "be brief"), ChatMessage("user", "hi")])
    assert text == (
        "<|im_start|>system\nbe brief<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n"
        "<|im_start|>assistant\n"
    )


def test_model_template_sees_bos_and_roles():
    src = "{{ bos_token }}{% for m in messages %}[{{ m.role }}]{{ m.content }}{% endfor %}"
    t = ChatTemplate(src, bos_token="<s>", eos_token="</s>")
    assert (
        t.render([ChatMessage("user", "a"), ChatMessage("assistant", "b")])
        == "<s>[user]a[assistant]b"
    )


def test_template_exceptions_become_template_errors():
    src = (
        "{% if messages[0].role != 'user' %}"
        "{{ raise_exception('must start with user') }}{% endif %}"
    )
    t = ChatTemplate(src, bos_token="", eos_token="")
    with pytest.raises(TemplateError, match="must start with user"):
        t.render([ChatMessage("assistant", "x")])


def test_unparseable_template_is_a_model_error():
    with pytest.raises(ModelError):
        ChatTemplate("{% for %}", bos_token="", eos_token="")


def test_sandbox_refuses_attribute_escapes():
    src = "{{ messages.__class__.__mro__ }}"
    t = ChatTemplate(src, bos_token="", eos_token="")
    with pytest.raises(TemplateError):
        t.render([ChatMessage("user", "x")])
