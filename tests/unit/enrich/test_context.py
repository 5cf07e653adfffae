"""What selection reads from a conversation and how its result goes back in (raytrain.enrich.context): toggles and
tool lists stay verbatim, the context block is delimited, the answer side reads the final answer."""

import pytest

from raytrain.enrich.context import (
    CONTEXT_CLOSE,
    CONTEXT_OPEN,
    answer_for_scoring,
    candidate_sentences,
    final_answer,
    is_toggle_line,
    split_system_prompt,
    with_context_block,
    with_selected_system_prompt,
)
from raytrain.enrich.conversation import Example, derive_example

TOGGLES = ("detailed thinking on", "detailed thinking off", "/think", "/no_think")
TOOL_LIST = ('You can call these functions:\n[{"name": "get_weather", "description": "Weather for a city.", '
             '"parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}]')


def _messages(system, *turns):
    rows = [{"role": "system", "content": system}] if system is not None else []
    rows += [{"role": r, "content": c} for r, c in turns]
    ex = derive_example({"uuid": "u", "license": "mit", "messages": rows})
    assert isinstance(ex, Example), ex
    return list(ex.messages)


@pytest.mark.parametrize("toggle", TOGGLES)
def test_toggles_are_instructions_not_candidates(toggle):
    assert is_toggle_line(toggle) and is_toggle_line(f"  {toggle.upper()} ")
    msgs = _messages(toggle, ("user", "What is 2 + 2?"), ("assistant", "4"))
    assert candidate_sentences(msgs).all == []
    assert with_context_block(msgs, []) == msgs
    assert split_system_prompt(f"{toggle}\n\nThe sky is blue today. Grass is green.") == \
        ([toggle], "The sky is blue today. Grass is green.")


def test_candidates_are_prose_of_system_and_earlier_turns():
    msgs = _messages("detailed thinking on\nBackground: the river is long. Its source lies in the hills.",
                     ("user", "Tell me about the valley please."), ("assistant", "The valley is green and wide."),
                     ("user", "How long is the river?"), ("assistant", "Very long."))
    c = candidate_sentences(msgs)
    assert c.system == ["Background: the river is long.", "Its source lies in the hills."]
    assert c.earlier == ["Tell me about the valley please.", "The valley is green and wide."]
    tools = _messages(TOOL_LIST, ("user", "Weather in Oslo?"), ("assistant", "Sunny."))
    assert candidate_sentences(tools).system == ["You can call these functions:"]  # the JSON is not prose


def test_context_block_goes_before_the_question_and_leaves_system_prompts_alone():
    msgs = _messages("detailed thinking off", ("user", "Where is Oslo?"), ("assistant", "In Norway."))
    out = with_context_block(msgs, ["Oslo is the capital of Norway.", "  ", "It rains a lot."])
    assert out[0] == msgs[0] and out[2] == msgs[2]
    assert out[1]["content"] == (f"{CONTEXT_OPEN}\nOslo is the capital of Norway.\nIt rains a lot.\n{CONTEXT_CLOSE}"
                                 "\n\nWhere is Oslo?")
    assert msgs[1]["content"] == "Where is Oslo?"  # inputs are not modified


def test_selected_system_prompt_keeps_toggles_and_counts_removed_characters():
    system = "/no_think\nThe Nile is long. Bananas are yellow. Cairo is on the Nile. Snow is cold."
    msgs = _messages(system, ("user", "Which city is on the Nile?"), ("assistant", "Cairo."))
    out, removed = with_selected_system_prompt(msgs, ["Cairo is on the Nile."])
    assert out[0]["content"] == "/no_think\n\nCairo is on the Nile."
    assert removed == len(system) - len(out[0]["content"])
    assert out[1:] == msgs[1:]
    out, _ = with_selected_system_prompt(_messages("Only prose here. And more of it.", ("user", "q"),
                                                   ("assistant", "a")), [])
    assert [m["role"] for m in out] == ["user", "assistant"]  # nothing left of it: no empty system turn


def test_final_answer_is_the_text_after_the_trace():
    assert final_answer("<think>\nlong trace about cats\n</think>\n\nThe answer is 4.") == "The answer is 4."
    assert final_answer("No trace at all.") == "No trace at all."
    assert final_answer("<think>only a trace</think>") == "<think>only a trace</think>"
    assert answer_for_scoring("<think>t</think> A.", "full") == "<think>t</think> A."
    assert answer_for_scoring("<think>t</think> A.", "final") == "A."
