"""The chat template rendered without transformers (`localpaged.model.chat_template`) against
transformers' own `apply_chat_template` on real templates (SmolLM2's, Llama 3.2's with tools
and today's date, Mistral v0.3's with its role checks) and on templates using each extra of
transformers' sandbox."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import jinja2
import pytest

from localpaged.model import chat_template
from localpaged.model.saved_tokenizer import special_tokens_of

TEMPLATES = Path(__file__).parent.parent / "fixtures" / "chat_templates"
TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}
CHATS: list[list[dict[str, Any]]] = [
    [{"role": "user", "content": "Hello?"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Café 中文 🙂?"},
     {"role": "assistant", "content": "Yes.", "tool_calls": None},
     {"role": "user", "content": "  spaces\n\nand lines  "}],
]
# Each extra transformers' environment gives a template.
EXTRAS = (
    "{% set ns = namespace(n=0) %}{% for m in messages %}{% if loop.index > 2 %}{% break %}"
    "{% endif %}{% set ns.n = ns.n + 1 %}{{ m.role }}:{{ m.content | tojson }};{% endfor %}"
    "{{ ns.n }}{{ bos_token }}{{ eos_token }}{% generation %}G{{ add_generation_prompt }}"
    "{% endgeneration %}{{ dict(a=1) | tojson(indent=2) }}{{ tools | tojson(sort_keys=true) }}"
    "{% for m in messages %}{{ m.reasoning_content }}|{{ m.thinking }}|{% endfor %}"
    "{{ 'tool_calls' in messages[-1] }}{{ extra_var }}"
)


@pytest.fixture(scope="module")
def reference(smollm_hf_dir: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm_hf_dir)


def _both(ref: Any, template: str, messages: list[dict[str, Any]], **kw: Any) -> tuple[str, str]:
    ours = chat_template.render(template, messages, special_tokens=ref.special_tokens_map, **kw)
    theirs = ref.apply_chat_template(messages, chat_template=template, tokenize=False, **kw)
    return ours, theirs


@pytest.mark.parametrize("name", ["smollm2", "llama-3.2-instruct", "mistral-7b-instruct-v0.3",
                                  "extras"])
@pytest.mark.parametrize("generation_prompt", [True, False])
def test_renders_as_transformers(name: str, generation_prompt: bool, reference: Any) -> None:
    template = {"smollm2": reference.chat_template, "extras": EXTRAS}.get(name) or (
        TEMPLATES / f"{name}.jinja").read_text()
    for chat in CHATS:
        ours, theirs = _both(reference, template, chat, add_generation_prompt=generation_prompt)
        assert ours == theirs and ours
    tools = [TOOL]
    ours, theirs = _both(reference, template, CHATS[1], tools=tools, add_generation_prompt=True,
                         extra_var="X")
    assert ours == theirs
    thought = [{"role": "user", "content": "2+2?"},
               {"role": "assistant", "content": "4", "reasoning": "two and two"}]
    ours, theirs = _both(reference, template, thought)
    assert ours == theirs


def test_template_errors_are_jinja2s(reference: Any) -> None:
    mistral = (TEMPLATES / "mistral-7b-instruct-v0.3.jinja").read_text()
    bad = [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]
    with pytest.raises(jinja2.TemplateError) as ours:
        chat_template.render(mistral, bad)
    with pytest.raises(jinja2.TemplateError) as theirs:
        reference.apply_chat_template(bad, chat_template=mistral, tokenize=False)
    assert str(ours.value) == str(theirs.value)


def test_the_sandbox_holds() -> None:
    for escape in ("{{ ''.__class__.__mro__ }}", "{% set ns = namespace() %}"
                   "{% set ns._x = 1 %}", "{{ messages.append(1) }}"):
        with pytest.raises(jinja2.exceptions.SecurityError):
            chat_template.render(escape, CHATS[0])


def test_bad_input_is_refused() -> None:
    with pytest.raises(ValueError, match="empty conversation"):
        chat_template.render("{{ messages }}", [])
    with pytest.raises(TypeError, match="JSON schema"):
        chat_template.render("{{ tools }}", CHATS[0], tools=[print])
    with pytest.raises(TypeError, match="a chat message is a dict"):
        chat_template.render("{{ messages }}", ["hi"])


def test_special_tokens_of_a_config() -> None:
    config = {"bos_token": "<s>", "eos_token": {"content": "</s>", "special": True},
              "pad_token": None, "chat_template": "x"}
    assert special_tokens_of(config) == {"bos_token": "<s>", "eos_token": "</s>"}
