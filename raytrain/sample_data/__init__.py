"""A small synthetic dataset shaped like nvidia/Nemotron-Post-Training-Dataset-v1, with an answer key.

The real dataset is not downloaded at run time, so demos and tests run on this. Written, as the hub
publishes the real one (tool_calling's files are ``tool-*``):

    <out_dir>/data/chat-00000-of-00002.parquet, chat-00001-of-00002.parquet, code-0000{0,1}-of-00002.parquet,
                   math-00000-of-00001.parquet, stem-00000-of-00001.parquet, tool-00000-of-00001.parquet
    <out_dir>/eval/eval_set.jsonl          the eval set to decontaminate against ({"id", "question", "answer"})
    <out_dir>/planted.json                 the answer key: every planted row, by split, file, row in file, uuid
    <out_dir>/corpus/documents.jsonl       a small document corpus for enrich.context_corpus=[sample], with its
                                           answer key corpus/planted.json (raytrain.sample_data.corpus)

Rows (schema ``NEMOTRON_V1_SCHEMA``) look like the real ones: reasoning "on" rows end in an assistant turn
``<think>\\n<trace>\\n</think>\\n\\n<answer>``, "off" rows carry no trace; system prompts are often absent or
empty, or a reasoning toggle ("detailed thinking on" / "/think", "detailed thinking off" / "/no_think"); tool
calling rows list their tools as JSON in the system prompt and answer tool calls with tool-role turns (reasoning
rows also put a ``<think>`` trace in the turn that calls the tool); ``metadata`` is a JSON string. Chat is
mostly single-turn with some multi-turn, code has code-runner calls, math a calculator, stem multiple-choice
questions. Context rows (chat and stem) hold a background paragraph in the system prompt where exactly one
sentence answers the last question and the others are distractors.

Lengths: each row's target length in characters (all message text plus tool-call arguments) is drawn from a
lognormal (sigma ``LENGTH_SIGMA``) whose mean is the split's bytes per row on the dataset card times
``size_scale``, so code > math > tool_calling > stem > chat as in the card, with a long tail (p99 ~8x the
median). The draw is stratified, one quantile band per row, capped at ``MAX_LENGTH_QUANTILE``, so a split's mean
lands near its target even with 60 rows. A row grows to its target with generated sentences, in its ``<think>``
trace when reasoning is on, in its explanation when off; every sentence carries fresh names and numbers from the
rng, and a row still within ``MAX_ROW_SIMILARITY`` (character 5-gram Jaccard) of an earlier row of its split gets
more of them, so no two ordinary rows come near the dedup threshold. No filler shares a 13-word n-gram with the
eval set. Rows whose template is already longer than the drawn length stay as they are: at the default
``size_scale`` chat ends ~2x and tool_calling ~1.5x above their share of the card.

Planted (the answer key): exact duplicates (case/whitespace changed), near-duplicates (two words of the
background changed), eval-contaminated rows (a whole eval question inside), a near miss (12 words of one: not
contaminated at n=13), non-allowed licenses, and malformed rows, a known number for each quarantine reason
(the ``too_long`` ones exceed ``EnrichConfig().max_chars`` with a repeated paragraph that compresses to little).
Same (seed, rows_per_split, size_scale), same bytes: one ``random.Random(seed)`` drives everything.

    python -m raytrain.sample_data OUT_DIR [--seed 0] [--rows-per-split 64] [--size-scale 0.04]
"""

from __future__ import annotations

import argparse
import json
import os

import pyarrow as pa
import pyarrow.parquet as pq

from raytrain.config import SPLITS
from raytrain.enrich.schema import NEMOTRON_V1_SCHEMA
from raytrain.errors import RaytrainError
from raytrain.sample_data.corpus import KEY as CORPUS_KEY
from raytrain.sample_data.corpus import load_corpus_key, write_sample_corpus
from raytrain.sample_data.planted import _REASONS, _eval_items, _split_rows
from raytrain.sample_data.rows import _Gen
from raytrain.sample_data.spec import (
    ALLOWED_LICENSES,
    CARD_BYTES_PER_ROW,
    CONTEXT_SPLITS,
    DEFAULT_ROWS_PER_SPLIT,
    DEFAULT_SIZE_SCALE,
    DISALLOWED_LICENSES,
    FILE_PREFIX,
    LENGTH_SIGMA,
    MAX_CHARS,
    MAX_LENGTH_QUANTILE,
    MAX_ROW_SIMILARITY,
    MIN_ROWS_PER_SPLIT,
    NEAR_DUP_THRESHOLD,
    NGRAM,
    NUM_SHARDS,
    QUARANTINE_PER_REASON,
    SampleManifest,
    shard_names,
)

__all__ = [
    "ALLOWED_LICENSES",
    "CARD_BYTES_PER_ROW",
    "CONTEXT_SPLITS",
    "DEFAULT_ROWS_PER_SPLIT",
    "DEFAULT_SIZE_SCALE",
    "DISALLOWED_LICENSES",
    "FILE_PREFIX",
    "LENGTH_SIGMA",
    "MAX_CHARS",
    "MAX_LENGTH_QUANTILE",
    "MAX_ROW_SIMILARITY",
    "MIN_ROWS_PER_SPLIT",
    "NEAR_DUP_THRESHOLD",
    "NGRAM",
    "NUM_SHARDS",
    "QUARANTINE_PER_REASON",
    "SampleManifest",
    "load_planted",
    "main",
    "shard_names",
    "write_sample_dataset",
    "write_sample_corpus",
    "load_corpus_key",
]


def write_sample_dataset(out_dir: str, seed: int = 0, rows_per_split: int = DEFAULT_ROWS_PER_SPLIT,
                         size_scale: float = DEFAULT_SIZE_SCALE) -> SampleManifest:
    """Write the sample dataset, its eval set and planted.json under ``out_dir``; return where.

    ``size_scale`` sets the mean row length to that fraction of the dataset card's bytes per row (0.04: chat ~200
    characters, code ~1,900). Deterministic: the same (seed, rows_per_split, size_scale) writes byte-identical
    files. Existing files are replaced.
    """
    if rows_per_split < MIN_ROWS_PER_SPLIT:
        raise RaytrainError(f"rows_per_split must be >= {MIN_ROWS_PER_SPLIT} to fit the planted rows, got {rows_per_split}")
    if not size_scale > 0:
        raise RaytrainError(f"size_scale must be > 0 (a fraction of the card's bytes per row), got {size_scale}")
    gen = _Gen(seed, size_scale)
    eval_items = _eval_items(gen, 8)
    planted: dict = {
        "seed": seed, "rows_per_split": rows_per_split, "size_scale": size_scale, "max_chars": MAX_CHARS,
        "ngram": NGRAM, "near_dup_threshold": NEAR_DUP_THRESHOLD, "allowed_licenses": list(ALLOWED_LICENSES),
        "quarantine": [], "quarantine_counts": {r: QUARANTINE_PER_REASON for r in _REASONS},
        "exact_duplicates": [], "near_duplicates": [], "contaminated": [], "not_contaminated": [],
        "disallowed_license": [], "context_answers": [],
        "files": {split: shard_names(split) for split in SPLITS},
    }
    split_rows = {split: _split_rows(gen, split, s_idx, rows_per_split, eval_items) for s_idx, split in enumerate(SPLITS)}

    os.makedirs(os.path.join(out_dir, "data"), exist_ok=True)
    split_files: dict[str, list[str]] = {}
    num_bytes = 0
    for split, rows in split_rows.items():
        names = shard_names(split)
        split_files[split] = []
        for k, name in enumerate(names):
            shard = rows[k * len(rows) // len(names) : (k + 1) * len(rows) // len(names)]
            for idx, (row, kind, key) in enumerate(shard):
                if kind:
                    planted[kind].append({"split": split, "file": name, "row": idx, "uuid": row["uuid"], **key})
            path = os.path.join(out_dir, name)
            pq.write_table(pa.Table.from_pylist([r for r, _, _ in shard], schema=NEMOTRON_V1_SCHEMA), path,
                           compression="zstd")
            split_files[split].append(path)
            num_bytes += os.path.getsize(path)
    eval_path = os.path.join(out_dir, "eval", "eval_set.jsonl")
    os.makedirs(os.path.dirname(eval_path), exist_ok=True)
    with open(eval_path, "w", encoding="utf-8") as f:
        f.writelines(json.dumps(item, sort_keys=True) + "\n" for item in eval_items)
    planted_path = os.path.join(out_dir, "planted.json")
    with open(planted_path, "w", encoding="utf-8") as f:
        json.dump(planted, f, indent=1, sort_keys=True)
    num_bytes += os.path.getsize(eval_path) + os.path.getsize(planted_path)
    corpus_path = write_sample_corpus(out_dir, split_files, eval_path, seed=seed)  # enrich.context_corpus=[sample]
    num_bytes += os.path.getsize(corpus_path) + os.path.getsize(os.path.join(os.path.dirname(corpus_path), CORPUS_KEY))
    return SampleManifest(out_dir, seed, rows_per_split, size_scale, split_files, eval_path, planted_path, num_bytes)


def load_planted(out_dir: str) -> dict:
    """The answer key written by write_sample_dataset."""
    with open(os.path.join(out_dir, "planted.json"), encoding="utf-8") as f:
        return json.load(f)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m raytrain.sample_data", description=__doc__.split("\n")[0])
    parser.add_argument("out_dir")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--rows-per-split", type=int, default=DEFAULT_ROWS_PER_SPLIT)
    parser.add_argument("--size-scale", type=float, default=DEFAULT_SIZE_SCALE,
                        help="mean row length as a fraction of the dataset card's bytes per row")
    args = parser.parse_args(argv)
    m = write_sample_dataset(args.out_dir, seed=args.seed, rows_per_split=args.rows_per_split,
                             size_scale=args.size_scale)
    print(f"wrote {len(m.all_files())} files, {len(m.split_files)} splits x {m.rows_per_split} rows "
          f"({m.num_bytes} bytes) to {m.out_dir}; answer key {m.planted_path}, eval set {m.eval_path}")
    return 0
