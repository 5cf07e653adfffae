"""The benchmark set: the decontamination eval items formatted as conversations for the benchmark loss."""

from mistral_common.protocol.instruct.messages import AssistantMessage, UserMessage
from mistral_common.protocol.instruct.request import ChatCompletionRequest

from raytrain.config import DatasetConfig
from raytrain.dataset.pack import pack_batch
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
    tokenizer = load_tokenizer(cfg.tokenizer)
    item4 = ChatCompletionRequest(messages=[UserMessage(content="What is 2 + 3?"), AssistantMessage(content="5")])
    assert list(frame["input_ids"][1]) == tokenizer.encode_chat_completion(item4).tokens

    # packed like training data: the tokens are mistral-common's encoding of [user question, assistant answer] and
    # the loss falls on the answer (and its end of sequence) only
    out = pack_batch(frame, cfg.seq_len, cfg.length_policy)
    row, segment = out["input_ids"][0], out["segment_ids"][0]
    first = row[segment == 0].tolist()
    request = ChatCompletionRequest(messages=[UserMessage(content="How many legs has a spider?"),
                                              AssistantMessage(content="8")])
    assert first == tokenizer.encode_chat_completion(request).tokens
    targets = out["labels"][0][segment == 0]
    answer = tokenizer.instruct_tokenizer.tokenizer.encode("8", bos=False, eos=False)
    assert [t for t in targets.tolist() if t != -100] == [*answer, tokenizer.instruct_tokenizer.tokenizer.eos_id]
