"""derive_example on hand-made rows, including rows read back through pyarrow/pandas."""

import pickle

import pyarrow as pa
import pytest

from raytrain.dataset.conversation_rules import ConversationError, check_conversation
from raytrain.dataset.reasons import Reason
from raytrain.enrich.conversation import (
    QUARANTINE_REASONS,
    Example,
    Quarantined,
    derive_example,
)
from raytrain.enrich.schema import NEMOTRON_V1_SCHEMA


def _m(role, content, tool_calls=None):
    return {"role": role, "content": content, "tool_calls": tool_calls}


def _row(messages, **kw):
    return {"uuid": "u-1", "license": "cc-by-4.0", "category": "chat", "reasoning": "off", "messages": messages, **kw}


CALL = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}
MULTI = [
    _m("system", "You are terse. Oslo is in Norway."),
    _m("user", "Where is Oslo?"),
    _m("assistant", "Norway."),
    _m("user", "Weather there?"),
    _m("assistant", "", [CALL]),
    _m("tool", '{"temp_c": 3}'),
    _m("assistant", "3 °C in Oslo."),
]


def test_multi_turn_fields_and_all_assistant_turns_kept():
    ex = derive_example(_row(MULTI))
    assert isinstance(ex, Example)
    assert ex.context == "You are terse. Oslo is in Norway.\n\nWhere is Oslo?\n\nNorway."
    assert ex.question == "Weather there?"
    assert ex.answer == "3 °C in Oslo."
    assert [m["role"] for m in ex.messages] == [m["role"] for m in MULTI]
    assert [m["content"] for m in ex.messages if m["role"] == "assistant"] == ["Norway.", "", "3 °C in Oslo."]
    assert ex.messages[4]["tool_calls"] == [CALL]
    assert all(m["tool_calls"] == [] for i, m in enumerate(ex.messages) if i != 4)


def test_final_turn_tool_calls_are_rendered_in_answer():
    ex = derive_example(_row([_m("user", "Weather in Oslo?"), _m("assistant", "Checking.", [CALL])]))
    assert ex.answer == 'Checking.\n<tool_call>{"name": "get_weather", "arguments": "{\\"city\\": \\"Oslo\\"}"}</tool_call>'


def test_example_and_quarantined_pickle():  # Spark ships them between Python workers
    ex = derive_example(_row(MULTI))
    assert pickle.loads(pickle.dumps(ex)) == ex
    q = derive_example({"uuid": None})
    assert pickle.loads(pickle.dumps(q)) == q


def test_rows_from_pandas_numpy_arrays_give_the_same_example():
    # pandas turns Arrow list columns into numpy object arrays: what a Spark pandas UDF receives
    row = dict(_row(MULTI), generator="g", version="v1", metadata="")
    pdf = pa.Table.from_pylist([row], schema=NEMOTRON_V1_SCHEMA).to_pandas()
    from_pandas = derive_example(pdf.to_dict("records")[0])
    assert type(pdf.iloc[0]["messages"]).__name__ == "ndarray"
    assert from_pandas == derive_example(row)


@pytest.mark.parametrize(
    ("row", "reason"),
    [
        ({"uuid": None, "messages": [_m("user", "q"), _m("assistant", "a")]}, Reason.MISSING_UUID),
        ({"uuid": "  ", "messages": [_m("user", "q"), _m("assistant", "a")]}, Reason.MISSING_UUID),
        (_row(None), Reason.MISSING_MESSAGES),
        (_row([]), Reason.MISSING_MESSAGES),
        (_row([_m("user", "q"), _m("narrator", "a")]), Reason.BAD_ROLE),
        (_row([_m("assistant", "a"), _m("user", "q")]), Reason.BAD_ROLE),
        (_row([_m("user", "q"), _m("tool", "x"), _m("assistant", "a")]), Reason.BAD_ROLE),
        (_row([_m("user", "q"), _m("system", "late"), _m("assistant", "a")]), Reason.BAD_ROLE),
        (_row(["not a dict"]), Reason.BAD_ROLE),
        (_row([_m("user", "q\ufffd"), _m("assistant", "a")]), Reason.UNDECODABLE_TEXT),
        (_row([_m("user", "q"), _m("assistant", "a\x00b")]), Reason.UNDECODABLE_TEXT),
        (_row([_m("user", "q\ud800"), _m("assistant", "a")]), Reason.UNDECODABLE_TEXT),
        (_row([_m("user", b"\xff\xfe"), _m("assistant", "a")]), Reason.UNDECODABLE_TEXT),
        (_row([_m("user", "q"), _m("assistant", 42)]), Reason.UNDECODABLE_TEXT),
        (_row([_m("user", "q"), _m("assistant", " \n ")]), Reason.EMPTY_ANSWER),
        (_row([_m("user", "q")]), Reason.EMPTY_ANSWER),
        (_row([_m("user", "q"), _m("assistant", "", [CALL]), _m("tool", "x")]), Reason.EMPTY_ANSWER),
        (_row([_m("user", "q"), _m("assistant", "a" * 101)]), Reason.TOO_LONG),
        (_row([_m("user", "q"), _m("assistant", "a")] * 501), Reason.TOO_MANY_TURNS),  # 1,002 turns; before too_long
        (_row([_m("user", "q"), _m("narrator", "a")] * 501), Reason.TOO_MANY_TURNS),  # counted before any message is read
    ],
)
def test_quarantine_reasons(row, reason):
    out = derive_example(row, max_chars=100)
    assert isinstance(out, Quarantined)
    assert out.reason == reason and out.reason in QUARANTINE_REASONS
    assert out.detail


def test_conversation_rules_quarantine_with_their_reason_and_message():
    # the tokenizer's rules (raytrain.dataset.conversation_rules): tool calls on a user turn are a bad_role here
    messages = [_m("system", "s"), _m("user", "q", [CALL]), _m("assistant", "a")]
    with pytest.raises(ConversationError) as caught:
        check_conversation(messages)
    out = derive_example(_row(messages))
    assert out == Quarantined("u-1", Reason.BAD_ROLE, str(caught.value))
    assert out.detail.startswith("message 1 (role 'user'): only assistant messages may carry tool_calls")


def test_roles_are_checked_before_text():
    # a row with an unknown role and undecodable text is a bad_role: the structure is the root cause
    out = derive_example(_row([_m("user", "q\ufffd"), _m("narrator", "a")]))
    assert (out.reason, out.detail.split(":")[0]) == (Reason.BAD_ROLE, "message 1 (role 'narrator')")


def test_tabs_newlines_and_exact_max_chars_are_fine():
    out = derive_example(_row([_m("user", "a\tb\r\n"), _m("assistant", "x" * 95)]), max_chars=100)
    assert isinstance(out, Example)


def test_reasoning_inferred_when_missing():
    on = derive_example(_row([_m("user", "q"), _m("assistant", "<think>hm</think>a")], reasoning=None))
    off = derive_example(_row([_m("user", "q"), _m("assistant", "a")], reasoning="weird"))
    assert (on.reasoning, off.reasoning) == ("on", "off")
    assert derive_example(_row([_m("user", "q"), _m("assistant", "a")], reasoning="ON")).reasoning == "on"


def test_too_many_turns_at_the_limit():
    turns = [_m("user", "q"), _m("assistant", "a")] * 2
    assert isinstance(derive_example(_row(turns), max_turns=4), Example)
    out = derive_example(_row([*turns, _m("user", "q")]), max_turns=4)
    assert out == Quarantined("u-1", Reason.TOO_MANY_TURNS, "5 messages > 4 (the most a conversation may hold)")
