"""tokenize_conversation against mistral-common's own chat encoding of the same messages (v1 and v3)."""

import json
from pathlib import Path

import mistral_common
import pytest
from mistral_common.protocol.instruct.messages import AssistantMessage, SystemMessage, ToolMessage, UserMessage
from mistral_common.protocol.instruct.request import ChatCompletionRequest
from mistral_common.protocol.instruct.tool_calls import FunctionCall, ToolCall
from mistral_common.protocol.instruct.validator import ValidationMode
from mistral_common.tokens.tokenizers.mistral import MistralTokenizer

from raytrain.dataset.conversation_rules import BAD_ROLE, ConversationError, check_conversation
from raytrain.dataset.tokenize import fit_tool_call_turns, load_tokenizer, tokenize_conversation
from raytrain.errors import RaytrainError

FILES = {"v1": "tokenizer.model.v1", "v3": "mistral_instruct_tokenizer_240323.model.v3"}


@pytest.fixture(scope="module", params=["v1", "v3"])
def version(request):
    return request.param


def reference_ids(version: str, messages: list) -> list[int]:
    """mistral-common's own encoding, from a tokenizer loaded here independently of raytrain."""
    path = Path(mistral_common.__file__).parent / "data" / FILES[version]
    tokenizer = MistralTokenizer.from_file(str(path), mode=ValidationMode.finetuning)
    return tokenizer.encode_chat_completion(ChatCompletionRequest(messages=messages)).tokens


def masked_spans(tokenized) -> list[list[int]]:
    """Contiguous runs of loss-masked token ids."""
    spans, current = [], []
    for token_id, trainable in zip(tokenized.input_ids, tokenized.loss_mask, strict=True):
        if trainable:
            current.append(token_id)
        elif current:
            spans.append(current)
            current = []
    if current:
        spans.append(current)
    return spans


def msg(role, content, tool_calls=None):
    return {"role": role, "content": content, "tool_calls": tool_calls}


SINGLE = [msg("user", "What is the capital of France?"), msg("assistant", "Paris is the capital of France.")]
MULTI = [
    msg("user", "Give me a number."),
    msg("assistant", "Seven."),
    msg("user", "Now double it."),
    msg("assistant", "Fourteen."),
    msg("user", "And in French?"),
    msg("assistant", "Quatorze, avec plaisir."),
]
SYSTEM = [msg("system", "You answer in one word.")] + MULTI[:4]


@pytest.mark.parametrize("conversation", [SINGLE, MULTI, SYSTEM], ids=["single", "multi", "system"])
def test_ids_equal_mistral_common_and_mask_decodes_to_assistant_text(version, conversation):
    reference_messages = {
        "system": lambda m: SystemMessage(content=m["content"]),
        "user": lambda m: UserMessage(content=m["content"]),
        "assistant": lambda m: AssistantMessage(content=m["content"]),
    }
    expected = reference_ids(version, [reference_messages[m["role"]](m) for m in conversation])
    tokenizer = load_tokenizer(version)
    tokenized = tokenize_conversation(conversation, tokenizer)

    assert tokenized.input_ids == expected
    assert tokenized.loss_mask[0] is False  # BOS
    eos_id = tokenizer.instruct_tokenizer.tokenizer.eos_id
    spans = masked_spans(tokenized)
    assistant_texts = [m["content"] for m in conversation if m["role"] == "assistant"]
    assert len(spans) == len(assistant_texts)
    for span, text in zip(spans, assistant_texts, strict=True):
        assert span[-1] == eos_id  # the EOS closing the turn is trainable
        assert tokenizer.decode(span) == text
    # Everything outside the spans (BOS, [INST] blocks, system/user text) is masked out.
    prompt_text = tokenizer.decode([t for t, m in zip(tokenized.input_ids, tokenized.loss_mask, strict=True) if not m])
    for m in conversation:
        if m["role"] != "assistant":
            assert m["content"] in prompt_text
        else:
            assert m["content"] not in prompt_text


def test_vocab_sizes_and_cache():
    assert load_tokenizer("v1").instruct_tokenizer.tokenizer.n_words == 32000
    assert load_tokenizer("v3").instruct_tokenizer.tokenizer.n_words == 32768
    assert load_tokenizer("v3") is load_tokenizer("v3")
    assert load_tokenizer() is load_tokenizer("v3")


def test_unknown_version_lists_choices():
    with pytest.raises(RaytrainError, match=r"'v2'.*\['v1', 'v3'\]"):
        load_tokenizer("v2")


def tool_conversation(call_ids: tuple[str, str]):
    calls = [
        {"id": call_ids[0], "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
        {"id": call_ids[1], "type": "function", "function": {"name": "get_time", "arguments": {"tz": "CET"}}},
    ]
    return [
        msg("system", "You can call tools."),
        msg("user", "Weather and time in Paris?"),
        msg("assistant", None, calls),
        msg("tool", '{"temp_c": 21}'),  # answers calls[0] by order
        msg("tool", "14:05"),  # answers calls[1] by order
        msg("assistant", "It is 21 C and 14:05 in Paris."),
    ]


def test_v3_tool_calls_equal_mistral_common():
    ids = ("abcDEF123", "XYZ987uvw")
    expected = reference_ids(
        "v3",
        [
            SystemMessage(content="You can call tools."),
            UserMessage(content="Weather and time in Paris?"),
            AssistantMessage(
                tool_calls=[
                    ToolCall(id=ids[0], function=FunctionCall(name="get_weather", arguments='{"city": "Paris"}')),
                    ToolCall(id=ids[1], function=FunctionCall(name="get_time", arguments='{"tz": "CET"}')),
                ]
            ),
            ToolMessage(content='{"temp_c": 21}', tool_call_id=ids[0]),
            ToolMessage(content="14:05", tool_call_id=ids[1]),
            AssistantMessage(content="It is 21 C and 14:05 in Paris."),
        ],
    )
    tokenizer = load_tokenizer("v3")
    tokenized = tokenize_conversation(tool_conversation(ids), tokenizer)
    assert tokenized.input_ids == expected

    call_span, answer_span = masked_spans(tokenized)
    tool_calls_id = tokenizer.instruct_tokenizer.tokenizer.get_special_token("[TOOL_CALLS]")
    assert call_span[0] == tool_calls_id
    assert json.loads(tokenizer.decode(call_span)) == [
        {"name": "get_weather", "arguments": {"city": "Paris"}, "id": ids[0]},
        {"name": "get_time", "arguments": {"tz": "CET"}, "id": ids[1]},
    ]
    assert tokenizer.decode(answer_span) == "It is 21 C and 14:05 in Paris."
    prompt = tokenizer.decode([t for t, m in zip(tokenized.input_ids, tokenized.loss_mask, strict=True) if not m])
    assert '"temp_c": 21' in prompt and "14:05" in prompt  # tool results are context, not targets


def test_v3_remaps_ids_v3_rejects_and_keeps_pairs():
    # OpenAI-style ids fail v3's ^[a-zA-Z0-9]{9}$ rule; they are remapped, the same way on call and result.
    tokenizer = load_tokenizer("v3")
    tokenized = tokenize_conversation(tool_conversation(("call_0001_weather", "call_0002_time")), tokenizer)
    special = tokenizer.instruct_tokenizer.tokenizer.get_special_token
    begin_results, end_results = special("[TOOL_RESULTS]"), special("[/TOOL_RESULTS]")
    call_span = masked_spans(tokenized)[0]
    calls = json.loads(tokenizer.decode(call_span))
    ids, results, start = tokenized.input_ids, [], None
    for i, token_id in enumerate(ids):
        if token_id == begin_results:
            start = i + 1
        elif token_id == end_results:
            results.append(json.loads(tokenizer.decode(ids[start:i])))
    assert [c["id"] for c in calls] == [r["call_id"] for r in results]
    assert all(len(c["id"]) == 9 and c["id"].isalnum() for c in calls)
    assert len({c["id"] for c in calls}) == 2


def test_v1_renders_tool_turns_as_text():
    ids = ("abcDEF123", "XYZ987uvw")
    call_text = "[TOOL_CALLS] " + json.dumps(
        [
            {"name": "get_weather", "arguments": {"city": "Paris"}, "id": ids[0]},
            {"name": "get_time", "arguments": {"tz": "CET"}, "id": ids[1]},
        ]
    )
    expected = reference_ids(
        "v1",
        [
            SystemMessage(content="You can call tools."),
            UserMessage(content="Weather and time in Paris?"),
            AssistantMessage(content=call_text),
            UserMessage(content='[TOOL_RESULTS] {"content": {"temp_c": 21}, "call_id": "abcDEF123"} [/TOOL_RESULTS]'),
            UserMessage(content='[TOOL_RESULTS] {"content": "14:05", "call_id": "XYZ987uvw"} [/TOOL_RESULTS]'),
            AssistantMessage(content="It is 21 C and 14:05 in Paris."),
        ],
    )
    tokenizer = load_tokenizer("v1")
    tokenized = tokenize_conversation(tool_conversation(ids), tokenizer)
    assert tokenized.input_ids == expected
    assert [tokenizer.decode(s) for s in masked_spans(tokenized)] == [call_text, "It is 21 C and 14:05 in Paris."]


@pytest.mark.parametrize(
    ("conversation", "pattern"),
    [
        (
            [msg("user", "hi"), msg("assistant", "sure", [{"id": "abcDEF123", "function": {"name": "f"}}])],
            r"message 1 \(role 'assistant'\).*both",
        ),
        (
            [
                msg("user", "hi"),
                msg("assistant", None, [{"id": "abcDEF123", "function": {"name": "f", "arguments": "{}"}}]),
                msg("tool", "1"),
                msg("tool", "2"),
                msg("assistant", "ok"),
            ],
            r"message 3 \(role 'tool'\).*no pending tool call",
        ),
        (
            [msg("user", "hi"), msg("assistant", None, [{"id": "abcDEF123", "function": {"name": "get weather"}}])],
            r"message 1 \(role 'assistant'\): tool name 'get weather' must match",
        ),
    ],
)
def test_tokenizer_rules_name_the_message(conversation, pattern):
    # the rules on top of the shared ones (dataset.conversation_rules, tested on their own): v3's, and pairing
    with pytest.raises(RaytrainError, match=pattern):
        tokenize_conversation(conversation, load_tokenizer("v3"))


def test_shared_rules_reject_with_their_reason_and_message():
    conversation = [msg("user", "hi", [{"id": "abcDEF123", "function": {"name": "f"}}]), msg("assistant", "ok")]
    with pytest.raises(ConversationError) as shared:
        check_conversation(conversation)
    for version in ("v1", "v3"):
        with pytest.raises(ConversationError) as caught:
            tokenize_conversation(conversation, load_tokenizer(version))
        assert (caught.value.reason, str(caught.value)) == (BAD_ROLE, str(shared.value))
        assert str(caught.value).startswith("message 0 (role 'user'): ")


def think_then_call_conversation(call_id: str) -> list[dict]:
    """An assistant turn with a <think> trace *and* a tool call, as Nemotron's tool_calling rows with reasoning on."""
    call = {"id": call_id, "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    return [
        msg("user", "Weather in Paris?"),
        msg("assistant", "<think>\nThe user wants the weather; get_weather fits.\n</think>", [call]),
        msg("tool", '{"temp_c": 21}'),
        msg("assistant", "It is 21 C in Paris."),
    ]


def test_v3_text_with_tool_calls_refused_unless_fitted():
    tokenizer = load_tokenizer("v3")
    conversation = think_then_call_conversation("abcDEF123")
    with pytest.raises(RaytrainError, match=r"message 1 \(role 'assistant'\).*text_with_tool_calls"):
        tokenize_conversation(conversation, tokenizer)
    unchanged = fit_tool_call_turns(conversation, "v3", "quarantine")
    assert unchanged.messages == conversation and unchanged.dropped_text_turns == 0

    fitted = fit_tool_call_turns(conversation, "v3", "drop_text")
    assert (fitted.dropped_text_turns, fitted.dropped_text_chars) == (1, len(conversation[1]["content"]))
    assert conversation[1]["content"].startswith("<think>")  # the input is not modified
    expected = reference_ids("v3", [
        UserMessage(content="Weather in Paris?"),
        AssistantMessage(tool_calls=[ToolCall(id="abcDEF123",
                                              function=FunctionCall(name="get_weather", arguments='{"city": "Paris"}'))]),
        ToolMessage(content='{"temp_c": 21}', tool_call_id="abcDEF123"),
        AssistantMessage(content="It is 21 C in Paris."),
    ])
    tokenized = tokenize_conversation(fitted.messages, tokenizer)
    assert tokenized.input_ids == expected
    call_span, answer_span = masked_spans(tokenized)
    assert call_span[0] == tokenizer.instruct_tokenizer.tokenizer.get_special_token("[TOOL_CALLS]")
    assert tokenizer.decode(answer_span) == "It is 21 C in Paris."


def test_v1_keeps_text_and_tool_calls_in_one_trainable_turn():
    tokenizer = load_tokenizer("v1")
    conversation = think_then_call_conversation("abcDEF123")
    assert fit_tool_call_turns(conversation, "v1", "drop_text").messages == conversation  # nothing to drop on v1
    payload = [{"name": "get_weather", "arguments": {"city": "Paris"}, "id": "abcDEF123"}]
    expected = reference_ids("v1", [
        UserMessage(content="Weather in Paris?"),
        AssistantMessage(content=conversation[1]["content"] + "\n\n[TOOL_CALLS] " + json.dumps(payload)),
        UserMessage(content='[TOOL_RESULTS] {"content": {"temp_c": 21}, "call_id": "abcDEF123"} [/TOOL_RESULTS]'),
        AssistantMessage(content="It is 21 C in Paris."),
    ])
    tokenized = tokenize_conversation(conversation, tokenizer)
    assert tokenized.input_ids == expected
    call_span, answer_span = masked_spans(tokenized)
    decoded = tokenizer.decode(call_span)
    assert decoded.startswith("<think>") and "[TOOL_CALLS]" in decoded and '"get_weather"' in decoded
    assert tokenizer.decode(answer_span) == "It is 21 C in Paris."


def test_fit_tool_call_turns_rejects_unknown_policy():
    with pytest.raises(RaytrainError, match="drop_text"):
        fit_tool_call_turns([], "v3", "keep")
