"""Context from a document corpus, the pure part: which files, their hashes, documents -> sentences, and search.

Rows with no context of their own (single turn, empty or toggle-only system prompt: most of Nemotron) get the
corpus sentences that score highest with the selection's own score,

    score(s) = w * cos(s, question) + (1 - w) * cos(s, answer)  =  s . (w * q + (1 - w) * a)

for unit vectors s, q, a: one inner product with one query vector per row, so one search per row. The search is
exact (``exact_top_k``: blocked matrix products) up to ``enrich.corpus_exact_max_sentences`` sentences and a faiss
HNSW index above (``build_ann``); either way the kept sentences' three scores are recomputed exactly from the
embeddings, so the audit columns never carry an approximate number.

No Spark here (raytrain.enrich.corpus_table builds the sentence table in Spark; passes.corpus_context wires the
search); files are read through raytrain.storage, so local paths, file:// and s3:// work alike.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pyarrow.parquet as pq

from raytrain.enrich.context import prose_units
from raytrain.enrich.sentences import split_sentences
from raytrain.errors import RaytrainError
from raytrain.storage import StorageLocation, resolve

CORPUS_FORMAT = 1
"""Bump when the splitting or the table's columns change: cached tables of another format are rebuilt."""
FORMATS = {".parquet": "parquet", ".jsonl": "json", ".json": "json"}
SAMPLE_CORPUS = ("corpus", "documents.jsonl")
"""Where the sample dataset keeps its corpus (enrich.context_corpus=[sample])."""
_BLOCK_ROWS = 32_768  # corpus rows per matrix product: (B, 32768) float32 scores stay small for any batch


@dataclass(frozen=True)
class CorpusFile:
    loc: StorageLocation
    fmt: str
    """"parquet" or "json" (JSON lines)."""
    sha256: str
    records: int
    """Rows (Parquet footer) or non-empty lines (JSONL)."""


def _corpus_files(spec: str, i: int, input_root: StorageLocation | None, s3_endpoint: str | None
                  ) -> list[StorageLocation]:
    field = f"enrich.context_corpus[{i}]"
    if spec == "sample":
        if input_root is None:
            raise RaytrainError(f"{field}: 'sample' needs the sample dataset as input.path")
        loc = input_root.join(*SAMPLE_CORPUS)
    else:
        loc = resolve(spec, s3_endpoint=s3_endpoint)
    if loc.is_dir():
        files = [loc.join(n) for n in sorted(loc.listdir()) if os.path.splitext(n)[1].lower() in FORMATS]
        if not files:
            raise RaytrainError(f"{field}: folder {loc.uri} holds no .parquet, .jsonl or .json files (found: "
                                f"{sorted(loc.listdir())[:10]}). Fix: point it at the corpus files or their folder.")
        return files
    if not loc.is_file():
        raise RaytrainError(f"{field}: {loc.uri} does not exist. Fix: point enrich.context_corpus at Parquet or "
                            "JSONL document files (or a folder of them), or leave it empty to turn the corpus off.")
    if os.path.splitext(loc.name)[1].lower() not in FORMATS:
        raise RaytrainError(f"{field}: {loc.uri} is neither .parquet nor .jsonl/.json. Fix: convert the documents "
                            "to Parquet or JSON lines with an id and a text field.")
    return [loc]


CHECKED_RECORDS = 1_000
"""JSONL records per file whose fields are checked on the driver (a record further on without them gives a
document without sentences, counted in the report)."""


def _sha256(loc: StorageLocation) -> str:
    h = hashlib.sha256()
    with loc.open_input() as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()


def _check_file(loc: StorageLocation, id_field: str, text_field: str) -> CorpusFile:
    """Hash the file (streamed) and check its fields: Parquet from the footer's schema, JSONL on its first
    CHECKED_RECORDS records (every line is counted)."""
    fmt = FORMATS[os.path.splitext(loc.name)[1].lower()]
    fix = (f"Fix: set enrich.corpus_id_field / enrich.corpus_text_field to the file's fields "
           f"(now {id_field!r} / {text_field!r}).")
    try:
        sha = _sha256(loc)
        if fmt == "parquet":
            with loc.filesystem.open_input_file(loc.path) as f:
                try:
                    pf = pq.ParquetFile(f)
                except Exception as e:  # pyarrow raises ArrowInvalid and friends for a file that is not Parquet
                    raise RaytrainError(f"enrich.context_corpus: {loc.uri} is not a readable Parquet file "
                                        f"({e})") from e
                names, rows = pf.schema_arrow.names, pf.metadata.num_rows
            missing = [f for f in (id_field, text_field) if f not in names]
            if missing:
                raise RaytrainError(f"enrich.context_corpus: {loc.uri} has no field(s) {missing} (it has "
                                    f"{names}). {fix}")
            return CorpusFile(loc, fmt, sha, rows)
        records = 0
        with loc.open_input(text=True) as f:
            for lineno, line in enumerate(f, 1):
                if not line.strip():
                    continue
                records += 1
                if records > CHECKED_RECORDS:
                    continue
                try:
                    record = json.loads(line)
                except json.JSONDecodeError as e:
                    raise RaytrainError(f"enrich.context_corpus: {loc.uri}:{lineno}: not valid JSON ({e.msg}). Fix: "
                                        "one JSON object per line.") from e
                missing = [k for k in (id_field, text_field) if not isinstance(record, dict) or k not in record]
                if missing:
                    have = sorted(record) if isinstance(record, dict) else type(record).__name__
                    raise RaytrainError(f"enrich.context_corpus: {loc.uri}:{lineno}: field(s) {missing} missing "
                                        f"(record has {have}). {fix}")
        return CorpusFile(loc, fmt, sha, records)
    except (OSError, UnicodeDecodeError) as e:
        raise RaytrainError(f"enrich.context_corpus: cannot read {loc.uri} ({e}). Fix: check the path, its "
                            "permissions and encoding (UTF-8); on s3, the credentials and storage.s3_endpoint.") from e


def check_corpus(specs: Sequence[str], id_field: str, text_field: str, input_root: StorageLocation | None = None,
                 s3_endpoint: str | None = None) -> list[CorpusFile]:
    """enrich.context_corpus -> its files, hashed and checked, before any JVM starts.

    Raises RaytrainError naming the path (and line) and the fix for a missing or unreadable file, a folder
    without corpus files, a missing id/text field, or a corpus without a single document."""
    files = [_check_file(loc, id_field, text_field)
             for i, spec in enumerate(specs) for loc in _corpus_files(spec, i, input_root, s3_endpoint)]
    if not sum(f.records for f in files):
        raise RaytrainError(f"enrich.context_corpus: no documents in {[f.loc.uri for f in files]} (empty files). "
                            "Fix: point it at a non-empty corpus, or leave it empty to turn the corpus off.")
    return files


def model_hash(model_dir: str) -> str:
    """sha256 over the model directory's files (relative path + content): a changed model re-embeds the corpus."""
    h = hashlib.sha256()
    for root, dirs, names in os.walk(model_dir):
        dirs.sort()
        for name in sorted(names):
            path = os.path.join(root, name)
            h.update(os.path.relpath(path, model_dir).encode() + b"\0")
            with open(path, "rb") as f:
                for chunk in iter(lambda: f.read(1 << 20), b""):
                    h.update(chunk)
    return h.hexdigest()


def corpus_key(files: Sequence[CorpusFile], id_field: str, text_field: str, model_sha256: str) -> str:
    """The cached table's key: the corpus files' content hashes (in order), the fields, the model's hash and
    CORPUS_FORMAT. 24 hex digits; the folder data/corpus/<key>/ holds the table."""
    payload = json.dumps({"format": CORPUS_FORMAT, "files": [f.sha256 for f in files], "id": id_field,
                          "text": text_field, "model": model_sha256}, sort_keys=True)
    return hashlib.sha256(payload.encode()).hexdigest()[:24]


def document_sentences(text: str | None) -> list[tuple[int, str]]:
    """A document -> [(sentence index, sentence)]: raytrain.enrich.sentences units that are prose (the same rule
    as a row's own context: no JSON, markup or code, at least three words). The index is the unit's position in
    the document, so gaps show where non-prose units were."""
    units = split_sentences(text or "")
    keep = set(prose_units(units))
    return [(i, u) for i, u in enumerate(units) if u in keep]


# ---- search ------------------------------------------------------------------------------------------------------
def query_vectors(q: np.ndarray, a: np.ndarray, question_weight: float) -> np.ndarray:
    """(N, d) unit question and answer embeddings -> (N, d) w*q + (1-w)*a: s . query is the combined score."""
    return (question_weight * q + (1.0 - question_weight) * a).astype(np.float32)


def exact_top_k(queries: np.ndarray, emb: np.ndarray, k: int, block_rows: int = _BLOCK_ROWS
                ) -> tuple[np.ndarray, np.ndarray]:
    """Exact inner-product top-k: (N, d) queries, (M, d) rows -> (N, k') scores and indices, best first
    (k' = min(k, M); ties by the smaller index), one (N, block) product per block of rows."""
    n, m = queries.shape[0], emb.shape[0]
    k = min(k, m)
    best_s = np.full((n, 0), -np.inf, dtype=np.float32)
    best_i = np.zeros((n, 0), dtype=np.int64)
    for start in range(0, m, block_rows):
        scores = queries @ emb[start : start + block_rows].T  # (N, b)
        kk = min(k, scores.shape[1])
        part = np.argpartition(-scores, kk - 1, axis=1)[:, :kk]  # (N, kk) unordered
        best_s = np.concatenate([best_s, np.take_along_axis(scores, part, axis=1)], axis=1)
        best_i = np.concatenate([best_i, part + start], axis=1)
        order = np.lexsort((best_i, -best_s), axis=1)[:, :k]  # by score descending, then index
        best_s, best_i = np.take_along_axis(best_s, order, axis=1), np.take_along_axis(best_i, order, axis=1)
    return best_s, best_i


HNSW_M = 32
HNSW_EF_CONSTRUCTION = 80
HNSW_EF_SEARCH = 128


def build_ann(emb: np.ndarray) -> np.ndarray:
    """A faiss HNSW inner-product index over (M, d) unit rows, serialized to a uint8 array (what is broadcast)."""
    import faiss

    index = faiss.IndexHNSWFlat(emb.shape[1], HNSW_M, faiss.METRIC_INNER_PRODUCT)
    index.hnsw.efConstruction = HNSW_EF_CONSTRUCTION
    index.add(np.ascontiguousarray(emb, dtype=np.float32))
    return faiss.serialize_index(index)


_ANN_CACHE: dict[str, Any] = {}


def ann_top_k(queries: np.ndarray, serialized: np.ndarray, key: str, k: int) -> tuple[np.ndarray, np.ndarray]:
    """Approximate top-k with a serialized HNSW index (deserialized once per process, cached by ``key``);
    (N, k) scores and indices, -1 where the index found fewer."""
    import faiss

    index = _ANN_CACHE.get(key)
    if index is None:
        index = _ANN_CACHE[key] = faiss.deserialize_index(serialized)
        index.hnsw.efSearch = max(HNSW_EF_SEARCH, k)
    scores, idx = index.search(np.ascontiguousarray(queries, dtype=np.float32), k)
    return scores, idx.astype(np.int64)


def recall_at_k(exact_idx: np.ndarray, approx_idx: np.ndarray) -> float:
    """Mean over rows of |approx top-k ∩ exact top-k| / |exact top-k| (rows with no exact result skipped)."""
    hits = total = 0
    for e, a in zip(exact_idx, approx_idx, strict=True):
        e = {int(x) for x in e if x >= 0}
        hits += len(e & {int(x) for x in a if x >= 0})
        total += len(e)
    return hits / total if total else 1.0


@dataclass
class CorpusIndex:
    """What every executor needs to search the corpus: the searchable sentences (table order = document order:
    doc id, then sentence index) and their (M, d) unit embeddings, plus the serialized ANN index when used."""

    doc_ids: list[str]
    sentence_indices: np.ndarray  # (M,) int64
    texts: list[str]
    emb: np.ndarray  # (M, d) float32, unit rows
    key: str
    ann: np.ndarray | None = None  # faiss.serialize_index bytes as uint8
    stats: dict[str, Any] = field(default_factory=dict)

    @property
    def method(self) -> str:
        return "approximate" if self.ann is not None else "exact"

    def top_k(self, queries: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        if not len(self.texts):
            return np.zeros((len(queries), 0), np.float32), np.zeros((len(queries), 0), np.int64)
        if self.ann is not None:
            return ann_top_k(queries, self.ann, self.key, k)
        return exact_top_k(queries, self.emb, k)


@dataclass(frozen=True)
class Retrieved:
    """One row's corpus context: the kept sentences' table indices in document order and their three scores."""

    indices: tuple[int, ...]
    scores: tuple[float, ...]
    q_scores: tuple[float, ...]
    a_scores: tuple[float, ...]


def retrieve(index: CorpusIndex, q: np.ndarray, a: np.ndarray, top_k: int, min_score: float,
             question_weight: float) -> list[Retrieved]:
    """(N, d) unit question / answer embeddings -> per row, the top_k sentences by the combined score with a
    score >= min_score, in document order, with exact scores recomputed from the embeddings."""
    if not len(q):
        return []
    _, cand = index.top_k(query_vectors(q, a, question_weight), top_k)  # (N, k)
    out = []
    for row, ids in enumerate(cand):
        ids = np.asarray(sorted({int(i) for i in ids if i >= 0}), dtype=np.int64)
        qs = index.emb[ids] @ q[row] if len(ids) else np.zeros(0, np.float32)
        as_ = index.emb[ids] @ a[row] if len(ids) else np.zeros(0, np.float32)
        s = (question_weight * qs + (1.0 - question_weight) * as_).astype(np.float32)
        keep = s >= min_score
        out.append(Retrieved(tuple(int(i) for i in ids[keep]), tuple(float(x) for x in s[keep]),
                             tuple(float(x) for x in qs[keep]), tuple(float(x) for x in as_[keep])))
    return out
