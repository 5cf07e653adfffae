"""The enrichment's bookkeeping, pure: config hash, manifest and run-report dicts, and the readable summary.

No Spark here; the job fills these from counts it collected.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from typing import Any

from raytrain.config import JobConfig

# The config sections that decide the enriched rows (and the packed sequences after them); the same sections as
# runner.Run.data_hash, so the manifest's hash and the pack stage's hash agree.
HASHED_SECTIONS = ("data", "enrich", "dataset")


def enrich_config_hash(job: JobConfig) -> str:
    """sha256 (16 hex digits) of the data/enrich/dataset config sections."""
    sections = {k: job.to_dict()[k] for k in HASHED_SECTIONS}
    return hashlib.sha256(json.dumps(sections, sort_keys=True).encode()).hexdigest()[:16]


@dataclass
class StepCounts:
    """Rows into and out of one step, and what it quarantined, by reason."""

    step: str
    rows_in: int
    rows_out: int
    quarantined: dict[str, int] = field(default_factory=dict)
    seconds: float = 0.0

    def check(self) -> None:
        """A step must account for every row it received."""
        lost = self.rows_in - self.rows_out - sum(self.quarantined.values())
        if lost:
            raise AssertionError(f"enrich step {self.step}: {self.rows_in} rows in, {self.rows_out} out, "
                                 f"{sum(self.quarantined.values())} quarantined: {lost} rows unaccounted for (a bug)")

    def to_dict(self) -> dict[str, Any]:
        return {"step": self.step, "rows_in": self.rows_in, "rows_out": self.rows_out,
                "quarantined": dict(sorted(self.quarantined.items())), "seconds": round(self.seconds, 2)}


def merge_reasons(steps: list[StepCounts]) -> dict[str, int]:
    """Quarantined rows per reason over all steps."""
    total: dict[str, int] = {}
    for s in steps:
        for reason, n in s.quarantined.items():
            total[reason] = total.get(reason, 0) + n
    return dict(sorted(total.items()))


def dedup_ratio(steps: list[StepCounts]) -> float:
    """Fraction of the rows reaching exact dedup that the two dedup steps removed."""
    by_name = {s.step: s for s in steps}
    first = by_name.get("exact_dedup")
    if first is None or not first.rows_in:
        return 0.0
    removed = sum(sum(by_name[n].quarantined.values()) for n in ("exact_dedup", "near_dedup") if n in by_name)
    return round(removed / first.rows_in, 6)


def _fmt_dist(d: dict[str, Any], digits: int = 3) -> str:
    if not d.get("count"):
        return "none"
    return "  ".join(f"{k} {d[k]:.{digits}f}" for k in ("min", "p50", "p90", "max")) + f"  (n={d['count']})"


def summary_text(report: dict[str, Any]) -> str:
    """A few screens of plain text from the run report (what a person reads first)."""
    lines = [
        f"enrichment {report.get('run_uri', '')}  config {report['config_hash']}  {report['seconds']:.1f} s",
        f"rows in {report['rows_in']} ("
        + ", ".join(f"{k} {v}" for k, v in report.get("rows_in_per_split", {}).items())
        + f") -> kept {report['rows_out']}, quarantined {report['quarantined_total']}",
        "",
        f"{'step':<16}{'in':>8}{'out':>8}{'s':>8}  quarantined",
    ]
    for s in report["steps"]:
        q = ", ".join(f"{k} {v}" for k, v in s["quarantined"].items()) or "-"
        lines.append(f"{s['step']:<16}{s['rows_in']:>8}{s['rows_out']:>8}{s['seconds']:>8.1f}  {q}")
    lines += ["", "quarantined by reason: "
              + (", ".join(f"{k} {v}" for k, v in report["quarantined"].items()) or "none"),
              f"dedup ratio {100 * report['dedup_ratio']:.2f}% of rows reaching dedup "
              f"({report['quarantined'].get('exact_duplicate', 0)} exact, "
              f"{report['quarantined'].get('near_duplicate', 0)} near)"]
    dec = report["decontamination"]
    lines.append(f"decontaminated {dec['count']} rows ({dec['ngram']}-gram overlap with "
                 f"{len(dec['eval_sets'])} eval set(s), {dec['eval_ngrams']} eval n-grams)")
    lines += [f"  {r['uuid']}  {r['detail']}" for r in dec["rows"][:20]]
    if len(dec["rows"]) > 20:
        lines.append(f"  ... {len(dec['rows']) - 20} more in the JSON report")
    sim = report["similarity"]
    lines += ["", f"similarity (combined score, w_question={sim['question_weight']}):",
              f"  all candidate sentences  {_fmt_dist(sim['all_sentences'])}",
              f"  kept sentences           {_fmt_dist(sim['kept_sentences'])}",
              f"  rows with a system prompt to select from: {sim['rows_with_candidates']} of {report['rows_out']}",
              f"tokens per row ({report['tokenizer']}): {_fmt_dist(report['tokens'], 0)}"]
    twt = report.get("text_with_tool_calls")
    if twt:
        lines.append(f"assistant turns with text and tool calls ({report['tokenizer']}, policy {twt['policy']}): "
                     f"text dropped in {twt['turns_text_dropped']} turns of {twt['rows']} kept rows "
                     f"({twt['chars_text_dropped']} characters)")
    lines += ["", f"enriched   {report['enriched_uri']}", f"quarantine {report['quarantine_uri']}",
              f"manifest   {report['manifest_uri']}"]
    return "\n".join(lines) + "\n"
