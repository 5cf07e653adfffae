"""Synthetic conversations and the packed training data made from them, for tests that train without Spark (shared
test helpers): the rows go in as the enrich stage writes them (uuid, token ids, loss mask), and Ray Data packs them
into a run's data folder under the run's data hash, where runner.run_train looks."""

from __future__ import annotations

import json
import os
import random

import pyarrow as pa
import pyarrow.parquet as pq

from raytrain.dataset.pack import tokenize_frame
from raytrain.storage import StorageLocation, resolve

WORDS = ("alpha beta gamma delta epsilon zeta theta kappa lambda sigma omega river stone cloud field light "
         "number graph vector matrix proof lemma train model token batch").split()
SHORT = {"question_words": (4, 10), "answer_words": (8, 32)}
"""Lengths that keep every conversation under 128 tokens, whatever the seed (at most ~100 with the v1 or v3 tokenizer,
every word at its longest, 3 tokens): for dataset.length_policy=drop at seq_len 128, where packing refuses a longer
conversation (the enrich stage would have dropped it)."""


def synthetic_conversations(n: int, seed: int = 0, uuid_prefix: str = "conv", question_words: tuple[int, int] = (4, 30),
                            answer_words: tuple[int, int] = (8, 90)) -> pa.Table:
    """`n` conversations (uuid, messages_json): a system context, a question and an answer of words drawn from WORDS,
    their lengths uniform in the given ranges (inclusive); deterministic for a seed. uuids are
    `<uuid_prefix>-00000`, `-00001`, ... The default lengths give ~20 to ~180 tokens, some longer than a 128-token
    pack (train those with dataset.length_policy=split); SHORT keeps every one inside it."""
    rng = random.Random(seed)
    uuids, messages_json = [], []
    for i in range(n):
        question = " ".join(rng.choice(WORDS) for _ in range(rng.randint(*question_words)))
        answer = " ".join(rng.choice(WORDS) for _ in range(rng.randint(*answer_words)))
        messages = [{"role": "system", "content": f"Context:\nfact {i}", "tool_calls": []},
                    {"role": "user", "content": f"Q{i}: {question}?", "tool_calls": []},
                    {"role": "assistant", "content": answer, "tool_calls": []}]
        uuids.append(f"{uuid_prefix}-{i:05d}")
        messages_json.append(json.dumps(messages))
    return pa.table({"uuid": uuids, "messages_json": messages_json})


def write_enriched(folder: StorageLocation | str | os.PathLike, conversations: pa.Table,
                   tokenizer: str) -> StorageLocation:
    """`conversations` tokenized with `tokenizer` (a dataset.tokenizer version) into `folder`/part-00000.parquet, the
    enrich stage's output schema; returns the folder."""
    loc = folder if isinstance(folder, StorageLocation) else resolve(os.fspath(folder))
    loc.mkdirs()
    rows = tokenize_frame(conversations.to_pandas(), tokenizer)
    pq.write_table(pa.Table.from_pandas(rows, preserve_index=False), loc.join("part-00000.parquet").path,
                   filesystem=loc.filesystem)
    return loc


def write_packed(job, conversations: pa.Table, enriched: StorageLocation | str | os.PathLike | None = None):
    """`conversations` tokenized (into `enriched`, by default the run's data/synthetic_enriched) and packed by Ray Data
    into the run's data/packed under its data hash; returns the PackedData. Needs a running Ray (this process's)."""
    from raytrain.dataset.stream import pack_enriched
    from raytrain.runner import open_run

    run = open_run(job)
    folder = write_enriched(run.root.join("data", "synthetic_enriched") if enriched is None else enriched,
                            conversations, job.dataset.tokenizer)
    return pack_enriched(folder, run.root.join("data", "packed"), job.dataset, run.data_hash)
