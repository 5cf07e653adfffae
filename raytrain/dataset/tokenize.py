"""Chat conversations -> Mistral token ids plus a loss mask, formatted by mistral-common itself.

In:  a conversation in the Nemotron-Post-Training-Dataset-v1 message shape, a list of dicts
     ``{"role": "system"|"user"|"assistant"|"tool", "content": str | None,
        "tool_calls": [{"id", "type", "function": {"name", "arguments"}}] | None}``
     (tool messages may carry ``tool_call_id``; without it they answer the pending calls of the
     previous assistant message in order).
Out: ``TokenizedConversation(input_ids, loss_mask)`` where ``input_ids`` is exactly what
     ``MistralTokenizer.encode_chat_completion`` produces for the conversation (checked on every call)
     and ``loss_mask`` is True on assistant-generated tokens only: assistant text, the ``[TOOL_CALLS]``
     token and its JSON, and the EOS closing each assistant turn.

How the assistant spans are found: mistral-common's ``InstructTokenizer.encode_instruct`` encodes the
normalised request message by message and concatenates. We run the same per-message encoders on the same
normalised request and keep the boundaries. Diffing encodings of conversation prefixes does not work for
Mistral formats: v2/v3 put the system prompt inside the *last* user turn, so a prefix encodes differently.

Tokenizer versions (files shipped in ``mistral_common/data/``, no network):
  - "v1": ``tokenizer.model.v1`` (Mistral-7B-v0.1, vocab 32000). v1 has no tool control tokens and
    mistral-common refuses tool messages for it, so tool calls and results are rendered as *text* with the
    same JSON payloads v3 uses: an assistant tool call becomes the assistant text
    ``[TOOL_CALLS] [{"name": ..., "arguments": ..., "id": ...}]`` (trainable), a tool result becomes a user
    turn ``[TOOL_RESULTS] {"content": ..., "call_id": ...} [/TOOL_RESULTS]`` (not trainable). The markers
    are ordinary text pieces there, not control tokens.
  - "v3": ``mistral_instruct_tokenizer_240323.model.v3`` (Mistral-7B-Instruct-v0.3, vocab 32768) with
    ``[TOOL_CALLS]`` / ``[TOOL_RESULTS]`` control tokens. v3 requires tool-call ids matching
    ``^[a-zA-Z0-9]{9}$``: other ids (e.g. ``call_abc123...``) and missing ids are mapped to the first nine
    hex digits of their SHA-1, the same mapping on the call and on its result, so pairs stay paired.
    v3 cannot hold text and tool calls in one assistant turn, and mistral-common merges consecutive assistant
    turns back into one, so such a turn cannot be split either: ``fit_tool_call_turns`` drops the text (policy
    "drop_text", counted) or leaves the turn for the caller to quarantine (policy "quarantine").
"""

from __future__ import annotations

import functools
import hashlib
import json
import re
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mistral_common
from mistral_common.exceptions import MistralCommonException
from mistral_common.protocol.instruct.messages import (
    AssistantMessage,
    SystemMessage,
    ToolMessage,
    UserMessage,
)
from mistral_common.protocol.instruct.normalize import get_normalizer
from mistral_common.protocol.instruct.request import ChatCompletionRequest
from mistral_common.protocol.instruct.tool_calls import FunctionCall, ToolCall
from mistral_common.protocol.instruct.validator import ValidationMode, get_validator
from mistral_common.tokens.tokenizers.base import TokenizerVersion
from mistral_common.tokens.tokenizers.mistral import MistralTokenizer
from pydantic import ValidationError

from raytrain.config import TEXT_WITH_TOOL_CALLS_POLICIES
from raytrain.dataset.conversation_rules import check_conversation, where
from raytrain.errors import RaytrainError

TOKENIZER_FILES: dict[str, str] = {
    "v1": "tokenizer.model.v1",
    "v3": "mistral_instruct_tokenizer_240323.model.v3",
}
"""Tokenizer version name -> file name inside ``mistral_common/data/``."""

_V3_CALL_ID = re.compile(r"^[a-zA-Z0-9]{9}$")
_TOOL_NAME = re.compile(r"^[a-zA-Z0-9_-]{1,64}$")


@dataclass(frozen=True)
class TokenizedConversation:
    """One conversation as token ids with a per-token training mask."""

    input_ids: list[int]
    """Token ids, starting with BOS, identical to mistral-common's encoding of the conversation."""
    loss_mask: list[bool]
    """Same length as ``input_ids``; True where the token was produced by the assistant."""

    def __post_init__(self) -> None:
        if len(self.input_ids) != len(self.loss_mask):
            raise RaytrainError(
                f"TokenizedConversation: input_ids has {len(self.input_ids)} tokens but loss_mask has "
                f"{len(self.loss_mask)}; they must be the same length."
            )

    @property
    def num_tokens(self) -> int:
        return len(self.input_ids)


@dataclass(frozen=True)
class TokenizedPair:
    """One preference pair as token ids: the prompt once, each response as its continuation (``tokenize_pair``)."""

    pair_id: str
    prompt: Sequence[int]
    chosen: Sequence[int]
    rejected: Sequence[int]

    @property
    def num_tokens(self) -> int:
        """Tokens the pair takes in a pack: the prompt twice and both responses."""
        return 2 * len(self.prompt) + len(self.chosen) + len(self.rejected)


def load_tokenizer(version: str = "v3") -> MistralTokenizer:
    """Load the real Mistral tokenizer ``version`` ("v1" or "v3") from mistral-common's shipped files.

    The tokenizer validates in finetuning mode (a conversation may end with an assistant turn).
    Cached per process: Ray Data workers load it once, not once per batch.
    """
    return _load_tokenizer(version)


def tokenizer_file(version: str) -> Path:
    """The SentencePiece file of tokenizer ``version`` shipped inside mistral-common (no network)."""
    if version not in TOKENIZER_FILES:
        raise RaytrainError(
            f"tokenizer version {version!r} is not supported; choose one of {sorted(TOKENIZER_FILES)} "
            "(v1 = Mistral-7B-v0.1, v3 = Mistral-7B-Instruct-v0.3)."
        )
    path = Path(mistral_common.__file__).parent / "data" / TOKENIZER_FILES[version]
    if not path.is_file():
        raise RaytrainError(f"tokenizer file {path} is missing; reinstall mistral-common==1.13.1.")
    return path


@functools.cache  # keyed on the version string, so load_tokenizer() and load_tokenizer("v3") share one
def _load_tokenizer(version: str) -> MistralTokenizer:
    path = tokenizer_file(version)
    try:
        return MistralTokenizer.from_file(str(path), mode=ValidationMode.finetuning)
    except ImportError as exc:  # sentencepiece is an optional extra of mistral-common
        raise RaytrainError(
            f"cannot load {path.name}: {exc}. Fix: pip install 'mistral-common[sentencepiece]'."
        ) from exc


@dataclass(frozen=True)
class FittedConversation:
    """A conversation made encodable for one tokenizer version, and what was changed to get there."""

    messages: list[dict[str, Any]]
    dropped_text_turns: int
    """Assistant turns whose text was dropped because they also carry tool calls (v3, policy "drop_text")."""
    dropped_text_chars: int


def fit_tool_call_turns(messages: Sequence[dict[str, Any]], version: str, policy: str = "drop_text"
                        ) -> FittedConversation:
    """Make assistant turns with both text and tool calls encodable by tokenizer ``version`` ("v1" | "v3").

    v1 renders tool calls as text, so text and calls stay together: the messages come back unchanged. v3 allows
    one or the other per assistant turn: with ``policy`` "drop_text" the text of such a turn is dropped (the calls
    stay trainable) and counted; with "quarantine" the messages come back unchanged and ``tokenize_conversation``
    refuses them, so the caller quarantines the row. Messages are not modified in place.
    """
    if policy not in TEXT_WITH_TOOL_CALLS_POLICIES:
        raise RaytrainError(f"text_with_tool_calls policy {policy!r}: choose one of "
                            f"{list(TEXT_WITH_TOOL_CALLS_POLICIES)}.")
    if version != "v3" or policy == "quarantine":
        return FittedConversation(list(messages), 0, 0)
    fitted, turns, chars = [], 0, 0
    for message in messages:
        content = message.get("content") if isinstance(message, dict) else None
        if (isinstance(message, dict) and message.get("role") == "assistant" and message.get("tool_calls")
                and isinstance(content, str) and content.strip()):
            message = {**message, "content": ""}
            turns, chars = turns + 1, chars + len(content)
        fitted.append(message)
    return FittedConversation(fitted, turns, chars)


def _check_conversation(messages: Sequence[dict[str, Any]], text_tools: bool = False) -> None:
    """The shared conversation rules (raytrain.dataset.conversation_rules, raising its ConversationError), then
    v3's own: an assistant turn carries text or tool calls, not both.

    ``text_tools``: tool calls are rendered as text (v1), so an assistant turn may carry text and calls."""
    check_conversation(messages)
    if text_tools:
        return
    for index, message in enumerate(messages):
        content = message.get("content")
        if message["role"] == "assistant" and message.get("tool_calls") and content and content.strip():
            raise RaytrainError(
                f"{where(index, 'assistant')}: has both text content and tool_calls; the v3 format allows one "
                "or the other. Fix: dataset.text_with_tool_calls=drop_text (fit_tool_call_turns), or drop "
                "the text upstream."
            )


def _v3_call_id(raw_id: object, message_index: int, call_index: int) -> str:
    """A tool-call id v3 accepts: the id itself when it is 9 alphanumerics, else a stable 9-hex digest."""
    if isinstance(raw_id, str) and _V3_CALL_ID.match(raw_id):
        return raw_id
    key = raw_id if isinstance(raw_id, str) and raw_id and raw_id != "null" else f"#{message_index}.{call_index}"
    return hashlib.sha1(key.encode("utf-8")).hexdigest()[:9]


def _arguments_json(arguments: object) -> str:
    if arguments is None:
        return "{}"
    return arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)


def _json_or_text(text: str) -> Any:
    # Same rule as mistral-common's _parse_json_content: JSON payloads are embedded as JSON, others as strings.
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def _to_mistral_messages(messages: Sequence[dict[str, Any]], version: TokenizerVersion) -> list[Any]:
    """Nemotron-shaped dicts -> mistral-common message objects (tool turns rendered as text for v1)."""
    text_tools = version == TokenizerVersion.v1
    converted: list[Any] = []
    pending_call_ids: deque[str] = deque()  # ids of the latest assistant's calls not yet answered
    for index, message in enumerate(messages):
        role, content = message["role"], message.get("content") or ""
        try:
            if role == "system":
                converted.append(SystemMessage(content=content))
            elif role == "user":
                converted.append(UserMessage(content=content))
                pending_call_ids.clear()
            elif role == "assistant" and message.get("tool_calls"):
                calls = []
                for call_index, call in enumerate(message["tool_calls"]):
                    name = call["function"]["name"]
                    if not text_tools and not _TOOL_NAME.match(name):
                        raise RaytrainError(
                            f"{where(index, role)}: tool name {name!r} must match ^[a-zA-Z0-9_-]{{1,64}}$ for v3."
                        )
                    calls.append(
                        ToolCall(
                            id=_v3_call_id(call.get("id"), index, call_index),
                            function=FunctionCall(
                                name=name, arguments=_arguments_json(call["function"].get("arguments"))
                            ),
                        )
                    )
                pending_call_ids = deque(call.id for call in calls)
                if text_tools:
                    payload = [
                        {"name": c.function.name, "arguments": _json_or_text(c.function.arguments), "id": c.id}
                        for c in calls
                    ]
                    calls_text = "[TOOL_CALLS] " + json.dumps(payload, ensure_ascii=False)
                    text = content.strip()
                    converted.append(AssistantMessage(content=f"{text}\n\n{calls_text}" if text else calls_text))
                else:
                    converted.append(AssistantMessage(tool_calls=calls))
            elif role == "assistant":
                converted.append(AssistantMessage(content=content))
                pending_call_ids.clear()
            else:  # tool
                raw_id = message.get("tool_call_id")
                if raw_id:
                    call_id = _v3_call_id(raw_id, -1, -1)
                    if call_id in pending_call_ids:
                        pending_call_ids.remove(call_id)
                elif pending_call_ids:
                    call_id = pending_call_ids.popleft()
                else:
                    raise RaytrainError(
                        f"{where(index, role)}: answers no pending tool call (more tool results than calls, "
                        "and no tool_call_id)."
                    )
                if text_tools:
                    payload = {"content": _json_or_text(content), "call_id": call_id}
                    converted.append(
                        UserMessage(content=f"[TOOL_RESULTS] {json.dumps(payload, ensure_ascii=False)} [/TOOL_RESULTS]")
                    )
                else:
                    converted.append(ToolMessage(content=content, tool_call_id=call_id, name=message.get("name")))
        except ValidationError as exc:
            raise RaytrainError(f"{where(index, role)}: not a valid mistral-common message: {exc}") from exc
    return converted


def to_chat_request(messages: Sequence[dict[str, Any]], tokenizer: MistralTokenizer) -> ChatCompletionRequest:
    """Check a Nemotron-shaped conversation and convert it to a mistral-common ``ChatCompletionRequest``."""
    version = tokenizer.instruct_tokenizer.tokenizer.version
    _check_conversation(messages, text_tools=version == TokenizerVersion.v1)
    return ChatCompletionRequest(messages=_to_mistral_messages(messages, version))


def tokenize_conversation(
    messages: Sequence[dict[str, Any]], tokenizer: MistralTokenizer, *, verify: bool = True
) -> TokenizedConversation:
    """Encode one conversation with mistral-common's chat format and mark the assistant tokens.

    ``tokenizer`` comes from ``load_tokenizer`` (v1 or v3, SentencePiece). With ``verify`` (default) the
    result is checked token for token against ``tokenizer.encode_chat_completion`` of the whole
    conversation; a mismatch is a bug here and raises AssertionError. Raises RaytrainError naming the
    message index and role for conversations the shared rules (dataset.conversation_rules: a ConversationError
    with its quarantine reason), v3's own rules or Mistral's finetuning rules reject.
    """
    version = tokenizer.instruct_tokenizer.tokenizer.version
    if version not in (TokenizerVersion.v1, TokenizerVersion.v3):
        raise RaytrainError(f"tokenizer version {version.value} is not supported; use load_tokenizer('v1' | 'v3').")
    request = to_chat_request(messages, tokenizer)
    try:
        validated = get_validator(version, mode=ValidationMode.finetuning).validate_request(request)
    except MistralCommonException as exc:
        raise RaytrainError(
            f"conversation rejected by mistral-common's {version.value} finetuning rules: {exc}"
        ) from exc
    instruct_request = get_normalizer(version).from_chat_completion_request(validated)

    # Mirrors InstructTokenizerBase.encode_instruct for v1-v3 (text only, no truncation), keeping boundaries.
    instruct = tokenizer.instruct_tokenizer
    first_user, last_user = instruct.find_first_last_user(instruct_request)
    input_ids: list[int] = list(instruct.start())
    loss_mask: list[bool] = [False] * len(input_ids)
    for index, message in enumerate(instruct_request.messages):
        is_assistant = False
        if isinstance(message, UserMessage):
            tokens, _, _ = instruct.encode_user_message(
                message,
                instruct_request.available_tools,
                index == last_user,
                index == first_user,
                system_prompt=instruct_request.system_prompt,
                force_img_first=True,
                settings=instruct_request.settings,
            )
        elif isinstance(message, ToolMessage):
            tokens, _, _ = instruct.encode_tool_message(message, index < last_user)
        elif isinstance(message, AssistantMessage):
            tokens = instruct.encode_assistant_message(message=message, is_before_last_user_message=index < last_user)
            is_assistant = True
        else:  # v1-v3 normalisers fold system messages into system_prompt; anything else is unexpected
            raise AssertionError(f"unexpected normalised message type {type(message).__name__}")
        input_ids.extend(tokens)
        loss_mask.extend([is_assistant] * len(tokens))

    if verify:
        reference = (
            tokenizer.encode_chat_completion(request).tokens
            if tokenizer.mode == ValidationMode.finetuning
            else instruct.encode_instruct(instruct_request).tokens
        )
        if reference != input_ids:
            raise AssertionError(
                f"per-message encoding ({len(input_ids)} tokens) differs from mistral-common's "
                f"encode_chat_completion ({len(reference)} tokens); the span logic needs updating."
            )
    return TokenizedConversation(input_ids=input_ids, loss_mask=loss_mask)


def tokenize_pair(pair_id: str, prompt: Sequence[dict[str, Any]], chosen: str, rejected: str,
                  tokenizer: MistralTokenizer, *, verify: bool = True) -> TokenizedPair:
    """Encode a preference pair: ``prompt`` (turns ending with a user turn) followed by each response as the final
    assistant turn. ``prompt + chosen`` is mistral-common's ``encode_chat_completion`` of that conversation (checked
    with ``verify``, as ``tokenize_conversation``); the response is its final assistant turn, end-of-sequence token
    included. Raises AssertionError when the prompt's tokens differ between the two (a bug here)."""
    sides = []
    for response in (chosen, rejected):
        conversation = tokenize_conversation([*prompt, {"role": "assistant", "content": response, "tool_calls": []}],
                                             tokenizer, verify=verify)
        mask = conversation.loss_mask
        start = len(mask) - next(i for i, trained in enumerate(reversed(mask)) if not trained)
        sides.append((conversation.input_ids[:start], conversation.input_ids[start:]))
    if sides[0][0] != sides[1][0]:
        raise AssertionError(f"pair {pair_id!r}: the prompt encodes to different tokens before the two responses.")
    return TokenizedPair(pair_id=pair_id, prompt=sides[0][0], chosen=sides[0][1], rejected=sides[1][1])
