"""The thinking block of a reasoning model's output apart from its answer, whole and streamed
in pieces of any size, and a thinking template's own rule for past turns (Qwen3's)."""

from __future__ import annotations

import random

import pytest

from localpaged.model.thinking import (
    ThinkingSplitter,
    prompt_opens_thinking,
    split_thinking,
    template_thinks,
)

CASES = [
    # (output, the prompt opened the block, thinking, answer)
    ("<think>\nLet me see: 2 + 2.\n</think>\n\nIt is 4.", False, "Let me see: 2 + 2.", "It is 4."),
    ("\n<think>a < b, so</think>b wins", False, "a < b, so", "b wins"),
    ("<think>\n\n</think>\n\nHi!", False, "", "Hi!"),  # Qwen3 with thinking off
    ("Just an answer.", False, "", "Just an answer."),
    ("Okay, the user asks.\n</think>\n\nParis.", True, "Okay, the user asks.", "Paris."),  # R1
    ("<think>never closed\n", False, "never closed", ""),
    ("<thin", False, "", "<thin"),
    ("The tag </think> in an answer stays.", False, "", "The tag </think> in an answer stays."),
    ("<think>x</think>then <think>y</think>", False, "x", "then <think>y</think>"),
]


@pytest.mark.parametrize(("text", "opened", "thinking", "answer"), CASES)
def test_whole_and_streamed_outputs_split_alike(text: str, opened: bool, thinking: str,
                                                answer: str) -> None:
    assert split_thinking(text, opened) == (thinking, answer)
    rng = random.Random(len(text))
    for _ in range(30):  # every way of cutting it into deltas
        s = ThinkingSplitter(opened)
        got_t, got_a, at = [], [], 0
        while at < len(text):
            step = rng.randint(1, 5)
            t, a = s.feed(text[at:at + step])
            got_t.append(t)
            got_a.append(a)
            at += step
        t, a = s.flush()
        assert ("".join(got_t) + t, "".join(got_a) + a) == (thinking, answer)


QWEN3_LIKE = (  # the past-turn rule of Qwen3's template, reduced
    "{%- for m in messages %}{%- if m.role == 'assistant' %}"
    "{%- set content = m.content.split('</think>')[-1].lstrip('\\n') %}"
    "{{ '<|im_start|>assistant\\n' + content + '<|im_end|>\\n' }}"
    "{%- else %}{{ '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}{%- endif %}"
    "{%- endfor %}{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and not enable_thinking %}"
    "{{ '<think>\\n\\n</think>\\n\\n' }}{%- endif %}{%- endif %}")


def test_a_thinking_template_is_known_by_its_tag() -> None:
    assert template_thinks(QWEN3_LIKE) and not template_thinks("{{ m.content }}")
    assert not template_thinks(None)
    assert prompt_opens_thinking("<|Assistant|><think>\n") and not prompt_opens_thinking("x")
