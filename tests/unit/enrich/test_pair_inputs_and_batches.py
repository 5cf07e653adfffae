"""The preference enrichment's pure parts: finding HelpSteer3's files in the layouts users have, and the batch
functions Spark runs (here on plain pandas frames)."""

import json
import os

import numpy as np
import pandas as pd
import pytest

from raytrain.dataset.pair_pack import pair_pack_batch
from raytrain.dataset.tokenize import load_tokenizer, tokenize_pair
from raytrain.enrich.pair_batches import PAIR_FINISHED, PAIR_PREPARED, finish_pairs_batch, prepare_pairs_batch
from raytrain.enrich.pair_inputs import HUB_REPO_DIR, discover_pair_inputs
from raytrain.errors import RaytrainError
from raytrain.storage import resolve

ROW = {"domain": "general", "language": "english", "context": [{"role": "user", "content": "What is 2 + 2?"}],
       "response1": "2 + 2 = 4.", "response2": "Numbers are fun.", "overall_preference": -2,
       "individual_preference": []}


def touch(path) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    open(path, "wb").close()


@pytest.mark.parametrize("layout", ["folder", "root", "hub_cache"])
def test_discovery_finds_the_preference_files_in_each_layout(tmp_path, layout):
    root = {"folder": tmp_path / "preference", "root": tmp_path,
            "hub_cache": tmp_path / HUB_REPO_DIR}[layout]
    folder = (tmp_path / HUB_REPO_DIR / "snapshots" / "abc123" / "preference" if layout == "hub_cache"
              else tmp_path / "preference")
    touch(folder / "train.jsonl.gz")
    touch(folder / "validation.jsonl.gz")
    if layout == "hub_cache":
        (tmp_path / HUB_REPO_DIR / "refs").mkdir()
        (tmp_path / HUB_REPO_DIR / "refs" / "main").write_text("abc123")
    found = discover_pair_inputs(resolve(str(root)))
    assert found.root.path == str(folder)
    assert {split: loc.name for split, loc in found.files.items()} == {"train": "train.jsonl.gz",
                                                                      "validation": "validation.jsonl.gz"}


def test_discovery_errors_name_the_path_and_the_fix(tmp_path):
    with pytest.raises(RaytrainError, match="does not exist"):
        discover_pair_inputs(resolve(str(tmp_path / "nowhere")))
    touch(tmp_path / "other.txt")
    with pytest.raises(RaytrainError, match=r"no preference pairs at .* \(found: other.txt\).*Fix:"):
        discover_pair_inputs(resolve(str(tmp_path)))
    touch(tmp_path / "preference" / "validation.jsonl")
    with pytest.raises(RaytrainError, match="no train.jsonl.gz"):
        discover_pair_inputs(resolve(str(tmp_path)))
    touch(tmp_path / "preference" / "train.jsonl")
    touch(tmp_path / "preference" / "train.jsonl.gz")
    with pytest.raises(RaytrainError, match="holds both train.jsonl and train.jsonl.gz"):
        discover_pair_inputs(resolve(str(tmp_path)))


def prepare(lines: list[str]) -> pd.DataFrame:
    pdf = pd.DataFrame({"value": lines, "split": ["train"] * len(lines), "row_id": range(len(lines))})
    return prepare_pairs_batch(pdf, max_chars=10_000, num_perm=16, bands=4, rows=4, shingle_chars=5,
                               eval_index=np.array([], dtype=np.uint64), ngram=13)


def test_prepare_parses_each_line_or_names_why_not():
    out = prepare([json.dumps(ROW), "{not json", "[1, 2]", json.dumps({**ROW, "overall_preference": 0})])
    assert list(out.columns) == PAIR_PREPARED.names
    assert out["status"].tolist() == ["ok", "undecodable_text", "undecodable_text", "tie"]
    assert "the line is not JSON" in out["detail"][1] and "a JSON list, not an object" in out["detail"][2]
    assert out["uuid"][1].startswith("line-") and out["uuid"][1] != out["uuid"][2]
    ok = out.iloc[0]
    assert ok["exact_key"] and len(ok["band_keys"]) == 4 and len(ok["signature"]) == 16 * 4  # 16 uint32 MinHash values
    assert json.loads(ok["pair_json"])["chosen"] == "2 + 2 = 4."
    assert out["band_keys"][3] == [] and out["exact_key"][3] == ""  # quarantined rows carry no dedup columns


def test_finish_tokenizes_kept_pairs_and_refuses_a_pair_that_cannot_fit_one_pack():
    prepared = prepare([json.dumps(ROW), json.dumps({**ROW, "response1": "four " * 40})])
    out = finish_pairs_batch(prepared, tokenizer_version="v3", seq_len=64, length_policy="drop")
    assert list(out.columns) == PAIR_FINISHED.names
    assert out["status"].tolist() == ["ok", "too_many_tokens"]
    first = out.iloc[0]
    assert first["num_tokens"] == 2 * len(first["prompt_ids"]) + len(first["chosen_ids"]) + len(first["rejected_ids"])
    assert first["margin"] == 2.0
    assert "a pair is never split" in out["detail"][1] and "> dataset.seq_len=64" in out["detail"][1]
    assert out["length_action"].tolist() == ["keep", "drop"] and out["tokens_truncated"].tolist() == [0, 0]


def _full_tokens(row, tokenizer):
    pair = json.loads(row["pair_json"])
    return tokenize_pair(row["uuid"], pair["prompt"], pair["chosen"], pair["rejected"], tokenizer)


def test_finish_truncates_a_long_pair_to_the_start_of_its_responses_and_it_packs():
    tokenizer = load_tokenizer("v3")
    long_prompt = {**ROW, "context": [{"role": "user", "content": "What is 2 + 2? " * 20}]}
    prepared = prepare([json.dumps(ROW), json.dumps({**ROW, "response1": "four " * 40, "response2": "4 " * 30}),
                        json.dumps(long_prompt), "{not json"])
    out = finish_pairs_batch(prepared, tokenizer_version="v3", seq_len=64, length_policy="truncate")
    assert out["status"].tolist() == ["ok", "ok", "too_many_tokens", "undecodable_text"]
    assert out["length_action"].tolist() == ["keep", "truncate", "drop", ""]
    assert out["tokens_truncated"].dtype == np.int64
    kept, cut, dropped = out.iloc[0], out.iloc[1], out.iloc[2]
    assert kept["tokens_truncated"] == 0
    full = _full_tokens(cut, tokenizer)
    assert full.num_tokens > 64 and list(cut["prompt_ids"]) == list(full.prompt)
    for written, whole in ((cut["chosen_ids"], full.chosen), (cut["rejected_ids"], full.rejected)):
        assert 1 <= len(written) < len(whole) and list(written) == list(whole[: len(written)])
        assert written[-1] != tokenizer.instruct_tokenizer.tokenizer.eos_id  # the cut takes the EOS with it
    assert cut["num_tokens"] == 2 * len(cut["prompt_ids"]) + len(cut["chosen_ids"]) + len(cut["rejected_ids"]) == 64
    assert cut["tokens_truncated"] == full.num_tokens - 64
    assert "the prompt alone is" in dropped["detail"] and dropped["tokens_truncated"] == 0
    ok = out[out["status"] == "ok"]
    packs = pair_pack_batch(ok, seq_len=64)  # what packing does with the enriched pairs: no pair refused
    assert packs["num_pairs"].sum() == 2


def test_finish_under_drop_quarantines_what_truncate_keeps():
    prepared = prepare([json.dumps({**ROW, "response1": "four " * 40, "response2": "4 " * 30})])
    out = finish_pairs_batch(prepared, tokenizer_version="v3", seq_len=64, length_policy="drop")
    full = _full_tokens(out.iloc[0], load_tokenizer("v3"))
    assert out["status"].tolist() == ["too_many_tokens"] and out["length_action"].tolist() == ["drop"]
    assert f"the pair takes {full.num_tokens} tokens in a pack" in out["detail"][0]
    assert out["num_tokens"][0] == full.num_tokens and out["tokens_truncated"][0] == 0


def test_finish_refuses_split_for_pairs():
    with pytest.raises(RaytrainError, match="'split' cannot apply to a preference pair"):
        finish_pairs_batch(prepare([json.dumps(ROW)]), tokenizer_version="v3", seq_len=64, length_policy="split")


def test_pair_context_puts_the_fine_tunes_selection_into_the_prompt_and_the_pair_trains_it():
    """enrich.pair_context: a pair whose context has prose before the last user turn gets the sentences the
    fine-tune's selection keeps (question: the last user turn, answer side: the chosen response), in the same
    context block; its tokens are the rebuilt prompt's. A pair without context keeps its prompt; off, nothing
    changes."""
    from raytrain.config import EnrichConfig
    from raytrain.enrich.batches import Scoring, select_conversations
    from raytrain.enrich.context import context_block

    facts = ("Bananas are rich in potassium. The Eiffel Tower was finished in 1889. Penguins cannot fly. "
             "The stock market fell on Tuesday.")
    context = [{"role": "system", "content": facts}, {"role": "user", "content": "When was the Eiffel Tower completed?"}]
    with_context = {**ROW, "context": context, "response1": "It was completed in 1889.",
                    "response2": "Towers are tall."}
    prepared = prepare([json.dumps(with_context), json.dumps(ROW)])
    scoring = Scoring.from_config(EnrichConfig(pair_context=True))
    out = finish_pairs_batch(prepared, tokenizer_version="v3", seq_len=512, length_policy="drop", scoring=scoring)
    assert out["status"].tolist() == ["ok", "ok"]
    expected = select_conversations([context], [context[-1]["content"]], ["It was completed in 1889."],
                                    **scoring.keywords())[0]
    assert "The Eiffel Tower was finished in 1889." in expected.kept and len(expected.kept) < 4
    pair = json.loads(out["pair_json"][0])
    assert [(m["role"], m.get("tool_calls") or []) for m in pair["prompt"]] == [("system", []), ("user", [])]
    assert pair["prompt"][0]["content"] == facts  # the system prompt verbatim (enrich.system_prompt keep)
    assert pair["prompt"][1]["content"] == context_block(expected.kept) + "\n\n" + context[1]["content"]
    assert out["context_sentences_kept"].tolist() == [len(expected.kept), 0]
    tokens = tokenize_pair("x", pair["prompt"], pair["chosen"], pair["rejected"], load_tokenizer("v3"))
    assert list(out["prompt_ids"][0]) == list(tokens.prompt)
    assert json.loads(out["pair_json"][1]) == json.loads(prepared["pair_json"][1])  # no context: unchanged
    off = finish_pairs_batch(prepared, tokenizer_version="v3", seq_len=512, length_policy="drop")
    assert off["pair_json"][0] == prepared["pair_json"][0] and off["context_sentences_kept"].tolist() == [0, 0]


def test_pair_context_from_a_corpus_goes_to_a_prompt_without_context_of_its_own():
    """With a corpus (enrich.context_corpus), a pair whose prompt has no context sentences gets the corpus sentence
    that answers it, in the fine-tune's context block, and trains on that prompt; an unrelated question gets
    nothing, and a pair with context of its own is not searched."""
    from raytrain.config import EnrichConfig
    from raytrain.enrich.batches import CorpusSearch, Scoring
    from raytrain.enrich.context import context_block
    from raytrain.enrich.corpus import CorpusIndex
    from raytrain.enrich.decontam import build_sorted_index
    from raytrain.enrich.relevance import embed_texts, load_embedder

    corpus = ["The Ostvik ferry leaves the north pier at seven every morning.",
              "Bakers in Quillan use rye flour from the valley mills."]
    emb, _ = embed_texts(corpus, load_embedder(None))
    index = CorpusIndex(doc_ids=["doc-0", "doc-1"], sentence_indices=np.arange(2), texts=corpus, emb=emb, key="t")
    ferry = {**ROW, "context": [{"role": "user", "content": "When does the Ostvik ferry leave?"}],
             "response1": "It leaves at seven in the morning.", "response2": "Ferries are boats."}
    tyre = {**ROW, "context": [{"role": "user", "content": "How do I fix a flat tyre?"}],
            "response1": "Patch the tube.", "response2": "Buy a car."}
    own = {**ROW, "context": [{"role": "system", "content": "Bakers in Quillan use rye flour. Penguins cannot fly."},
                              {"role": "user", "content": "What flour do Quillan bakers use?"}],
           "response1": "Rye flour.", "response2": "Sand."}
    prepared = prepare([json.dumps(ferry), json.dumps(tyre), json.dumps(own)])
    out = finish_pairs_batch(prepared, tokenizer_version="v3", seq_len=512, length_policy="drop",
                             scoring=Scoring.from_config(EnrichConfig(pair_context=True, top_k=1)),
                             corpus=CorpusSearch(index, build_sorted_index(set()), 13))
    assert out["status"].tolist() == ["ok", "ok", "ok"]
    assert out["corpus_sentences_added"].tolist() == [1, 0, 0]
    prompt = json.loads(out["pair_json"][0])["prompt"]
    assert prompt[-1]["content"] == context_block([corpus[0]]) + "\n\nWhen does the Ostvik ferry leave?"
    tokens = tokenize_pair("x", prompt, "It leaves at seven in the morning.", "Ferries are boats.", load_tokenizer("v3"))
    assert list(out["prompt_ids"][0]) == list(tokens.prompt)
    assert json.loads(out["pair_json"][1])["prompt"][-1]["content"] == "How do I fix a flat tyre?"
    assert out["context_sentences_kept"][2] == 1  # its own system prompt gave the context: the corpus was not asked
