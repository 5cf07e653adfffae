"""What an enrichment reads, checked before Spark starts: the input files (layout, footers), the eval sets and
their n-gram index, the context corpus files. Seconds of footer and file reads; every bad input fails here with its
path and a fix, before a JVM starts."""

from __future__ import annotations

import hashlib
import os
import tempfile
from dataclasses import dataclass, field
from typing import Any

from raytrain.config import JobConfig
from raytrain.enrich.corpus import CorpusFile, check_corpus
from raytrain.enrich.decontam import build_eval_index, eval_text, iter_eval_records
from raytrain.enrich.inputs import InputFiles, discover_inputs, validate_inputs
from raytrain.errors import RaytrainError
from raytrain.storage import StorageLocation, resolve


@dataclass(frozen=True)
class EvalSets:
    """Decontamination input: the eval texts and where they came from."""

    texts: list[str]
    sources: list[dict[str, Any]]  # {"uri", "sha256", "items"} per file
    records: list[dict[str, Any] | str] = field(default_factory=list)
    """The items as read (records, or plain-text lines), parallel to ``texts``: the benchmark loss formats the
    question/answer records as conversations (raytrain.dataset.stream.pack_benchmark)."""


def load_eval_texts(eval_sets: tuple[str, ...], input_root: StorageLocation, s3_endpoint: str | None) -> EvalSets:
    """Read the eval files (paths or URIs; 'sample' = the input's eval/eval_set.jsonl); object-store files are
    copied to a temp dir first because decontam.iter_eval_records reads local files."""
    texts: list[str] = []
    records: list[dict[str, Any] | str] = []
    sources: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="raytrain-eval-") as tmp:
        for i, spec in enumerate(eval_sets):
            loc = input_root.join("eval", "eval_set.jsonl") if spec == "sample" else resolve(spec, s3_endpoint=s3_endpoint)
            if not loc.is_file():
                raise RaytrainError(f"enrich.eval_sets[{i}]: {loc.uri} is not a file. Fix: point it at a JSONL, "
                                    "Parquet or text eval file, or drop it.")
            data = loc.read_bytes()
            local = loc.path if loc.is_posix else os.path.join(tmp, f"{i}-{loc.name}")
            if not loc.is_posix:
                with open(local, "wb") as f:
                    f.write(data)
            items = list(iter_eval_records([local]))
            texts.extend(eval_text(record, None, where) for where, record in items)
            records.extend(record for _, record in items)
            sources.append({"uri": loc.uri, "sha256": hashlib.sha256(data).hexdigest(), "items": len(items)})
    return EvalSets(texts, sources, records)


@dataclass(frozen=True)
class EnrichPlan:
    """What an enrichment reads, checked before Spark starts: the input files and their footers, the eval sets
    and their n-gram index, the corpus files."""

    inputs: InputFiles
    footers: dict[str, dict[str, Any]]
    """Per split: rows and the Arrow schema, from the Parquet footers."""
    rows_per_split: dict[str, int]
    """Rows the enrichment reads per split (input.max_rows applied)."""
    evals: EvalSets
    eval_index: set[int]
    """The eval sets' n-gram hashes (decontam.build_eval_index)."""
    corpus_files: list[CorpusFile] | None

    @property
    def rows_in(self) -> int:
        return sum(self.rows_per_split.values())


def plan_enrichment(job: JobConfig, input_root: StorageLocation, eval_sets: tuple[str, ...] | None = None
                    ) -> EnrichPlan:
    """Discover and validate the inputs (footers only), read the eval sets, check the corpus files: seconds, and
    every bad input fails here with its path and a fix. ``eval_sets`` overrides ``job.enrich.eval_sets``."""
    cfg = job.enrich
    inputs = discover_inputs(input_root, job.input.splits)
    footers = validate_inputs(inputs)
    rows_per_split = {k: v["rows"] for k, v in footers.items()}
    if job.input.max_rows:
        rows_per_split = {k: min(v, job.input.max_rows) for k, v in rows_per_split.items()}
    evals = load_eval_texts(tuple(cfg.eval_sets if eval_sets is None else eval_sets), input_root,
                            job.storage.s3_endpoint or None)
    corpus_files = check_corpus(cfg.context_corpus, cfg.corpus_id_field, cfg.corpus_text_field, input_root,
                                job.storage.s3_endpoint or None) if cfg.context_corpus else None
    return EnrichPlan(inputs, footers, rows_per_split, evals, build_eval_index(evals.texts, cfg.decontam_ngram),
                      corpus_files)
