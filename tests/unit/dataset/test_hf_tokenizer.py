"""The exported tokenizer, loaded by transformers' AutoTokenizer, encodes chats exactly as mistral-common does.

Reference: mistral-common's ``encode_chat_completion`` (validation mode "test", as a server calls it) on the same
messages, for v1 (system prompt in the first user turn) and v3 (in the last), on hand-written multi-turn chats and
on the sample dataset's text conversations (``<think>`` traces, code indentation, double spaces).
"""

from __future__ import annotations

import json

import pyarrow.parquet as pq
import pytest
from mistral_common.protocol.instruct.messages import AssistantMessage, SystemMessage, UserMessage
from mistral_common.protocol.instruct.request import ChatCompletionRequest
from mistral_common.protocol.instruct.validator import ValidationMode
from mistral_common.tokens.tokenizers.mistral import MistralTokenizer
from transformers import AutoTokenizer

from raytrain.dataset.hf_tokenizer import save_hf_tokenizer
from raytrain.dataset.tokenize import load_tokenizer, tokenize_conversation, tokenizer_file
from raytrain.errors import RaytrainError
from raytrain.sample_data import write_sample_dataset

HAND_WRITTEN = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "detailed thinking off"},
     {"role": "user", "content": "Hi"},
     {"role": "assistant", "content": "Hello!  How can I help?  "},
     {"role": "user", "content": "Indent this:\n    def f():\n        return 1"}],
    [{"role": "system", "content": "You are terse."},
     {"role": "user", "content": "one"}, {"role": "assistant", "content": "1"},
     {"role": "user", "content": "two"}, {"role": "assistant", "content": "<think>\nadd one\n</think>\n\n2"},
     {"role": "user", "content": "three?"}],
]
_MESSAGE = {"system": SystemMessage, "user": UserMessage, "assistant": AssistantMessage}


def _is_text_chat(messages: list[dict]) -> bool:
    """An optional leading system prompt, then user/assistant text turns in turn, ending with the assistant."""
    turns = messages[1:] if messages and messages[0]["role"] == "system" else messages
    return (len(turns) >= 2 and len(turns) % 2 == 0 and all((m["content"] or "").strip() for m in turns)
            and all(m["role"] == ("user", "assistant")[i % 2] and not m.get("tool_calls")
                    for i, m in enumerate(turns)))


@pytest.fixture(scope="module")
def sample_conversations(tmp_path_factory) -> list[list[dict]]:
    """The sample dataset's text conversations (tool-calling and malformed rows left out)."""
    manifest = write_sample_dataset(str(tmp_path_factory.mktemp("sample")), seed=0, rows_per_split=20)
    conversations = []
    for path in manifest.all_files():
        for row in pq.read_table(path, columns=["messages"]).to_pylist():
            messages = [{k: m[k] for k in ("role", "content", "tool_calls")} for m in row["messages"] or []]
            if _is_text_chat(messages):
                conversations.append([{"role": m["role"], "content": m["content"]} for m in messages])
    assert len(conversations) >= 40, "the sample must provide text conversations to compare on"
    return conversations


def _mistral_common_ids(version: str, messages: list[dict]) -> list[int]:
    tokenizer = MistralTokenizer.from_file(str(tokenizer_file(version)), mode=ValidationMode.test)
    request = ChatCompletionRequest(messages=[_MESSAGE[m["role"]](content=m["content"]) for m in messages])
    return tokenizer.encode_chat_completion(request).tokens


def _chat_ids(tokenizer, messages: list[dict]) -> list[int]:
    return list(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                              return_dict=False))


@pytest.mark.parametrize("version", ["v1", "v3"])
def test_auto_tokenizer_chat_template_equals_mistral_common(tmp_path, version, sample_conversations):
    folder = save_hf_tokenizer(version, tmp_path / "export")
    assert sorted(p.name for p in folder.iterdir()) == sorted(["tokenizer_config.json", f"tokenizer.model.{version}"])
    assert json.loads((folder / "tokenizer_config.json").read_text())["tokenizer_class"] == "MistralCommonBackend"
    tokenizer = AutoTokenizer.from_pretrained(folder)
    assert len(tokenizer) == {"v1": 32000, "v3": 32768}[version]

    prompts = HAND_WRITTEN + [conversation[:-1] for conversation in sample_conversations]
    for messages in prompts:
        assert _chat_ids(tokenizer, messages) == _mistral_common_ids(version, messages), messages

    # v1 and v3 differ where the system prompt goes: the first user turn (v1) or the last (v3).
    ids = _chat_ids(tokenizer, HAND_WRITTEN[2])
    text = tokenizer.decode(ids, skip_special_tokens=True)
    assert text.count("You are terse.") == 1
    first_user, last_user = text.index("one"), text.index("three?")
    system_at = text.index("You are terse.")
    assert (system_at < first_user) if version == "v1" else (first_user < system_at < last_user)


@pytest.mark.parametrize("version", ["v1", "v3"])
def test_served_prompt_is_the_prefix_training_continued(tmp_path, version, sample_conversations):
    """A conversation's training ids start with the served prompt of its first turns: the model is asked at
    serving time exactly what it learned to answer."""
    tokenizer = AutoTokenizer.from_pretrained(save_hf_tokenizer(version, tmp_path / "export"))
    training_tokenizer = load_tokenizer(version)
    for conversation in sample_conversations:
        trained = tokenize_conversation(conversation, training_tokenizer)
        prompt = _chat_ids(tokenizer, conversation[:-1])
        assert trained.input_ids[:len(prompt)] == prompt
        # the final answer (and its EOS) is trained, the prompt's closing [/INST] is not
        assert all(trained.loss_mask[len(prompt):]) and not trained.loss_mask[len(prompt) - 1]


def test_unknown_version_names_the_choices(tmp_path):
    with pytest.raises(RaytrainError, match=r"'v2'.*\['v1', 'v3'\]"):
        save_hf_tokenizer("v2", tmp_path)
