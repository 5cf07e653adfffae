"""Preference rows (HelpSteer3 as published, and the generic prompt/chosen/rejected layout) -> pairs or quarantine,
and a pair's tokens against mistral-common's own chat encoding."""

import pytest
from mistral_common.protocol.instruct.messages import AssistantMessage, SystemMessage, UserMessage
from mistral_common.protocol.instruct.request import ChatCompletionRequest

from raytrain.dataset.reasons import DERIVE_REASONS
from raytrain.dataset.tokenize import load_tokenizer, tokenize_pair
from raytrain.enrich.conversation import Quarantined
from raytrain.enrich.preference import PreferenceExample, derive_pair

CONTEXT = [{"role": "user", "content": "Name a prime number."},
           {"role": "assistant", "content": "2 is prime."},
           {"role": "user", "content": "And an odd one?"}]


def helpsteer(preference, **fields) -> dict:
    row = {"domain": "stem", "language": "english", "context": CONTEXT, "response1": "3 is an odd prime.",
           "response2": "Nine.", "overall_preference": preference,
           "individual_preference": [{"score": preference, "reasoning": "..."}]}
    return {**row, **fields}


@pytest.mark.parametrize("preference, chosen, rejected", [(-3, "3 is an odd prime.", "Nine."),
                                                          (-1, "3 is an odd prime.", "Nine."),
                                                          (2, "Nine.", "3 is an odd prime.")])
def test_the_sign_of_overall_preference_picks_the_chosen_response(preference, chosen, rejected):
    pair = derive_pair(helpsteer(preference))
    assert isinstance(pair, PreferenceExample)
    assert (pair.chosen, pair.rejected, pair.margin) == (chosen, rejected, abs(preference))
    assert [m["role"] for m in pair.prompt] == ["user", "assistant", "user"]
    assert (pair.domain, pair.language) == ("stem", "english")


def test_pair_id_is_stable_and_names_the_row():
    a, b = derive_pair(helpsteer(-2)), derive_pair(helpsteer(-2))
    assert a.pair_id == b.pair_id and a.pair_id.startswith("pair-")
    assert derive_pair(helpsteer(-2, response2="Fifteen.")).pair_id != a.pair_id
    assert derive_pair(helpsteer(-2, id="hs3-17")).pair_id == "hs3-17"


def test_a_string_context_is_one_user_turn():
    pair = derive_pair(helpsteer(1, context="Say hi."))
    assert [(m["role"], m["content"]) for m in pair.prompt] == [("user", "Say hi.")]


@pytest.mark.parametrize("row, reason, detail", [
    (helpsteer(0), "tie", "overall_preference is 0"),
    (helpsteer(-1, response2=None), "missing_response", "response2 is None"),
    (helpsteer(-1, response1="   "), "missing_response", "response1"),
    (helpsteer(4), "bad_preference", "overall_preference is 4: expected an integer from -3 to 3"),
    (helpsteer(1.5), "bad_preference", "1.5"),
    (helpsteer("strong"), "bad_preference", "'strong'"),
    (helpsteer(None), "bad_preference", "None"),
    (helpsteer(True), "bad_preference", "True"),
    (helpsteer(-1, context=CONTEXT[:2]), "bad_role", "message 1 (role 'assistant'): a preference prompt must end"),
    (helpsteer(-1, context=[]), "missing_messages", "context is []"),
    (helpsteer(-1, context=[{"role": "narrator", "content": "x"}]), "bad_role", "role must be one of"),
    (helpsteer(-1, response1="bad \ud800 text"), "undecodable_text", "response1 contains U+D800"),
    (helpsteer(-1, context=[{"role": "assistant", "content": "hi"}, {"role": "user", "content": "?"}]), "bad_role",
     "comes before any user turn"),
])
def test_bad_rows_are_quarantined_with_their_reason(row, reason, detail):
    out = derive_pair(row)
    assert isinstance(out, Quarantined)
    assert out.reason == reason and reason in DERIVE_REASONS
    assert detail in out.detail
    assert out.uuid and out.uuid.startswith("pair-")  # the quarantine file can name the row


def test_rows_that_differ_only_in_their_preference_have_their_own_ids():
    """A tie and the same responses with a preference are two rows: each id names one row."""
    assert derive_pair(helpsteer(0)).uuid == derive_pair(helpsteer(0)).uuid != derive_pair(helpsteer(-1)).pair_id
    assert derive_pair(helpsteer(-1)).pair_id != derive_pair(helpsteer(-2)).pair_id


def test_too_long_and_too_many_turns():
    assert derive_pair(helpsteer(-1), max_chars=20).reason == "too_long"
    assert derive_pair(helpsteer(-1), max_turns=2).reason == "too_many_turns"


def test_generic_layout_of_trl_and_nemo_rl():
    row = {"id": "g-1", "prompt": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi?"}],
           "chosen": [{"role": "assistant", "content": "Hello."}], "rejected": "Go away."}
    pair = derive_pair(row)
    assert (pair.pair_id, pair.chosen, pair.rejected, pair.margin) == ("g-1", "Hello.", "Go away.", 1.0)
    assert derive_pair({"prompt": "Hi?", "chosen": "Hello.", "rejected": ""}).reason == "missing_response"
    bad = derive_pair({"prompt": "Hi?", "chosen": [{"role": "user", "content": "x"}], "rejected": "y"})
    assert bad.reason == "bad_role" and "a list of one assistant turn" in bad.detail


def test_tokenized_pair_is_mistral_commons_encoding_of_each_conversation():
    tokenizer = load_tokenizer("v3")
    prompt = [{"role": "system", "content": "Be brief.", "tool_calls": []}] + \
        [{**m, "tool_calls": []} for m in CONTEXT]
    pair = tokenize_pair("p", prompt, "3 is an odd prime.", "Nine.", tokenizer)
    for response, tokens in (("3 is an odd prime.", pair.chosen), ("Nine.", pair.rejected)):
        request = ChatCompletionRequest(messages=[
            SystemMessage(content="Be brief."), UserMessage(content=CONTEXT[0]["content"]),
            AssistantMessage(content=CONTEXT[1]["content"]), UserMessage(content=CONTEXT[2]["content"]),
            AssistantMessage(content=response)])
        assert list(pair.prompt) + list(tokens) == tokenizer.encode_chat_completion(request).tokens
        assert tokens[-1] == tokenizer.instruct_tokenizer.tokenizer.eos_id
        assert tokenizer.decode(list(tokens)) == response
    assert pair.num_tokens == 2 * len(pair.prompt) + len(pair.chosen) + len(pair.rejected)
