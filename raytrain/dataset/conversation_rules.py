"""The structure a training conversation must have, checked in one place for the enrichment and the tokenizer.

In:  a conversation in the Nemotron-Post-Training-Dataset-v1 message shape, a sequence of mappings
     ``{"role", "content": str | None, "tool_calls": [{"id", "type", "function": {"name", "arguments"}}] | None}``.
Out: None, or ``ConversationError`` with a quarantine ``reason`` (bad_role, empty_answer, undecodable_text,
     missing_messages: the vocabulary of raytrain.enrich.conversation) and a message naming the offending message's
     index and role. The enrichment (``enrich.conversation.derive_example``) quarantines the row with that reason
     and message; the tokenizer (``dataset.tokenize``) raises the error as it is (a RaytrainError).

The rules: rule 1 over every message first, then rules 2-6 message by message, then 7 and 8; the first failure
wins:
  1. Every message is a mapping whose role is one of ROLES (bad_role).
  2. Content is a str or None (undecodable_text); tool_calls are None or a list of mappings, each with a
     ``function`` mapping whose ``name`` is a str (bad_role).
  3. Only assistant turns carry tool calls (bad_role): mistral-common's user, system and tool messages have no place
     for them, so they would be dropped without a word.
  4. System turns only lead (bad_role): mistral-common folds every system message into one system prompt that v1-v3
     put into the first or last user turn, so a later system turn would not be trained where it stands (and one
     after an assistant turn it rejects outright).
  5. The first turn after the system turns is a user turn (bad_role). mistral-common would encode an opening
     assistant turn, but an answer to no question is not a training example: the enrichment quarantines it,
     and the tokenizer refuses it too, so the two agree.
  6. A tool turn follows an assistant turn that makes tool calls, or another tool turn (bad_role): mistral-common
     rejects a tool result after a user turn, and v3 one after an assistant turn without calls ("Not the same number
     of function calls and responses").
  7. The conversation ends with an assistant turn (empty_answer): finetuning mode rejects any other last role.
  8. Every assistant turn has text (more than white space) or tool calls (empty_answer): mistral-common rejects an
     assistant message with neither; white space alone it accepts, but it would train on nothing.
A conversation that breaks one of rules 1-6 and one of 7-8 is a bad_role, as the enrichment has always said.

Rules of one tokenizer stay in raytrain.dataset.tokenize on top of these: v3 refuses an assistant turn with both
text and tool calls, v3 tool names, and tool results paired with pending calls. No imports beyond raytrain.errors:
the enrichment's first pass uses this without loading mistral-common.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from raytrain.dataset.reasons import Reason
from raytrain.errors import RaytrainError

ROLES = ("system", "user", "assistant", "tool")
"""The message roles of the dataset (and of the conversations the tokenizer takes)."""

# Quarantine reasons these rules give (raytrain.dataset.reasons lists them all).
MISSING_MESSAGES = Reason.MISSING_MESSAGES
BAD_ROLE = Reason.BAD_ROLE
UNDECODABLE_TEXT = Reason.UNDECODABLE_TEXT
EMPTY_ANSWER = Reason.EMPTY_ANSWER


class ConversationError(RaytrainError):
    """A conversation that breaks a rule: ``reason`` is its quarantine reason, ``detail`` the message."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(detail)
        self.reason = reason
        self.detail = detail


def where(index: int, role: object) -> str:
    """How every message about one message starts: ``message 3 (role 'tool')``."""
    return f"message {index} (role {role!r})"


def check_roles(messages: Sequence[Any]) -> None:
    """Rule 1 alone: every message a mapping with a known role (raises ConversationError, reason bad_role).

    The enrichment runs it before it decodes any text, so a malformed row is a bad_role whatever its text holds."""
    for index, message in enumerate(messages):
        if not isinstance(message, Mapping):
            raise ConversationError(
                BAD_ROLE, f"message {index} is a {type(message).__name__}, not a mapping with 'role' and 'content'."
            )
        role = message.get("role")
        if not isinstance(role, str) or role not in ROLES:
            raise ConversationError(BAD_ROLE, f"{where(index, role)}: role must be one of {list(ROLES)}.")


def _tool_calls(message: Mapping, index: int) -> list | tuple:
    """Rule 2 for tool calls: the message's calls as a list (None -> [])."""
    calls = message.get("tool_calls")
    if calls is None:
        return []
    role = message["role"]
    if not isinstance(calls, list | tuple):
        raise ConversationError(BAD_ROLE, f"{where(index, role)}: tool_calls is a {type(calls).__name__}, not a list.")
    for call_index, call in enumerate(calls):
        function = call.get("function") if isinstance(call, Mapping) else None
        if not isinstance(function, Mapping) or not isinstance(function.get("name"), str):
            raise ConversationError(
                BAD_ROLE, f"{where(index, role)}: tool_calls[{call_index}] needs a 'function' mapping with a 'name'."
            )
    return calls


def check_conversation(messages: Sequence[Any]) -> None:
    """Check every rule of the module docstring; raise ConversationError for the first one broken."""
    if isinstance(messages, str | bytes) or not isinstance(messages, Sequence) or len(messages) == 0:
        raise ConversationError(MISSING_MESSAGES, "conversation must be a non-empty list of message dicts.")
    check_roles(messages)
    seen_user, seen_other = False, False
    for index, message in enumerate(messages):
        role, content = message["role"], message.get("content")
        if content is not None and not isinstance(content, str):
            raise ConversationError(UNDECODABLE_TEXT, f"{where(index, role)}: content must be a string or None, got "
                                                      f"{type(content).__name__}.")
        if _tool_calls(message, index) and role != "assistant":
            raise ConversationError(BAD_ROLE, f"{where(index, role)}: only assistant messages may carry tool_calls.")
        if role == "system":
            if seen_other:
                raise ConversationError(BAD_ROLE, f"{where(index, role)}: a system turn after the conversation "
                                                  "started.")
            continue
        seen_other = True
        if role == "user":
            seen_user = True
        elif not seen_user:
            raise ConversationError(BAD_ROLE, f"{where(index, role)}: comes before any user turn.")
        elif role == "tool":
            previous = messages[index - 1]
            if previous["role"] != "tool" and not (previous["role"] == "assistant" and previous.get("tool_calls")):
                raise ConversationError(
                    BAD_ROLE, f"{where(index, role)}: a tool result must follow an assistant tool call or another "
                    "tool result."
                )
    last = len(messages) - 1
    if messages[last]["role"] != "assistant":
        raise ConversationError(
            EMPTY_ANSWER, f"{where(last, messages[last]['role'])}: a training conversation must end with an "
            "assistant turn."
        )
    for index, message in enumerate(messages):
        content = message.get("content")
        if message["role"] == "assistant" and not (content and content.strip()) and not message.get("tool_calls"):
            raise ConversationError(
                EMPTY_ANSWER, f"{where(index, 'assistant')}: assistant turn has neither text (white space does not "
                "count) nor tool_calls."
            )
