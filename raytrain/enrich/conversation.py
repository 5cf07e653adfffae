"""One raw Nemotron v1 row -> one training Example, or a Quarantined record saying why not.

Pure Python: rows are plain dicts as ``pandas.DataFrame.to_dict("records")`` or ``pyarrow.Table.to_pylist()``
give them (list columns may arrive as numpy object arrays from pandas; both are accepted). Every row comes out
as exactly one of the two, so nothing is dropped silently; the Spark job writes quarantined rows next to the
examples with their reason.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from raytrain.dataset.conversation_rules import (
    BAD_ROLE,
    MISSING_MESSAGES,
    UNDECODABLE_TEXT,
    ConversationError,
    check_conversation,
    check_roles,
)
from raytrain.dataset.reasons import DERIVE_REASONS, Reason

# Quarantine reasons deriving a conversation gives (raytrain.dataset.reasons lists them all, so reports count them).
MISSING_UUID = Reason.MISSING_UUID
TOO_LONG = Reason.TOO_LONG
TOO_MANY_TURNS = Reason.TOO_MANY_TURNS
QUARANTINE_REASONS: tuple[str, ...] = DERIVE_REASONS

# Matches EnrichConfig.max_chars: a guard against pathological rows, far above real ones (~40-48 KB).
DEFAULT_MAX_CHARS = 1_000_000
# A guard against pathological rows too: real conversations hold a few to a few dozen turns, and every turn costs
# the tokenizer's framing tokens, so a thousand turns cannot fit any sequence length the project trains at.
MAX_TURNS = 1_000
# The two details' words, shared with the same checks in Spark (raytrain.enrich.row_guard).
TOO_LONG_DETAIL = "{num_chars} characters > max_chars={max_chars}"
TOO_MANY_TURNS_DETAIL = "{turns} messages > {max_turns} (the most a conversation may hold)"

# Text that cannot have come from a clean UTF-8 decode: lone surrogates, the replacement character U+FFFD
# (a decoder already gave up), and control characters other than tab/newline/carriage return (C0, DEL, C1).
_BAD_TEXT = re.compile("[\ud800-\udfff\ufffd\x00-\x08\x0b\x0c\x0e-\x1f\x7f-\x9f]")


@dataclass(frozen=True)
class Example:
    """A row ready for relevance scoring and tokenization."""

    uuid: str
    """The source row's uuid."""
    category: str
    """The source row's category (e.g. "math"); "" when absent."""
    license: str
    """The source row's license string, as given."""
    reasoning: str
    """"on" or "off"."""
    context: str
    """System prompt(s) and every turn before the last user turn, as text (turns separated by blank lines)."""
    question: str
    """Content of the last user turn."""
    answer: str
    """The final assistant turn: content, then its tool calls rendered one per line."""
    messages: tuple[dict, ...] = field(repr=False)
    """The whole training conversation: {"role", "content", "tool_calls"} dicts, roles system/user/assistant/
    tool, content always a str, tool_calls always a list of {"id", "type", "function": {"name", "arguments"}}.
    Every assistant turn is kept (the tokenizer masks by role, so all of them train)."""

    def full_text(self) -> str:
        """Every turn's text (tool calls rendered), blank-line separated: the text dedup and decontam look at."""
        return "\n\n".join(render_message_text(m) for m in self.messages)


@dataclass(frozen=True)
class Quarantined:
    """A row that cannot become an Example."""

    uuid: str | None
    """The row's uuid, None when it has none (reason missing_uuid)."""
    reason: str
    """One of QUARANTINE_REASONS."""
    detail: str
    """Human-readable specifics: which message, which character, how long."""


def is_missing(value: Any) -> bool:
    return value is None or (isinstance(value, float) and math.isnan(value))


def as_list(value: Any) -> list | None:
    """Lists, tuples and numpy arrays (what pandas gives for Arrow list columns) as a list; None otherwise."""
    if is_missing(value):
        return None
    if isinstance(value, list | tuple):
        return list(value)
    if hasattr(value, "tolist") and hasattr(value, "ndim"):  # numpy array without importing numpy
        return list(value) if value.ndim == 1 else None
    return None


def message_text(value: Any, where: str) -> str:
    """A message string: None -> "", bytes decoded strictly, anything else not a str is undecodable."""
    if is_missing(value):
        return ""
    if isinstance(value, bytes):
        try:
            value = value.decode("utf-8")
        except UnicodeDecodeError as e:
            raise ConversationError(UNDECODABLE_TEXT,
                                    f"{where} is not valid UTF-8 ({e.reason} at byte {e.start})") from e
    if not isinstance(value, str):
        raise ConversationError(UNDECODABLE_TEXT, f"{where} is a {type(value).__name__}, not text")
    bad = _BAD_TEXT.search(value)
    if bad:
        raise ConversationError(UNDECODABLE_TEXT, f"{where} contains U+{ord(bad.group()):04X} at offset {bad.start()}")
    return value


def _normalize_tool_calls(value: Any, where: str) -> list[dict]:
    calls = as_list(value)
    if calls is None:
        if is_missing(value):
            return []
        raise ConversationError(BAD_ROLE, f"{where}.tool_calls is a {type(value).__name__}, not a list")
    out = []
    for j, call in enumerate(calls):
        if not isinstance(call, Mapping):
            raise ConversationError(BAD_ROLE, f"{where}.tool_calls[{j}] is not a mapping")
        fn = call.get("function")
        fn = fn if isinstance(fn, Mapping) else {}
        args = fn.get("arguments")
        if not is_missing(args) and not isinstance(args, str | bytes):
            args = json.dumps(args, sort_keys=True, ensure_ascii=False)  # some exports keep arguments as objects
        out.append(
            {
                "id": message_text(call.get("id"), f"{where}.tool_calls[{j}].id"),
                "type": message_text(call.get("type"), f"{where}.tool_calls[{j}].type") or "function",
                "function": {
                    "name": message_text(fn.get("name"), f"{where}.tool_calls[{j}].function.name"),
                    "arguments": message_text(args, f"{where}.tool_calls[{j}].function.arguments"),
                },
            }
        )
    return out


def render_tool_call(call: dict) -> str:
    """One tool call as a line of text: ``<tool_call>{"name": ..., "arguments": ...}</tool_call>``."""
    fn = call["function"]
    return "<tool_call>" + json.dumps({"name": fn["name"], "arguments": fn["arguments"]}, ensure_ascii=False) \
        + "</tool_call>"


def render_message_text(message: dict) -> str:
    """A normalized message's content followed by its rendered tool calls, one per line."""
    parts = [message["content"]] if message["content"] else []
    parts.extend(render_tool_call(c) for c in message["tool_calls"])
    return "\n".join(parts)


def normalize_messages(raw: list) -> list[dict]:
    """Roles already checked by check_roles; content and tool calls made uniform (see Example.messages)."""
    messages = []
    for i, m in enumerate(raw):
        where = f"messages[{i}]"
        messages.append(
            {
                "role": m["role"],
                "content": message_text(m.get("content"), f"{where}.content"),
                "tool_calls": _normalize_tool_calls(m.get("tool_calls"), where),
            }
        )
    return messages


def derive_example(row: Mapping[str, Any], *, max_chars: int = DEFAULT_MAX_CHARS,
                   max_turns: int = MAX_TURNS) -> Example | Quarantined:
    """Turn one raw row (uuid, license, category, reasoning, messages, ...) into an Example or a Quarantined.

    Checks, in order: missing_uuid, missing_messages, too_many_turns (more than ``max_turns`` messages), bad_role
    (unknown role or malformed message), undecodable_text, then the conversation rules the tokenizer applies too (raytrain.dataset.conversation_rules:
    bad_role for wrong order, a misplaced tool turn or tool calls off an assistant turn; empty_answer for no final
    assistant turn, or an assistant turn with neither text nor tool calls), then too_long (all message text and
    tool-call arguments together above ``max_chars`` characters).
    """
    uuid = row.get("uuid")
    if is_missing(uuid) or not isinstance(uuid, str) or not uuid.strip():
        return Quarantined(None, MISSING_UUID, f"uuid is {uuid!r}")
    if _BAD_TEXT.search(uuid):  # an id that cannot be written as UTF-8 cannot be recorded either: keep it escaped
        return Quarantined(uuid.encode("utf-8", "backslashreplace").decode("ascii", "replace"), UNDECODABLE_TEXT,
                           "uuid holds surrogate or control characters")
    for name in ("category", "license", "reasoning"):
        value = row.get(name)
        if isinstance(value, str) and _BAD_TEXT.search(value):
            return Quarantined(uuid, UNDECODABLE_TEXT, f"{name} holds surrogate or control characters")
    raw = as_list(row.get("messages"))
    if not raw:
        return Quarantined(uuid, MISSING_MESSAGES, f"messages is {short_repr(row.get('messages'))}")
    if len(raw) > max_turns:  # before any per-message work: its cost grows with the turns
        return Quarantined(uuid, TOO_MANY_TURNS, TOO_MANY_TURNS_DETAIL.format(turns=len(raw), max_turns=max_turns))
    try:
        # bad_role before undecodable_text: a role check needs no text, and wrong structure is the root cause
        check_roles(raw)
        messages = normalize_messages(raw)
        check_conversation(messages)  # the rules the tokenizer checks too: order, tool turns, the final turn
        num_chars = sum(len(m["content"]) + sum(len(c["function"]["arguments"]) for c in m["tool_calls"])
                        for m in messages)
        if num_chars > max_chars:
            raise ConversationError(TOO_LONG, TOO_LONG_DETAIL.format(num_chars=num_chars, max_chars=max_chars))
    except ConversationError as r:
        return Quarantined(uuid, r.reason, r.detail)

    last_user = max(i for i, m in enumerate(messages) if m["role"] == "user")
    answer = render_message_text(messages[-1])
    reasoning = row.get("reasoning")
    reasoning = reasoning.strip().lower() if isinstance(reasoning, str) else ""
    if reasoning not in ("on", "off"):
        # Absent or unknown: infer from the answer itself (reasoning traces are wrapped in <think>).
        reasoning = "on" if "<think>" in answer else "off"
    return Example(
        uuid=uuid,
        category=_plain(row.get("category")),
        license=_plain(row.get("license")),
        reasoning=reasoning,
        context="\n\n".join(t for t in (render_message_text(m) for m in messages[:last_user]) if t),
        question=messages[last_user]["content"],
        answer=answer,
        messages=tuple(messages),
    )


def _plain(value: Any) -> str:
    return value if isinstance(value, str) else ""


def short_repr(value: Any) -> str:
    r = repr(value)
    return r if len(r) <= 60 else r[:57] + "..."
