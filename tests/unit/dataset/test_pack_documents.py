"""pack_documents / pack_batch (of tokenize_frame's ids): no token lost or duplicated, fixed shapes, labels per segment.

Reference for positions and labels: transformers' DataCollatorWithFlattening (padding-free packing with
positions restarting per sequence and unshifted labels, -100 at each sequence start).
"""

import json

import numpy as np
import pandas as pd
import pytest
from mistral_common.protocol.instruct.messages import AssistantMessage, UserMessage
from mistral_common.protocol.instruct.request import ChatCompletionRequest
from transformers import DataCollatorWithFlattening

from raytrain.dataset.pack import IGNORE_INDEX, PAD_SEGMENT_ID, pack_batch, pack_documents, tokenize_frame
from raytrain.dataset.tokenize import load_tokenizer
from raytrain.errors import RaytrainError

PAD_ID = 0


def make_docs(lengths, seed=0):
    """Documents whose token ids are globally unique (doc i, position j -> 1 + i * 10_000 + j)."""
    rng = np.random.default_rng(seed)
    docs = []
    for i, length in enumerate(lengths):
        ids = [1 + i * 10_000 + j for j in range(length)]
        mask = [bool(b) for b in rng.integers(0, 2, size=length)]
        docs.append((f"doc{i}", ids, mask))
    return docs


def real_segments(pack):
    """(segment id, input_ids, labels, position_ids) per real segment, read back from the pack."""
    out = []
    for segment in range(len(pack.doc_ids)):
        where = pack.segment_ids == segment
        out.append((segment, pack.input_ids[where], pack.labels[where], pack.position_ids[where]))
    return out


@pytest.mark.parametrize("max_open_packs", [1, 4])
def test_every_token_kept_once_with_fixed_shapes(max_open_packs):
    seq_len = 64
    docs = make_docs([5, 64, 30, 150, 1, 40, 63, 2, 129, 17, 33, 0, 20])
    packs = list(pack_documents(docs, seq_len, pad_id=PAD_ID, max_open_packs=max_open_packs))

    assert sum(len(ids) for _, ids, _ in docs) == sum(p.num_real_tokens for p in packs)
    all_real = np.concatenate([p.input_ids[p.segment_ids != PAD_SEGMENT_ID] for p in packs])
    expected = np.concatenate([np.asarray(ids) for _, ids, _ in docs if ids])
    np.testing.assert_array_equal(np.sort(all_real), np.sort(expected))  # no loss, no duplicate
    for p in packs:
        for array in (p.input_ids, p.labels, p.position_ids, p.segment_ids):
            assert array.shape == (seq_len,) and array.dtype == np.int64
        pad = p.segment_ids == PAD_SEGMENT_ID
        assert p.num_real_tokens == int((~pad).sum())
        assert (p.input_ids[pad] == PAD_ID).all() and (p.labels[pad] == IGNORE_INDEX).all()
        # Real tokens come first, segments contiguous and numbered 0, 1, ...
        assert not pad[: p.num_real_tokens].any()
        np.testing.assert_array_equal(np.unique(p.segment_ids[~pad]), np.arange(len(p.doc_ids)))
        assert (np.diff(p.segment_ids[~pad]) >= 0).all()


def test_sequential_keeps_order_and_first_fit_fills_holes():
    docs = make_docs([7, 8, 3])
    sequential = list(pack_documents(docs, 10, max_open_packs=1))
    first_fit = list(pack_documents(docs, 10, max_open_packs=2))
    assert [p.doc_ids for p in sequential] == [["doc0"], ["doc1"], ["doc2"]]
    assert [p.doc_ids for p in first_fit] == [["doc0", "doc2"], ["doc1"]]
    assert first_fit[0].num_real_tokens == 10


def test_positions_and_labels_match_transformers_flattening():
    seq_len = 48
    docs = make_docs([5, 12, 30, 1, 9, 20, 47, 3], seed=1)
    by_id = {doc_id: (ids, mask) for doc_id, ids, mask in docs}
    collator = DataCollatorWithFlattening(return_tensors="np", return_seq_idx=True)
    for pack in pack_documents(docs, seq_len, max_open_packs=3):
        features = [
            {"input_ids": by_id[d][0], "labels": [t if m else IGNORE_INDEX for t, m in zip(*by_id[d], strict=True)]}
            for d in pack.doc_ids
        ]
        flat = collator(features)
        n = pack.num_real_tokens
        np.testing.assert_array_equal(pack.input_ids[:n], flat["input_ids"][0])
        np.testing.assert_array_equal(pack.position_ids[:n], flat["position_ids"][0])
        np.testing.assert_array_equal(pack.segment_ids[:n], flat["seq_idx"][0])
        # Ours are pre-shifted: labels[t] is HF's (unshifted) label of t + 1; HF's -100 at each sequence
        # start becomes our -100 at each segment end, so no label crosses a document boundary.
        np.testing.assert_array_equal(pack.labels[:n], np.append(flat["labels"][0][1:], IGNORE_INDEX))


def test_labels_never_cross_segments():
    docs = make_docs([10, 10, 10, 25], seed=2)
    for pack in pack_documents(docs, 32):
        for t in np.flatnonzero(pack.labels != IGNORE_INDEX):
            assert pack.segment_ids[t + 1] == pack.segment_ids[t] != PAD_SEGMENT_ID
            assert pack.labels[t] == pack.input_ids[t + 1]
        for _, _, labels, positions in real_segments(pack):
            assert labels[-1] == IGNORE_INDEX
            np.testing.assert_array_equal(positions, np.arange(len(positions)))


def test_long_document_split_into_chunks_and_fully_kept():
    seq_len = 16
    (doc,) = make_docs([2 * seq_len + 5], seed=3)
    packs = list(pack_documents([doc], seq_len))
    assert [p.num_real_tokens for p in packs] == [16, 16, 5]
    assert all(p.doc_ids == ["doc0"] for p in packs)
    np.testing.assert_array_equal(np.concatenate([p.input_ids[: p.num_real_tokens] for p in packs]), np.asarray(doc[1]))
    for p in packs:  # each chunk is its own segment: positions restart, last label dropped
        np.testing.assert_array_equal(p.position_ids[: p.num_real_tokens], np.arange(p.num_real_tokens))
        assert p.labels[p.num_real_tokens - 1] == IGNORE_INDEX


def conversation(i):
    return [
        {"role": "user", "content": f"Question number {i}: what is {i} plus {i}?", "tool_calls": None},
        {"role": "assistant", "content": f"The answer is {2 * i}.", "tool_calls": None},
    ]


@pytest.mark.parametrize("version", ["v1", "v3"])
def test_pack_batch_shapes_and_content(version):
    seq_len = 64
    batch = pd.DataFrame(
        {"uuid": [f"u{i}" for i in range(9)], "messages_json": [json.dumps(conversation(i)) for i in range(9)]}
    )
    out = pack_batch(tokenize_frame(batch, version), seq_len, "drop")

    num_packs = len(out["doc_ids"])
    assert set(out) == {"input_ids", "labels", "position_ids", "segment_ids", "doc_ids", "num_tokens", "num_targets"}
    for key in ("input_ids", "labels", "position_ids", "segment_ids"):
        assert out[key].shape == (num_packs, seq_len) and out[key].dtype == np.int64
    assert out["num_tokens"].shape == (num_packs,) and out["num_tokens"].dtype == np.int64
    assert (out["num_targets"] == (out["labels"] != -100).sum(axis=1)).all() and out["num_targets"].sum() > 0
    assert sorted(u for ids in out["doc_ids"] for u in ids.split(",")) == sorted(batch["uuid"])

    # Tokens equal mistral-common's own encoding of each conversation, in pack order.
    tokenizer = load_tokenizer(version)
    reference = {
        f"u{i}": tokenizer.encode_chat_completion(
            ChatCompletionRequest(
                messages=[
                    UserMessage(content=conversation(i)[0]["content"]),
                    AssistantMessage(content=f"The answer is {2 * i}."),
                ]
            )
        ).tokens
        for i in range(9)
    }
    assert out["num_tokens"].sum() == sum(len(ids) for ids in reference.values())
    for row in range(num_packs):
        for segment, uuid in enumerate(out["doc_ids"][row].split(",")):
            where = out["segment_ids"][row] == segment
            assert out["input_ids"][row][where].tolist() == reference[uuid]
            targets = out["labels"][row][where]
            # Decoding the targets gives back exactly the assistant reply.
            i = int(uuid[1:])
            assert tokenizer.decode(targets[targets != IGNORE_INDEX].tolist()) == f"The answer is {2 * i}."


def test_pack_batch_empty_and_bad_rows():
    empty = pack_batch(tokenize_frame(pd.DataFrame({"uuid": [], "messages_json": []}), "v3"), 32, "drop")
    assert empty["input_ids"].shape == (0, 32) and empty["doc_ids"].shape == (0,)
    bad = pd.DataFrame({"uuid": ["ok", "bad"], "messages_json": [json.dumps(conversation(1)), json.dumps([])]})
    with pytest.raises(RaytrainError, match=r"uuid='bad' \(row 1\)"):
        tokenize_frame(bad, "v3")
    with pytest.raises(RaytrainError, match=r"missing column\(s\) \['input_ids', 'loss_mask'\].*re-run the enrichment"):
        pack_batch(bad, 32, "drop")  # enriched rows from before token ids were stored
