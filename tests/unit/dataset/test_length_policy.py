"""dataset.length_policy (raytrain.dataset.length) on real Mistral tokenizations: counts and cuts checked against
mistral-common's own encode_chat_completion of the same conversations."""

import json

import numpy as np
import pandas as pd
import pytest
from mistral_common.protocol.instruct.messages import AssistantMessage, SystemMessage, UserMessage
from mistral_common.protocol.instruct.request import ChatCompletionRequest

from raytrain.dataset.length import (
    DROP,
    KEEP,
    SPLIT,
    TRUNCATE,
    apply_length,
    decide_length,
    decide_pair_length,
    final_answer_start,
)
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


def _kept(d):
    return d.action, d.chosen, d.rejected, d.train_tokens, d.tokens_removed


def test_a_pair_that_fits_is_kept_whole_under_either_policy():
    for policy in (DROP, TRUNCATE):
        d = decide_pair_length(10, 12, 8, 40, policy)  # exactly seq_len fits
        assert _kept(d) == (KEEP, 12, 8, 40, 0) and d.num_tokens == 40 and d.detail == ""


def test_drop_quarantines_a_long_pair_naming_its_counts_and_the_fix():
    d = decide_pair_length(10, 15, 10, 40, DROP)
    assert _kept(d) == (DROP, 0, 0, 0, 0) and d.num_tokens == 45
    assert d.detail.startswith("the pair takes 45 tokens in a pack (prompt 10 twice, chosen 15, rejected 10) > "
                               "dataset.seq_len=40; a pair is never split")
    assert "choose truncate, or a longer seq_len" in d.detail


def test_truncate_keeps_a_short_response_whole_and_cuts_the_longer():
    # budget 40 - 2 * 10 = 20: the shorter (5) fits in 10, so it stays whole and the longer gets 15
    assert _kept(decide_pair_length(10, 30, 5, 40, TRUNCATE)) == (TRUNCATE, 15, 5, 40, 15)
    assert _kept(decide_pair_length(10, 5, 30, 40, TRUNCATE)) == (TRUNCATE, 5, 15, 40, 15)
    assert _kept(decide_pair_length(10, 30, 10, 40, TRUNCATE)) == (TRUNCATE, 10, 10, 40, 20)  # shorter == B / 2


def test_truncate_halves_the_budget_when_both_are_long_the_odd_token_to_the_longer():
    assert _kept(decide_pair_length(10, 30, 20, 40, TRUNCATE)) == (TRUNCATE, 10, 10, 40, 30)
    # odd budget 21: 11 to the longer, chosen on a tie
    assert _kept(decide_pair_length(10, 30, 20, 41, TRUNCATE)) == (TRUNCATE, 11, 10, 41, 29)
    assert _kept(decide_pair_length(10, 20, 30, 41, TRUNCATE)) == (TRUNCATE, 10, 11, 41, 29)
    assert _kept(decide_pair_length(10, 30, 30, 41, TRUNCATE)) == (TRUNCATE, 11, 10, 41, 39)


def test_truncate_drops_a_pair_whose_prompt_leaves_no_token_per_response():
    d = decide_pair_length(10, 5, 5, 21, TRUNCATE)  # budget 1 < 2
    assert _kept(d) == (DROP, 0, 0, 0, 0)
    assert "the pair takes 30 tokens in a pack (prompt 10 twice, chosen 5, rejected 5) > dataset.seq_len=21" in d.detail
    assert "the prompt alone is 10 tokens" in d.detail and "raise dataset.seq_len" in d.detail
    assert "leaves 0 of seq_len" in decide_pair_length(30, 5, 5, 40, TRUNCATE).detail  # never a negative count
    assert _kept(decide_pair_length(10, 5, 5, 22, TRUNCATE)) == (TRUNCATE, 1, 1, 22, 8)


def test_truncate_invariants_over_many_lengths():
    for p in (1, 3, 7):
        for c in range(1, 14):
            for r in range(1, 14):
                for seq_len in range(2 * p + 2, 2 * p + c + r):
                    d = decide_pair_length(p, c, r, seq_len, TRUNCATE)
                    longer, shorter = (d.chosen, d.rejected) if c >= r else (d.rejected, d.chosen)
                    assert d.action == TRUNCATE and d.train_tokens == seq_len, (p, c, r, seq_len)
                    assert 1 <= d.chosen <= c and 1 <= d.rejected <= r
                    assert longer >= shorter and d.tokens_removed == 2 * p + c + r - seq_len


def test_split_cannot_apply_to_a_pair():
    with pytest.raises(RaytrainError, match=r"length_policy 'split' cannot apply to a preference pair.*"
                                            r"choose 'drop' or 'truncate'"):
        decide_pair_length(10, 5, 5, 100, SPLIT)  # refused even when the pair fits
    with pytest.raises(RaytrainError, match="length_policy 'cut'"):
        decide_pair_length(10, 5, 5, 100, "cut")
