"""The shared conversation rules on planted conversations: one broken rule each, its reason and the message named."""

import re

import pytest

from raytrain.dataset import conversation_rules as rules
from raytrain.errors import RaytrainError


def m(role, content, tool_calls=None):
    return {"role": role, "content": content, "tool_calls": tool_calls}


CALL = {"id": "abcDEF123", "type": "function", "function": {"name": "get_weather", "arguments": "{}"}}


@pytest.mark.parametrize(
    ("conversation", "reason", "index", "role", "says"),
    [
        ([m("user", "q"), m("narrator", "a")], rules.BAD_ROLE, 1, "narrator", "role must be one of"),
        ([m("user", "q"), {"content": "a"}], rules.BAD_ROLE, 1, None, "role must be one of"),
        ([m("system", "s"), m("user", "q"), m("system", "late"), m("assistant", "a")], rules.BAD_ROLE, 2, "system",
         "after the conversation started"),
        ([m("system", "s"), m("assistant", "a"), m("user", "q"), m("assistant", "b")], rules.BAD_ROLE, 1, "assistant",
         "before any user turn"),
        ([m("tool", "x"), m("user", "q"), m("assistant", "a")], rules.BAD_ROLE, 0, "tool", "before any user turn"),
        ([m("user", "q"), m("tool", "x"), m("assistant", "a")], rules.BAD_ROLE, 1, "tool",
         "must follow an assistant tool"),
        ([m("user", "q"), m("assistant", "a"), m("tool", "x"), m("assistant", "b")], rules.BAD_ROLE, 2, "tool",
         "must follow an assistant tool"),
        ([m("user", "q", [CALL]), m("assistant", "a")], rules.BAD_ROLE, 0, "user", "only assistant messages"),
        ([m("user", "q"), m("assistant", "a", {"not": "a list"})], rules.BAD_ROLE, 1, "assistant", "not a list"),
        ([m("user", "q"), m("assistant", "", [{"id": "x"}])], rules.BAD_ROLE, 1, "assistant", "'function' mapping"),
        ([m("user", "q"), m("assistant", 42)], rules.UNDECODABLE_TEXT, 1, "assistant", "content must be a string"),
        ([m("user", "q"), m("assistant", "a"), m("user", "again")], rules.EMPTY_ANSWER, 2, "user",
         "end with an assistant"),
        ([m("user", "q"), m("assistant", "", [CALL]), m("tool", "x")], rules.EMPTY_ANSWER, 2, "tool",
         "end with an assistant"),
        ([m("user", "q"), m("assistant", " \n ")], rules.EMPTY_ANSWER, 1, "assistant", "neither text"),
        ([m("user", "q"), m("assistant", None)], rules.EMPTY_ANSWER, 1, "assistant", "neither text"),
        ([m("user", "q"), m("assistant", ""), m("user", "q2"), m("assistant", "b")], rules.EMPTY_ANSWER, 1, "assistant",
         "neither text"),
    ],
)
def test_each_rule_gives_its_reason_and_names_the_message(conversation, reason, index, role, says):
    with pytest.raises(rules.ConversationError) as caught:
        rules.check_conversation(conversation)
    assert caught.value.reason == reason
    assert caught.value.detail == str(caught.value)
    assert str(caught.value).startswith(f"message {index} (role {role!r}): ")
    assert says in str(caught.value)


def test_a_message_that_is_not_a_mapping_is_named_by_index():
    with pytest.raises(rules.ConversationError, match=re.escape("message 1 is a str, not a mapping")) as caught:
        rules.check_conversation([m("user", "q"), "not a dict", m("assistant", "a")])
    assert caught.value.reason == rules.BAD_ROLE


@pytest.mark.parametrize("conversation", [[], None, "user: hi"])
def test_no_messages(conversation):
    with pytest.raises(rules.ConversationError, match="non-empty list") as caught:
        rules.check_conversation(conversation)
    assert caught.value.reason == rules.MISSING_MESSAGES


def test_structure_comes_before_the_final_turn():
    # wrong order *and* no final assistant turn: the order is the root cause, so bad_role
    with pytest.raises(rules.ConversationError) as caught:
        rules.check_conversation([m("user", "q"), m("system", "late"), m("user", "q2")])
    assert caught.value.reason == rules.BAD_ROLE


def test_check_roles_alone_ignores_order_and_text():
    rules.check_roles([m("assistant", 42), m("tool", None)])
    with pytest.raises(rules.ConversationError, match=r"message 0 \(role 'robot'\)"):
        rules.check_roles([m("robot", "beep")])


@pytest.mark.parametrize(
    "conversation",
    [
        [m("user", "q"), m("assistant", "a")],
        [m("system", "s1"), m("system", "s2"), m("user", "q"), m("assistant", "a")],
        [m("user", "q"), m("user", "q2"), m("assistant", "a"), m("assistant", "b")],
        [m("user", "q"), m("assistant", None, [CALL, CALL]), m("tool", "1"), m("tool", "2"), m("assistant", "ok")],
        [m("user", "q"), m("assistant", "calling", [CALL])],  # text with calls: only v3's tokenizer refuses it
        [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}],  # tool_calls may be absent
        [m("user", "q", []), m("assistant", "a", ())],  # no calls is no calls, whatever holds them
    ],
)
def test_valid_conversations_pass(conversation):
    rules.check_conversation(conversation)


def test_the_error_is_a_raytrain_error():
    assert issubclass(rules.ConversationError, RaytrainError)
