"""One raw preference row -> one PreferenceExample (a prompt, the chosen and the rejected response), or a Quarantined
record saying why not. Pure Python, rows as plain dicts, like ``raytrain.enrich.conversation`` for the fine-tune.

Two layouts are read:
  - nvidia/HelpSteer3's ``preference`` config as the hub publishes it: ``domain``, ``language``, ``context`` (a list
    of ``{role, content}`` turns ending with a user turn; a plain string is taken as one user turn), ``response1``,
    ``response2``, ``overall_preference`` (an integer in [-3, 3]: negative when response1 is better, 0 when they
    are about the same), ``individual_preference`` (per-annotator scores, not read).
  - the generic layout TRL and NeMo RL read: ``prompt`` (turns, or a string), ``chosen`` and ``rejected`` (a string,
    or a list holding one assistant turn), with an optional ``id`` / ``uuid``.

HelpSteer3 rows carry no id, so a pair's id is a hash of its prompt, responses and preference (the same row gets the
same id in every run, which is what dedup and the reports key on).
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from raytrain.dataset.conversation_rules import BAD_ROLE, ConversationError, check_conversation, check_roles, where
from raytrain.dataset.reasons import Reason
from raytrain.enrich.conversation import (
    DEFAULT_MAX_CHARS,
    MAX_TURNS,
    TOO_LONG,
    TOO_LONG_DETAIL,
    TOO_MANY_TURNS,
    TOO_MANY_TURNS_DETAIL,
    Quarantined,
    as_list,
    is_missing,
    message_text,
    normalize_messages,
    short_repr,
)

TIE = Reason.TIE
MISSING_RESPONSE = Reason.MISSING_RESPONSE
BAD_PREFERENCE = Reason.BAD_PREFERENCE
MAX_PREFERENCE = 3
"""HelpSteer3's overall_preference lies in [-MAX_PREFERENCE, MAX_PREFERENCE]."""


@dataclass(frozen=True)
class PreferenceExample:
    """A pair ready for dedup, decontamination and tokenization."""

    pair_id: str
    """The row's id or uuid when it has one, else ``pair-`` and a hash of the prompt, both responses and the
    preference."""
    domain: str
    """HelpSteer3's domain (general, code, multilingual, stem); "" when absent."""
    language: str
    """HelpSteer3's language (e.g. "english", "python"); "" when absent."""
    prompt: tuple[dict, ...]
    """The turns before the responses, normalized as ``Example.messages`` are; the last one is a user turn."""
    chosen: str
    rejected: str
    margin: float
    """How strongly chosen is preferred: ``|overall_preference|`` (1..3); 1.0 for the generic layout."""

    def full_text(self) -> str:
        """The prompt's turns and both responses, blank-line separated: the text dedup and decontam look at."""
        return "\n\n".join([*(m["content"] for m in self.prompt if m["content"]), self.chosen, self.rejected])


def _prompt_turns(value: Any, field: str) -> list:
    """A prompt/context field as a list of raw turns: a plain string is one user turn."""
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    turns = as_list(value)
    if not turns:
        raise ConversationError(Reason.MISSING_MESSAGES, f"{field} is {short_repr(value)}: a preference pair needs "
                                                         "the turns its responses answer.")
    return turns


def _response(value: Any, field: str) -> str:
    """A response as text: a string, or (generic layout, TRL's conversational form) a list of one assistant turn."""
    turns = as_list(value)
    if turns is not None:
        if len(turns) != 1 or not isinstance(turns[0], Mapping) or turns[0].get("role") != "assistant":
            raise ConversationError(BAD_ROLE, f"{field} must be a string or a list of one assistant turn, got "
                                              f"{short_repr(value)}.")
        value = turns[0].get("content")
    text = message_text(value, field)
    if not text.strip():
        raise ConversationError(MISSING_RESPONSE, f"{field} is {short_repr(value)}: both responses need text.")
    return text


def _preference(value: Any) -> int:
    """HelpSteer3's overall_preference as an int in [-3, 3] (an integral float is accepted)."""
    number = value
    if isinstance(value, str):
        try:
            number = float(value)
        except ValueError:
            number = None
    if isinstance(number, bool) or not isinstance(number, int | float) or is_missing(number) \
            or not math.isfinite(number) or number != int(number) or abs(number) > MAX_PREFERENCE:
        raise ConversationError(BAD_PREFERENCE, f"overall_preference is {short_repr(value)}: expected an integer "
                                                f"from -{MAX_PREFERENCE} to {MAX_PREFERENCE}.")
    return int(number)


def _pair_id(row: Mapping[str, Any], prompt: list[dict], first: str, second: str, preference: int) -> str:
    """The row's id, else a hash of what the row says: its prompt, its two responses in the row's order and the
    preference (two annotations of the same responses are two rows)."""
    for name in ("id", "uuid"):
        value = row.get(name)
        if isinstance(value, str) and value.strip():
            return value
    payload = json.dumps([[m["role"], m["content"]] for m in prompt] + [first, second, preference],
                         ensure_ascii=False)
    return "pair-" + hashlib.sha256(payload.encode("utf-8")).hexdigest()[:32]


def _check_prompt(prompt: list[dict], chosen: str) -> None:
    """The prompt's turns in an order the tokenizer takes, ending with the user turn the responses answer."""
    last = len(prompt) - 1
    if prompt[last]["role"] != "user":
        raise ConversationError(BAD_ROLE, f"{where(last, prompt[last]['role'])}: a preference prompt must end with "
                                          "the user turn the two responses answer.")
    check_conversation([*prompt, {"role": "assistant", "content": chosen, "tool_calls": []}])


def derive_pair(row: Mapping[str, Any], *, max_chars: int = DEFAULT_MAX_CHARS,
                max_turns: int = MAX_TURNS) -> PreferenceExample | Quarantined:
    """Turn one raw row of either layout into a PreferenceExample or a Quarantined.

    Checks, in order: the prompt's turns (missing_messages, too_many_turns, bad_role, undecodable_text, and the
    conversation rules of the fine-tune with the chosen response as the last turn), each response
    (missing_response, undecodable_text), the preference (bad_preference out of range or not a number, tie for 0),
    then too_long (all text of the pair above ``max_chars`` characters)."""
    helpsteer = "response1" in row or "overall_preference" in row
    prompt_field = "context" if helpsteer else "prompt"
    pair_id: str | None = None
    try:
        turns = _prompt_turns(row.get(prompt_field), prompt_field)
        if len(turns) > max_turns:
            raise ConversationError(TOO_MANY_TURNS, TOO_MANY_TURNS_DETAIL.format(turns=len(turns),
                                                                                 max_turns=max_turns))
        check_roles(turns)
        prompt = normalize_messages(turns)
        if helpsteer:
            first, second = _response(row.get("response1"), "response1"), _response(row.get("response2"), "response2")
            preference = _preference(row.get("overall_preference"))
            chosen, rejected = (first, second) if preference < 0 else (second, first)
        else:
            first, second = _response(row.get("chosen"), "chosen"), _response(row.get("rejected"), "rejected")
            preference = -1  # the generic layout states the order: chosen is "response 1", preferred
            chosen, rejected = first, second
        pair_id = _pair_id(row, prompt, first, second, preference)
        _check_prompt(prompt, chosen)
        if preference == 0:
            raise ConversationError(TIE, "overall_preference is 0: the responses are about the same, so neither is "
                                         "trained as the chosen one.")
        num_chars = sum(len(m["content"]) for m in prompt) + len(chosen) + len(rejected)
        if num_chars > max_chars:
            raise ConversationError(TOO_LONG, TOO_LONG_DETAIL.format(num_chars=num_chars, max_chars=max_chars))
    except ConversationError as r:
        return Quarantined(pair_id or _fallback_id(row), r.reason, r.detail)
    return PreferenceExample(pair_id=pair_id, domain=_plain(row.get("domain")), language=_plain(row.get("language")),
                             prompt=tuple(prompt), chosen=chosen, rejected=rejected,
                             margin=float(abs(preference)))


def _fallback_id(row: Mapping[str, Any]) -> str:
    """An id for a row quarantined before its turns could be read: its own id, else a hash of its repr."""
    for name in ("id", "uuid"):
        value = row.get(name)
        if isinstance(value, str) and value.strip():
            return value
    return "pair-" + hashlib.sha256(repr(sorted(row.items(), key=lambda kv: str(kv[0]))).encode(
        "utf-8", "backslashreplace")).hexdigest()[:32]


def _plain(value: Any) -> str:
    return value if isinstance(value, str) else ""
