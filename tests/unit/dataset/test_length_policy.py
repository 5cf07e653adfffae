"""dataset.length_policy (raytrain.dataset.length) on real Mistral tokenizations: counts and cuts checked against
mistral-common's own encode_chat_completion of the same conversations."""

import json

import numpy as np
import pandas as pd
import pytest
from mistral_common.protocol.instruct.messages import AssistantMessage, SystemMessage, UserMessage
from mistral_common.protocol.instruct.request import ChatCompletionRequest

from raytrain.dataset.length import DROP, KEEP, SPLIT, TRUNCATE, apply_length, decide_length, final_answer_start
from raytrain.dataset.pack import IGNORE_INDEX, pack_batch, tokenize_frame
from raytrain.dataset.tokenize import load_tokenizer, tokenize_conversation
from raytrain.errors import RaytrainError

QUESTION = "Explain, step by step, how a heat pump moves heat from a cold room into a warm one."
ANSWER = "<think>\n" + " ".join(f"Step {i}: the refrigerant at stage {i} changes pressure." for i in range(40)) \
    + "\n</think>\n\nIt compresses a refrigerant so it runs hotter than the warm room."


def _conversation(system="detailed thinking on"):
    return [{"role": "system", "content": system, "tool_calls": []},
            {"role": "user", "content": QUESTION, "tool_calls": []},
            {"role": "assistant", "content": ANSWER, "tool_calls": []}]


def _reference_ids(tokenizer, system="detailed thinking on"):
    return tokenizer.encode_chat_completion(ChatCompletionRequest(messages=[
        SystemMessage(content=system), UserMessage(content=QUESTION), AssistantMessage(content=ANSWER)])).tokens


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer("v3")


def test_final_answer_start():
    assert final_answer_start([False, True, True, False, False, True, True]) == 5
    assert final_answer_start([False, True, True, False]) == 1
    assert final_answer_start([False, False]) == 2


def test_counts_equal_mistral_common(tokenizer):
    ref = _reference_ids(tokenizer)
    tok = tokenize_conversation(_conversation(), tokenizer)
    prompt = final_answer_start(tok.loss_mask)
    assert tok.input_ids == ref and prompt < len(ref)
    assert decide_length(tok.loss_mask, len(ref), DROP) == decide_length(tok.loss_mask, len(ref), TRUNCATE)
    assert decide_length(tok.loss_mask, len(ref), DROP).action == KEEP  # exactly seq_len fits
    drop = decide_length(tok.loss_mask, len(ref) - 1, DROP)
    assert (drop.action, drop.num_tokens, drop.train_tokens) == (DROP, len(ref), 0)
    assert f"{len(ref)} tokens > dataset.seq_len={len(ref) - 1}" in drop.detail
    trunc = decide_length(tok.loss_mask, prompt + 5, TRUNCATE)
    assert (trunc.action, trunc.train_tokens, trunc.tokens_removed) == (TRUNCATE, prompt + 5, len(ref) - prompt - 5)
    split = decide_length(tok.loss_mask, 16, SPLIT)
    assert (split.action, split.train_tokens) == (SPLIT, len(ref))
    # A prompt that alone fills seq_len leaves no answer to train on: dropped even under truncate, and said why.
    no_room = decide_length(tok.loss_mask, prompt, TRUNCATE)
    assert no_room.action == DROP and f"prompt alone is {prompt} tokens" in no_room.detail
    assert decide_length(tok.loss_mask, prompt + 1, TRUNCATE).action == TRUNCATE


def test_truncate_keeps_prompt_and_answer_start(tokenizer):
    ref = _reference_ids(tokenizer)
    tok = tokenize_conversation(_conversation(), tokenizer)
    prompt = final_answer_start(tok.loss_mask)
    seq_len = prompt + 20
    ids, mask = apply_length(tok.input_ids, tok.loss_mask, seq_len, TRUNCATE)
    assert list(ids) == ref[:seq_len] and list(mask) == tok.loss_mask[:seq_len]
    batch = pd.DataFrame({"uuid": ["a"], "messages_json": [json.dumps(_conversation())]})
    out = pack_batch(tokenize_frame(batch, "v3"), seq_len, TRUNCATE)
    assert out["input_ids"].tolist() == [ref[:seq_len]] and out["num_tokens"].tolist() == [seq_len]
    labels = out["labels"][0]
    # Labels: the answer's first 20 tokens as targets of the positions before them, nothing after the cut.
    np.testing.assert_array_equal(labels[prompt - 1 : seq_len - 1], ref[prompt:seq_len])
    assert (labels[: prompt - 1] == IGNORE_INDEX).all() and labels[seq_len - 1] == IGNORE_INDEX


def test_drop_refuses_in_packing_and_split_keeps_every_token(tokenizer):
    ref = _reference_ids(tokenizer)
    batch = pd.DataFrame({"uuid": ["long"], "messages_json": [json.dumps(_conversation())]})
    with pytest.raises(RaytrainError, match=r"uuid='long'.*should have quarantined"):
        pack_batch(tokenize_frame(batch, "v3"), 64, DROP)
    out = pack_batch(tokenize_frame(batch, "v3"), 64, SPLIT)
    assert out["num_tokens"].sum() == len(ref)
    assert np.concatenate([row[:n] for row, n in zip(out["input_ids"], out["num_tokens"], strict=True)]).tolist() \
        == ref


def test_unknown_policy_is_an_error():
    with pytest.raises(RaytrainError, match="length_policy 'cut'"):
        decide_length([False, True], 8, "cut")
