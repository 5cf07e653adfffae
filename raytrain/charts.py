"""Pictures of a run, drawn from its own files with matplotlib (Agg, no display): PNGs under ``reports/charts/``.

    loss.png            training loss per step, validation loss (held-out) and benchmark loss where measured
    lr.png              learning rate per step
    token_lengths.png   tokens per kept conversation, one histogram per split, dataset.seq_len marked
    similarity.png      context-selection scores: every candidate sentence vs the kept ones (combined score), and
                        the question-side and answer-side scores

Inputs: ``reports/metrics.jsonl`` (rank 0's step metrics, raytrain.trainer.loop) and ``data/enriched/*.parquet``
or its ``wave-NNNNN/`` folders (the enrichment's audit columns: ``split``, ``num_tokens``, ``sentence_scores``,
``kept_indices``, ``question_scores``, ``answer_scores``). Reading and drawing are separate so tests draw from
synthetic data.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field

import numpy as np

from raytrain.errors import RaytrainError

CHART_DIR = ("reports", "charts")
FIGSIZE_IN = (8, 4.5)
DPI = 100  # 800 x 450 pixels


def load_metrics(path: str) -> list[dict]:
    """The step records of a metrics.jsonl, sorted by step; a step logged twice (a launch that resumed from an
    earlier checkpoint repeats steps) keeps its last record. A line that is not a JSON object with an integer
    ``step`` is an error naming the file and line."""
    by_step: dict[int, dict] = {}
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise RaytrainError(f"{path}:{number}: not JSON ({e.msg})") from None
            if not isinstance(record, dict) or not isinstance(record.get("step"), int):
                raise RaytrainError(f"{path}:{number}: a metrics record needs an integer 'step'")
            by_step[record["step"]] = record
    return [by_step[s] for s in sorted(by_step)]


def _series(metrics: list[dict], key: str) -> tuple[list[int], list[float]]:
    pairs = [(m["step"], float(m[key])) for m in metrics if isinstance(m.get(key), int | float)]
    return [p[0] for p in pairs], [p[1] for p in pairs]


def _figure(title: str, xlabel: str, ylabel: str):
    import matplotlib

    matplotlib.use("Agg")  # files only; never a window, also on a machine with a display
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=FIGSIZE_IN, dpi=DPI)
    ax.set_title(title)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.grid(True, alpha=0.3)
    return fig, ax


def _save(fig, out_path: str) -> str:
    import matplotlib.pyplot as plt

    os.makedirs(os.path.dirname(out_path) or ".", exist_ok=True)
    tmp = out_path + ".tmp.png"
    # no Software/date metadata: the same inputs give the same bytes
    fig.savefig(tmp, format="png", metadata={"Software": None})
    plt.close(fig)
    os.replace(tmp, out_path)
    return out_path


def loss_chart(metrics: list[dict], out_path: str) -> str:
    """Training loss per step, with the eval and benchmark losses at the steps that measured them."""
    if not metrics:
        raise RaytrainError("no step metrics to draw a loss chart from")
    preference = any("rewards/margins" in m for m in metrics)
    fig, ax = _figure("loss", "step", "DPO loss (mean over pairs)" if preference else "loss (nats per target token)")
    steps, loss = _series(metrics, "loss")
    ax.plot(steps, loss, marker=".", label="training loss")
    for key, label, marker in (("validation_loss", "validation loss (held out)", "o"),
                               ("benchmark_loss", "benchmark loss", "s")):
        s, v = _series(metrics, key)
        if s:
            ax.plot(s, v, marker=marker, linestyle="--", label=label)
    ax.legend()
    return _save(fig, out_path)


def lr_chart(metrics: list[dict], out_path: str) -> str:
    """Learning rate per step."""
    if not metrics:
        raise RaytrainError("no step metrics to draw a learning-rate chart from")
    fig, ax = _figure("learning rate", "step", "lr")
    steps, lr = _series(metrics, "lr")
    ax.plot(steps, lr, marker=".")
    ax.ticklabel_format(axis="y", style="sci", scilimits=(-3, 3))
    return _save(fig, out_path)


def rewards_chart(metrics: list[dict], out_path: str) -> str:
    """DPO: the reward margin and accuracy per step (TRL's rewards/margins, rewards/accuracies), training and held
    out."""
    fig, ax = _figure("preference rewards", "step", "reward margin (chosen - rejected)")
    accuracy = ax.twinx()
    accuracy.set_ylabel("reward accuracy")
    accuracy.set_ylim(-0.05, 1.05)
    for prefix, label, marker in (("", "training", "."), ("validation/", "validation (held out)", "o")):
        steps, margins = _series(metrics, prefix + "rewards/margins")
        if steps:
            ax.plot(steps, margins, marker=marker, label=f"{label} margin")
            steps, acc = _series(metrics, prefix + "rewards/accuracies")
            accuracy.plot(steps, acc, marker=marker, linestyle=":", label=f"{label} accuracy")
    lines = ax.get_legend_handles_labels()
    more = accuracy.get_legend_handles_labels()
    ax.legend(lines[0] + more[0], lines[1] + more[1], loc="lower right")
    return _save(fig, out_path)


def token_length_chart(lengths_by_split: dict[str, np.ndarray], seq_len: int | None, out_path: str) -> str:
    """Histogram of tokens per conversation, one per split (step outlines on shared bins), seq_len marked."""
    if not any(len(v) for v in lengths_by_split.values()):
        raise RaytrainError("no token lengths to draw")
    fig, ax = _figure("tokens per kept conversation", "tokens", "conversations")
    top = max(int(np.max(v)) for v in lengths_by_split.values() if len(v))
    bins = np.linspace(0, max(top, seq_len or 0) + 1, 41)
    for split, lengths in sorted(lengths_by_split.items()):
        if len(lengths):
            ax.hist(lengths, bins=bins, histtype="step", linewidth=1.5, label=f"{split} (n={len(lengths)})")
    if seq_len:
        ax.axvline(seq_len, color="black", linestyle=":", label=f"seq_len {seq_len}")
    ax.legend()
    return _save(fig, out_path)


@dataclass
class SelectionScores:
    """Similarity scores of the context selection (raytrain.enrich.relevance), flattened over rows."""

    all_sentences: np.ndarray = field(default_factory=lambda: np.zeros(0))
    """Combined score of every candidate context sentence."""
    kept_sentences: np.ndarray = field(default_factory=lambda: np.zeros(0))
    """Combined score of the sentences the selection kept."""
    question: np.ndarray = field(default_factory=lambda: np.zeros(0))
    """Similarity of each candidate sentence to the question."""
    answer: np.ndarray = field(default_factory=lambda: np.zeros(0))
    """Similarity of each candidate sentence to the answer."""


def similarity_chart(scores: SelectionScores, out_path: str) -> str:
    """Two panels: candidate vs kept combined scores; question-side vs answer-side scores."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if not len(scores.all_sentences):
        raise RaytrainError("no candidate sentences were scored: nothing to draw")
    fig, (left, right) = plt.subplots(1, 2, figsize=FIGSIZE_IN, dpi=DPI, sharey=False)
    bins = np.linspace(min(-0.2, float(np.min(scores.all_sentences))), 1.0, 31)
    left.hist(scores.all_sentences, bins=bins, alpha=0.5, label=f"all candidates (n={len(scores.all_sentences)})")
    left.hist(scores.kept_sentences, bins=bins, alpha=0.7, label=f"kept (n={len(scores.kept_sentences)})")
    left.set_title("combined score")
    right.hist(scores.question, bins=bins, histtype="step", linewidth=1.5, label="vs question")
    right.hist(scores.answer, bins=bins, histtype="step", linewidth=1.5, label="vs answer")
    right.set_title("question / answer similarity")
    for ax in (left, right):
        ax.set_xlabel("cosine similarity")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize="small")
    left.set_ylabel("sentences")
    fig.tight_layout()
    return _save(fig, out_path)


def read_enriched(enriched_dir: str, files: list[str] | None = None) -> tuple[dict[str, np.ndarray], SelectionScores]:
    """Token lengths per split and the selection scores from the enriched Parquet folder (flat, or wave by wave;
    ``files``: its files, when the caller listed them already)."""
    import pyarrow.parquet as pq

    files = files or _enriched_files(enriched_dir)
    names = pq.read_schema(files[0]).names
    selection = ["sentence_scores", "kept_indices", "question_scores", "answer_scores"]
    table = pq.read_table(files, columns=["split", "num_tokens", *(selection if "sentence_scores" in names else [])])
    splits = np.asarray(table.column("split").to_pylist())
    tokens = np.asarray(table.column("num_tokens").to_pylist(), dtype=np.int64)
    lengths = {str(s): tokens[splits == s] for s in np.unique(splits)}
    if "sentence_scores" not in names:  # preference pairs: no context selection
        empty = np.zeros(0, dtype=np.float64)
        return lengths, SelectionScores(empty, empty, empty, empty)
    all_scores: list[float] = []
    kept: list[float] = []
    for row_scores, row_kept in zip(table.column("sentence_scores").to_pylist(),
                                    table.column("kept_indices").to_pylist(), strict=True):
        row_scores = row_scores or []
        all_scores.extend(row_scores)
        kept.extend(row_scores[i] for i in row_kept or [] if i < len(row_scores))

    def flat(name: str) -> np.ndarray:
        return np.asarray([x for row in table.column(name).to_pylist() for x in row or []], dtype=np.float64)

    return lengths, SelectionScores(np.asarray(all_scores), np.asarray(kept), flat("question_scores"),
                                    flat("answer_scores"))


def _enriched_files(enriched_dir: str) -> list[str]:
    from raytrain.storage import parquet_names, resolve

    return [os.path.join(enriched_dir, n) for n in parquet_names(resolve(enriched_dir))]


def write_run_charts(run_dir: str, seq_len: int | None = None) -> list[str]:
    """Every chart whose inputs the run folder holds; returns the PNG paths written."""
    out_dir = os.path.join(run_dir, *CHART_DIR)
    written = []
    metrics_path = os.path.join(run_dir, "reports", "metrics.jsonl")
    if os.path.exists(metrics_path):
        metrics = load_metrics(metrics_path)
        if metrics:
            written.append(loss_chart(metrics, os.path.join(out_dir, "loss.png")))
            written.append(lr_chart(metrics, os.path.join(out_dir, "lr.png")))
            if any("rewards/margins" in m for m in metrics):
                written.append(rewards_chart(metrics, os.path.join(out_dir, "rewards.png")))
    enriched = os.path.join(run_dir, "data", "enriched")
    files = _enriched_files(enriched)
    if files:
        lengths, scores = read_enriched(enriched, files)
        if any(len(v) for v in lengths.values()):
            written.append(token_length_chart(lengths, seq_len, os.path.join(out_dir, "token_lengths.png")))
        if len(scores.all_sentences):
            written.append(similarity_chart(scores, os.path.join(out_dir, "similarity.png")))
    return written
