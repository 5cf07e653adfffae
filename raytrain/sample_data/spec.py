"""The numbers that shape the sample dataset, and where its files go.

Limits shared with the enrich stage (``MAX_CHARS``, the allowed licenses, the n-gram and near-duplicate
settings the answer key is written for), how many rows of each quarantine reason get planted, the dataset
card's bytes per row and the lognormal that row lengths are drawn from, the hub's shard layout
(``shard_names``), and ``SampleManifest``, what ``write_sample_dataset`` returns. Re-exported by the package.
"""

from __future__ import annotations

from dataclasses import dataclass

from raytrain.config import SPLITS, EnrichConfig

MAX_CHARS = EnrichConfig().max_chars  # the too_long rows exceed it
ALLOWED_LICENSES = EnrichConfig().licenses
DISALLOWED_LICENSES = ("cc-by-nc-4.0", "proprietary", "CC-BY-NC-SA-4.0")
QUARANTINE_PER_REASON = 2
NGRAM = 13
NEAR_DUP_THRESHOLD = 0.8
MIN_ROWS_PER_SPLIT = 20
DEFAULT_ROWS_PER_SPLIT = 64
DEFAULT_SIZE_SCALE = 0.04
CARD_BYTES_PER_ROW = {"chat": 5_120, "code": 48_200, "math": 38_700, "stem": 15_950, "tool_calling": 20_640}
"""Uncompressed bytes per row of each split on the dataset card (num_bytes / num_rows)."""
LENGTH_SIGMA = 0.9
"""Sigma of the lognormal row lengths: p99 is exp(2.33 * 0.9 - 0.9**2 / 2) ~ 5x the mean, 8x the median."""
MAX_LENGTH_QUANTILE = 0.995
"""The longest row is drawn at most at this quantile (~7x the mean), so one row cannot swing a split's mean."""
FILE_PREFIX = {"chat": "chat", "code": "code", "math": "math", "stem": "stem", "tool_calling": "tool"}
NUM_SHARDS = {"chat": 2, "code": 2, "math": 1, "stem": 1, "tool_calling": 1}
CONTEXT_SPLITS = ("chat", "stem")
MAX_ROW_SIMILARITY = 0.5
"""Ordinary rows stay below this character-5-gram Jaccard with every other row of their split (dedup flags 0.8
and above), so the planted pairs are the only near-duplicates."""


@dataclass(frozen=True)
class SampleManifest:
    """Where write_sample_dataset put things, and how much."""

    out_dir: str
    """The dataset root."""
    seed: int
    """The seed the rows were generated from."""
    rows_per_split: int
    """Rows in each split (over all its shards), planted rows included."""
    size_scale: float
    """Mean row length as a fraction of the dataset card's bytes per row."""
    split_files: dict[str, list[str]]
    """split name -> paths of its Parquet shards (``<out_dir>/data/<prefix>-NNNNN-of-NNNNN.parquet``), in name order."""
    eval_path: str
    """The eval set (JSONL with id, question, answer)."""
    planted_path: str
    """planted.json, the answer key."""
    num_bytes: int
    """Total size of the files written."""

    def all_files(self) -> list[str]:
        """Every split's shards: chat, code, math, stem, tool (the hub's name order)."""
        return [p for split in SPLITS for p in self.split_files[split]]


def shard_names(split: str) -> list[str]:
    """The file names of a split's shards, relative to the dataset root (``data/tool-00000-of-00001.parquet``)."""
    n = NUM_SHARDS[split]
    return [f"data/{FILE_PREFIX[split]}-{i:05d}-of-{n:05d}.parquet" for i in range(n)]
