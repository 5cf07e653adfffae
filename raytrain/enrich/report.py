"""The enrichment's bookkeeping, pure: per-step counts, the run report, and the readable summary.

No Spark here: the job (raytrain.enrich.job) collects the counts and hands them over as a ``Tally``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from raytrain.config import DatasetConfig, EnrichConfig, JobConfig
from raytrain.dataset.reasons import STEP_REASONS, Reason
from raytrain.enrich.plan import EnrichPlan
from raytrain.storage import MANIFEST, RunPaths, StorageLocation

STEP_REASONS_AFTER_DERIVE = STEP_REASONS
"""The quarantine reasons after derive's, in the order the steps decide them."""
_STEPS = (("license", (Reason.LICENSE,)), ("exact_dedup", (Reason.EXACT_DUPLICATE,)),
          ("near_dedup", (Reason.NEAR_DUPLICATE,)), ("decontaminate", (Reason.CONTAMINATED,)),
          ("select_context", ()), ("corpus_context", ()),
          ("tokenize_check", (Reason.UNTOKENIZABLE, Reason.TOO_MANY_TOKENS)))


@dataclass
class StepCounts:
    """Rows into and out of one step, and what it quarantined, by reason."""

    step: str
    rows_in: int
    rows_out: int
    quarantined: dict[str, int] = field(default_factory=dict)

    def check(self) -> None:
        """A step must account for every row it received."""
        lost = self.rows_in - self.rows_out - sum(self.quarantined.values())
        if lost:
            raise AssertionError(f"enrich step {self.step}: {self.rows_in} rows in, {self.rows_out} out, "
                                 f"{sum(self.quarantined.values())} quarantined: {lost} rows unaccounted for (a bug)")

    def to_dict(self) -> dict[str, Any]:
        return {"step": self.step, "rows_in": self.rows_in, "rows_out": self.rows_out,
                "quarantined": dict(sorted(self.quarantined.items()))}


def step_counts(rows_in: int, per_reason: dict[str, int], corpus: bool) -> list[StepCounts]:
    """Rows in, kept and quarantined per step, from the rows per quarantine reason (every reason belongs to the one
    step that decides it; derive's are the rest). The steps run fused in two passes, so they have no times of their
    own (report["passes"] has those). Raises AssertionError when the counts do not add up (a bug)."""
    derive = {str(r): n for r, n in per_reason.items() if r not in STEP_REASONS_AFTER_DERIVE and n}
    out = [StepCounts("derive", rows_in, rows_in - sum(derive.values()), derive)]
    for step, reasons in _STEPS:
        if step == "corpus_context" and not corpus:
            continue
        q = {str(r): per_reason[r] for r in reasons if per_reason.get(r)}
        n = out[-1].rows_out
        out.append(StepCounts(step, n, n - sum(q.values()), q))
    for c in out:
        c.check()
        if c.rows_out < 0:
            raise AssertionError(f"enrich step {c.step}: {c.rows_out} rows out (a bug)")
    return out


def dedup_ratio(steps: list[StepCounts]) -> float:
    """Fraction of the rows reaching exact dedup that the two dedup steps removed."""
    by_name = {s.step: s for s in steps}
    first = by_name.get("exact_dedup")
    if first is None or not first.rows_in:
        return 0.0
    removed = sum(sum(by_name[n].quarantined.values()) for n in ("exact_dedup", "near_dedup") if n in by_name)
    return round(removed / first.rows_in, 6)


@dataclass(frozen=True)
class Tally:
    """What the enrichment did, counted: the status rollups (``rows``: overall and per split; ``sentences``: the
    selection's distributions), per-reason and per-step counts, the written files (from their footers) and the
    contaminated rows."""

    rows: dict[str, Any]
    sentences: dict[str, Any]
    per_reason: dict[str, int]
    per_split_reason: dict[str, dict[str, int]]
    """Split -> reason -> rows quarantined (splits with none left out)."""
    counts: list[StepCounts]
    rows_out: int
    enriched_files: list[str]
    quarantine_files: list[str]
    quarantine_rows: int
    contaminated: list[dict[str, Any]]


def build_report(job: JobConfig, plan: EnrichPlan, tally: Tally, passes: dict[str, float], corpus: dict[str, Any],
                 *, run_root: StorageLocation, enriched: StorageLocation, quarantine: StorageLocation,
                 seconds: float) -> dict[str, Any]:
    """The run report (reports/enrich_report.json; ``summary_text`` reads it): counts per split and reason, the
    steps, decontamination, selection and token-length distributions, inputs, corpus, pass times."""
    cfg = job.enrich
    rows, overall = tally.rows, tally.rows["overall"]
    per_split = {k: v for k, v in rows["per_split"].items() if v["rows"]}
    report: dict[str, Any] = {
        "run_uri": run_root.uri, "config_hash": job.data_hash(),
        "rows_in": plan.rows_in, "rows_in_per_split": plan.rows_per_split, "rows_out": tally.rows_out,
        "quarantined": tally.per_reason, "quarantined_total": sum(tally.per_reason.values()),
        "quarantined_per_split": tally.per_split_reason,
        "rows_out_per_split": {k: v["rows"] for k, v in per_split.items()},
        "steps": [c.to_dict() for c in tally.counts], "dedup_ratio": dedup_ratio(tally.counts),
        "passes": {k: round(v, 2) for k, v in passes.items()},
        "decontamination": {"count": len(tally.contaminated), "ngram": cfg.decontam_ngram,
                            "eval_sets": plan.evals.sources, "eval_ngrams": len(plan.eval_index),
                            "rows": tally.contaminated},
        "similarity": _similarity_report(job, tally),
        "tokenizer": job.dataset.tokenizer, "tokens": overall.get("tokens", {"count": 0}),
        "length": {"policy": job.dataset.length_policy, "seq_len": job.dataset.seq_len,
                   "overall": overall.get("length", {}),
                   "per_split": {k: v["length"] for k, v in rows["per_split"].items()
                                 if v["length"]["tokens"]["count"]}},
        "text_with_tool_calls": {"policy": job.dataset.text_with_tool_calls,
                                 "rows": overall.get("dropped_text_rows", 0),
                                 "turns_text_dropped": overall.get("dropped_text_turns", 0),
                                 "chars_text_dropped": overall.get("dropped_text_chars", 0)},
        "inputs": {"layout": plan.inputs.layout, "root": plan.inputs.root.uri,
                   "files": {k: [loc.name for loc in v] for k, v in plan.inputs.files.items()},
                   "missing_shards": plan.inputs.missing_shards,
                   "rows_in_files": {k: v["rows"] for k, v in plan.footers.items()}},
        "enriched_uri": enriched.uri, "quarantine_uri": quarantine.uri, "manifest_uri": enriched.join(MANIFEST).uri,
        "summary_uri": RunPaths(run_root).reports.join("enrich_summary.txt").uri,
        "seconds": round(seconds, 2),
    }
    if corpus:
        report["corpus"] = _corpus_report(corpus, {"overall": overall, "per_split": per_split}, tally.sentences,
                                          corpus["top_documents"], plan.corpus_files or [], cfg)
    return report


def _similarity_report(job: JobConfig, tally: Tally) -> dict[str, Any]:
    """report["similarity"]: the selection's settings, its distributions and row counts, overall and per split."""
    cfg, rows, sentences = job.enrich, tally.rows, tally.sentences
    overall = rows["overall"]
    return {
        "question_weight": cfg.question_weight, "top_k": cfg.top_k, "min_score": cfg.min_score,
        "system_prompt": cfg.system_prompt, "answer_text": cfg.answer_text,
        **{k: v for k, v in sentences["overall"].items() if k != "corpus"},
        **{k: overall.get(k, 0) for k in SELECTION_ROW_COUNTS},
        "per_split": {split: {"rows": d["rows"], **{k: d[k] for k in SELECTION_ROW_COUNTS},
                              **{k: d[k] for k in ("dropped_text_turns", "dropped_text_chars", "dropped_text_rows")},
                              **{k: v for k, v in sentences["per_split"].get(split, sentences["empty"]).items()
                                 if k != "corpus"}}
                      for split, d in rows["per_split"].items() if d["rows"]},
    }


SELECTION_ROW_COUNTS = ("rows_with_candidates", "rows_with_context_added", "rows_chunked", "texts_chunked",
                        "system_prompts_changed", "system_prompt_chars_removed")


def _corpus_report(prepared: dict[str, Any], rows: dict[str, Any], sentences: dict[str, Any],
                   top_documents: list[dict[str, Any]], files, cfg) -> dict[str, Any]:
    """report["corpus"]: the files, the table (reused or embedded now, and how long that took), the eval filter,
    the search method and its recall, per-split row paths, score distributions and the most-used documents."""
    table = prepared["table"]
    return {
        "files": [{"uri": f.loc.uri, "sha256": f.sha256, "records": f.records} for f in files],
        "id_field": cfg.corpus_id_field, "text_field": cfg.corpus_text_field,
        "table_uri": prepared["table_uri"], "key": table["key"], "reused": prepared["reused"],
        "sentences_embedded_this_run": prepared["sentences_embedded_this_run"],
        "documents": table["documents"], "documents_without_sentences": table["documents_without_sentences"],
        "sentences_split": table["sentences_split"], "duplicates_collapsed": table["duplicates_collapsed"],
        "sentences": table["sentences"], "embed_seconds": table["embed_seconds"],
        "contaminated_removed": prepared["index"]["contaminated_removed"],
        "contaminated": prepared["index"]["contaminated"], "searchable": prepared["index"]["searchable"],
        "method": prepared["index"]["method"], "exact_max_sentences": cfg.corpus_exact_max_sentences,
        "ann_build_seconds": prepared["index"]["ann_build_seconds"], "recall": prepared["recall"],
        "prepare_seconds": prepared["prepare_seconds"], "retrieve_seconds": prepared["retrieve_seconds"],
        "top_k": cfg.top_k, "min_score": cfg.min_score, "question_weight": cfg.question_weight,
        "rows": rows["overall"].get("rows", 0), **rows["overall"].get("corpus", {}),
        **sentences["overall"]["corpus"], "top_documents": top_documents,
        "per_split": {k: {"rows": v["rows"], **v.get("corpus", {}),
                          **sentences["per_split"].get(k, sentences["empty"])["corpus"]}
                      for k, v in rows["per_split"].items()},
    }


def _fmt_dist(d: dict[str, Any], digits: int = 3) -> str:
    if not d.get("count"):
        return "none"
    keys = ("min", "p50", "p90", "p99", "max") if "p99" in d else ("min", "p50", "p90", "max")
    return "  ".join(f"{k} {d[k]:.{digits}f}" for k in keys) + f"  (n={d['count']})"


def _pct(part: int, whole: int) -> str:
    return f"{100.0 * part / whole:.0f}%" if whole else "-"


def _split_lines(report: dict[str, Any]) -> list[str]:
    """Per split: input files and rows, kept/quarantined, context coverage, token lengths and the length policy."""
    files = report.get("inputs", {}).get("files", {})
    kept = report.get("rows_out_per_split", {})
    bad = report.get("quarantined_per_split", {})
    sim = report["similarity"].get("per_split", {})
    length = report.get("length", {})
    lines = [f"{'split':<13}{'files':>6}{'rows in':>9}{'kept':>7}{'quar.':>7}{'context':>9}{'added':>7}{'chunked':>9}"
             f"{'tok p50':>9}{'p90':>7}{'p99':>7}{'max':>8}  length policy ({length.get('policy', '?')}, "
             f"seq_len {length.get('seq_len', '?')})"]
    for split, rows_in in report.get("rows_in_per_split", {}).items():
        s = sim.get(split, {})
        n_kept = kept.get(split, 0)
        lp = length.get("per_split", {}).get(split, {})
        tok = lp.get("tokens", {})
        effects = []
        if lp.get("rows_dropped"):
            effects.append(f"dropped {lp['rows_dropped']} rows / {lp['tokens_dropped']} tokens")
        if lp.get("rows_truncated"):
            effects.append(f"truncated {lp['rows_truncated']} rows (-{lp['tokens_truncated']} tokens)")
        if lp.get("rows_split"):
            effects.append(f"split {lp['rows_split']} rows into {lp['split_chunks']} chunks")
        tok_cols = (f"{tok['p50']:>9.0f}{tok['p90']:>7.0f}{tok['p99']:>7.0f}{tok['max']:>8}" if tok.get("count")
                    else f"{'-':>9}{'-':>7}{'-':>7}{'-':>8}")
        lines.append(f"{split:<13}{len(files.get(split, [])):>6}{rows_in:>9}{n_kept:>7}"
                     f"{sum(bad.get(split, {}).values()):>7}{_pct(s.get('rows_with_candidates', 0), n_kept):>9}"
                     f"{_pct(s.get('rows_with_context_added', 0), n_kept):>7}"
                     f"{s.get('texts_chunked', 0):>9}{tok_cols}  {', '.join(effects) or 'all fit'}")
    return lines


def summary_text(report: dict[str, Any]) -> str:
    """A few screens of plain text from the run report (what a person reads first)."""
    lines = [
        f"enrichment {report.get('run_uri', '')}  config {report['config_hash']}  {report['seconds']:.1f} s",
        f"rows in {report['rows_in']} ("
        + ", ".join(f"{k} {v}" for k, v in report.get("rows_in_per_split", {}).items())
        + f") -> kept {report['rows_out']}, quarantined {report['quarantined_total']}",
    ]
    inputs = report.get("inputs")
    if inputs:
        lines.append(f"inputs: {inputs['layout']} layout at {inputs['root']}")
        lines += [f"  {k}: missing shards {', '.join(v)}" for k, v in inputs.get("missing_shards", {}).items()]
    lines += ["", *_split_lines(report), "", f"{'step':<16}{'in':>8}{'out':>8}  quarantined"]
    for s in report["steps"]:
        q = ", ".join(f"{k} {v}" for k, v in s["quarantined"].items()) or "-"
        lines.append(f"{s['step']:<16}{s['rows_in']:>8}{s['rows_out']:>8}  {q}")
    if report.get("passes"):
        lines.append("passes: " + ", ".join(f"{k} {v:.1f} s" for k, v in report["passes"].items()))
    if "rows_work_s" in report:
        lines.append(f"of the {report['seconds']:.1f} s: the rows' work {report['rows_work_s']:.1f} s (the tasks' "
                     "seconds in the batch functions over the tasks run at once), around it "
                     f"{report['around_s']:.1f} s")
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
    lines += ["", f"similarity (combined score, w_question={sim['question_weight']}, answer side: "
                  f"{sim.get('answer_text', 'full')} answer, system prompts: {sim.get('system_prompt', 'keep')}):",
              f"  all candidate sentences  {_fmt_dist(sim['all_sentences'])}",
              f"  kept sentences           {_fmt_dist(sim['kept_sentences'])}",
              f"  rows with context to select from: {sim['rows_with_candidates']} of {report['rows_out']} "
              f"({_pct(sim['rows_with_candidates'], report['rows_out'])}), given a context block (a sentence at or "
              f"above min_score {sim.get('min_score', 0)}): {sim.get('rows_with_context_added', 0)}",
              f"  texts longer than the embedding model reads, embedded in chunks: {sim.get('texts_chunked', 0)} "
              f"(in {sim.get('rows_chunked', 0)} rows)"]
    if sim.get("system_prompt") == "select":
        lines.append(f"  system prompts trimmed to their selected sentences: {sim['system_prompts_changed']} rows, "
                     f"{sim['system_prompt_chars_removed']} characters removed")
    for split, d in sim.get("per_split", {}).items():
        lines.append(f"  {split:<13} all {_fmt_dist(d['all_sentences'])}")
        lines.append(f"  {'':<13} kept {_fmt_dist(d['kept_sentences'])}")
    lines.append(f"tokens per kept row ({report['tokenizer']}): {_fmt_dist(report['tokens'], 0)}")
    twt = report.get("text_with_tool_calls")
    if twt:
        lines.append(f"assistant turns with text and tool calls ({report['tokenizer']}, policy {twt['policy']}): "
                     f"text dropped in {twt['turns_text_dropped']} turns of {twt['rows']} kept rows "
                     f"({twt['chars_text_dropped']} characters)")
    if "corpus" in report:
        lines += ["", *_corpus_lines(report["corpus"])]
    lines += ["", f"enriched   {report['enriched_uri']}", f"quarantine {report['quarantine_uri']}",
              f"manifest   {report['manifest_uri']}"]
    return "\n".join(lines) + "\n"


def _corpus_lines(c: dict[str, Any]) -> list[str]:
    """The corpus section of the summary: table, eval filter, search, rows per path, scores, top documents."""
    table = (f"reused (0 sentences embedded; built in {c['embed_seconds']:.1f} s by an earlier run)" if c["reused"]
             else f"embedded {c['sentences_embedded_this_run']} sentences in {c['embed_seconds']:.1f} s")
    recall = c.get("recall") or {}
    search = (f"approximate (faiss HNSW, above {c['exact_max_sentences']} sentences; recall@{recall.get('k')} "
              f"{recall.get('recall')} vs exact on {recall.get('rows')} rows; index built in "
              f"{c['ann_build_seconds']:.1f} s)" if c["method"] == "approximate"
              else f"exact (up to {c['exact_max_sentences']} sentences)")
    lines = [f"context corpus ({len(c['files'])} file(s), {c['documents']} documents, key {c['key']}): "
             f"{c['sentences_split']} sentences split, {c['duplicates_collapsed']} exact duplicates collapsed, "
             f"{c['sentences']} in the table; {table}",
             f"  removed as contaminated (an n-gram shared with the eval sets): {c['contaminated_removed']}; "
             f"searchable {c['searchable']}; search {search}; retrieval {c['retrieve_seconds']:.1f} s of tasks",
             f"  rows given corpus context: {c['rows_added']} of {c['rows']} (own context {c['rows_own_context']}, "
             f"nothing >= min_score {c['min_score']}: {c['rows_below_min_score']}); sentences added "
             f"{c['sentences_added']}, dropped at the block's eval check {c['sentences_dropped_at_block_check']}",
             f"  scores of added sentences  {_fmt_dist(c['scores'])}",
             f"  question / answer          {_fmt_dist(c['question'])} / {_fmt_dist(c['answer'])}"]
    for split, d in c.get("per_split", {}).items():
        lines.append(f"  {split:<13} added {d['rows_added']} of {d['rows']}  scores {_fmt_dist(d['scores'])}")
    if c.get("top_documents"):
        lines.append("  most-used documents: " + ", ".join(f"{d['doc_id']} ({d['sentences_added']} in {d['rows']} rows)"
                                                          for d in c["top_documents"]))
    return lines


# ---- preference pairs -------------------------------------------------------------------------------------------
def pair_step_counts(rows_in: int, per_reason: dict[str, int]) -> list[StepCounts]:
    """The pair enrichment's steps (derive, exact and near dedup, decontaminate, tokenize_check), as step_counts
    gives the fine-tune's: a pair has no license column and no context selection."""
    return [c for c in step_counts(rows_in, per_reason, corpus=False) if c.step not in ("license", "select_context")]


def build_pair_report(rows_in: int, groups: list[dict[str, Any]], sources: list[dict[str, Any]],
                      inputs: list[str], seconds: float, dataset: DatasetConfig, enrich: EnrichConfig,
                      corpus: dict[str, Any] | None = None) -> dict[str, Any]:
    """The pair enrichment's report from its tally (rows per split, domain, language and status, with the pairs the
    length policy truncated and the tokens it cut): counts per reason, per step, per split / domain / language kept
    and quarantined, ``length`` (the policy and seq_len, pairs truncated, tokens cut), ``context``
    (enrich.pair_context: pairs that got sentences and how many, from their own context and from the corpus) and
    ``corpus`` (the table and index facts of enrich.context_corpus) when given. AssertionError when the counts do
    not add up to ``rows_in`` (a bug)."""
    per_reason: dict[str, int] = {}
    length = {"policy": dataset.length_policy, "seq_len": dataset.seq_len,
              "rows_truncated": sum(g["rows_truncated"] for g in groups),
              "tokens_truncated": sum(g["tokens_truncated"] for g in groups)}
    context = {"on": enrich.pair_context, **{k: sum(g[k] for g in groups) for k in
                                             ("rows_with_context", "context_sentences_kept",
                                              "system_prompt_chars_removed", "rows_with_corpus_context",
                                              "corpus_sentences_added")}}
    by: dict[str, dict[str, dict[str, int]]] = {"split": {}, "domain": {}, "language": {}}
    for g in groups:
        kept = g["status"] == "ok"
        if not kept:
            per_reason[g["status"]] = per_reason.get(g["status"], 0) + g["rows"]
        for key, table in by.items():
            counts = table.setdefault(g[key] or "(none)", {"kept": 0, "quarantined": 0})
            counts["kept" if kept else "quarantined"] += g["rows"]
    steps = pair_step_counts(rows_in, per_reason)
    return {"kind": "preference_pairs", "rows_in": rows_in, "rows_out": steps[-1].rows_out,
            "quarantined": dict(sorted(per_reason.items())), "steps": [c.to_dict() for c in steps],
            "per_split": by["split"], "per_domain": by["domain"], "per_language": by["language"], "length": length,
            "context": context, **({"corpus": corpus} if corpus else {}),
            "inputs": inputs, "eval_sets": sources, "seconds": round(seconds, 1)}


def pair_summary_text(report: dict[str, Any]) -> str:
    """The pair report as the readable enrich_summary.txt."""
    lines = [f"preference pairs: {report['rows_in']} rows in -> {report['rows_out']} kept, "
             f"{report['rows_in'] - report['rows_out']} quarantined ({report['seconds']:.0f}s)"]
    lines += [f"  {c['step']:<15} {c['rows_in']:>7} in -> {c['rows_out']:>7} kept"
              + (f"  quarantined {c['quarantined']}" if c["quarantined"] else "") for c in report["steps"]]
    for key in ("per_split", "per_domain", "per_language"):
        lines.append(f"{key.replace('per_', 'per ')}: " + ", ".join(
            f"{name} {v['kept']} kept / {v['quarantined']} quarantined" for name, v in sorted(report[key].items())))
    context = report["context"]
    if context["on"]:
        lines.append(f"context selection on the prompts: {context['rows_with_context']} pairs got "
                     f"{context['context_sentences_kept']} sentences"
                     + (f", {context['system_prompt_chars_removed']} system prompt characters removed"
                        if context["system_prompt_chars_removed"] else "")
                     + (f"; the corpus gave {context['rows_with_corpus_context']} pairs "
                        f"{context['corpus_sentences_added']} sentences" if report.get("corpus") else ""))
    length = report["length"]
    if length["rows_truncated"]:
        lines.append(f"length policy truncate: {length['rows_truncated']} pairs kept with their responses cut "
                     f"(-{length['tokens_truncated']} tokens)")
    return "\n".join(lines) + "\n"
