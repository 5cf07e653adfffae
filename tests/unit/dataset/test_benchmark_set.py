"""The benchmark set: the decontamination eval items formatted as conversations for the benchmark loss."""

import json

from mistral_common.protocol.instruct.messages import AssistantMessage, UserMessage
from mistral_common.protocol.instruct.request import ChatCompletionRequest

from raytrain.config import DatasetConfig
from raytrain.dataset.pack import tokenize_and_pack_batch
from raytrain.dataset.stream import benchmark_conversations
from raytrain.dataset.tokenize import load_tokenizer


def test_question_answer_items_become_conversations_and_the_rest_is_counted():
    records = [
        {"id": "e0", "question": "How many legs has a spider?", "answer": "8"},
        "a plain-text eval line",  # a text-only eval set: decontaminates, has no answer to score
        {"question": "No answer here", "answer": ""},
        {"question": "Long? " + "word " * 200, "answer": "yes"},
        {"question": "What is 2 + 3?", "answer": "5", "extra": 1},
    ]
    cfg = DatasetConfig(seq_len=64)
    frame, skipped = benchmark_conversations(records, cfg)
    assert frame["uuid"].tolist() == ["benchmark-0", "benchmark-4"]
    assert skipped == {"no_question_answer": 2, "longer_than_seq_len": 1}
    assert json.loads(frame["messages_json"][1]) == [
        {"role": "user", "content": "What is 2 + 3?", "tool_calls": None},
        {"role": "assistant", "content": "5", "tool_calls": None}]

    # packed like training data: the tokens are mistral-common's encoding of [user question, assistant answer] and
    # the loss falls on the answer (and its end of sequence) only
    out = tokenize_and_pack_batch(frame, cfg.tokenizer, cfg.seq_len, cfg.length_policy)
    tokenizer = load_tokenizer(cfg.tokenizer)
    row, segment = out["input_ids"][0], out["segment_ids"][0]
    first = row[segment == 0].tolist()
    request = ChatCompletionRequest(messages=[UserMessage(content="How many legs has a spider?"),
                                              AssistantMessage(content="8")])
    assert first == tokenizer.encode_chat_completion(request).tokens
    targets = out["labels"][0][segment == 0]
    answer = tokenizer.instruct_tokenizer.tokenizer.encode("8", bos=False, eos=False)
    assert [t for t in targets.tolist() if t != -100] == [*answer, tokenizer.instruct_tokenizer.tokenizer.eos_id]
