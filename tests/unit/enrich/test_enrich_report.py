"""Bookkeeping of the enrichment (raytrain.enrich.report): hashes, per-step accounting, the text summary."""

import pytest

from raytrain.config import DatasetConfig, EnrichConfig
from raytrain.enrich.report import (
    StepCounts,
    build_pair_report,
    dedup_ratio,
    pair_summary_text,
    step_counts,
    summary_text,
)


def test_step_counts_must_account_for_every_row():
    StepCounts("derive", 10, 7, {"bad_role": 3}).check()
    with pytest.raises(AssertionError, match="1 rows unaccounted"):
        StepCounts("derive", 10, 7, {"bad_role": 2}).check()


def _report():
    reasons = {"bad_role": 10, "exact_duplicate": 10, "near_duplicate": 9, "untokenizable": 1}
    steps = step_counts(100, reasons, corpus=False)
    dist = {"count": 3, "min": 0.1, "p50": 0.2, "p90": 0.3, "max": 0.4}
    return steps, {
        "run_uri": "file:///r", "config_hash": "abc", "seconds": 1.0, "rows_in": 100, "rows_in_per_split": {"chat": 100},
        "rows_out": 70, "quarantined": reasons, "quarantined_total": 30,
        "steps": [s.to_dict() for s in steps], "dedup_ratio": dedup_ratio(steps),
        "passes": {"prepare_and_dedup": 2.5, "finish": 7.25},
        "decontamination": {"count": 0, "ngram": 13, "eval_sets": [], "eval_ngrams": 0, "rows": []},
        "similarity": {"question_weight": 0.5, "all_sentences": dist, "kept_sentences": {"count": 0},
                       "rows_with_candidates": 50},
        "tokenizer": "v3", "tokens": {"count": 2, "min": 5, "p50": 6.0, "p90": 7.0, "max": 8, "sum": 13},
        "enriched_uri": "e", "quarantine_uri": "q", "manifest_uri": "m",
    }


def test_step_counts_follow_the_reasons_through_the_chain_and_dedup_ratio():
    steps, _ = _report()
    assert [(c.step, c.rows_in, c.rows_out, c.quarantined) for c in steps] == [
        ("derive", 100, 90, {"bad_role": 10}), ("license", 90, 90, {}), ("exact_dedup", 90, 80, {"exact_duplicate": 10}),
        ("near_dedup", 80, 71, {"near_duplicate": 9}), ("decontaminate", 71, 71, {}), ("select_context", 71, 71, {}),
        ("tokenize_check", 71, 70, {"untokenizable": 1})]
    assert [c.step for c in step_counts(5, {}, corpus=True)][-2:] == ["corpus_context", "tokenize_check"]
    assert dedup_ratio(steps) == pytest.approx(19 / 90, abs=1e-6)
    assert dedup_ratio(steps[:1]) == 0.0
    with pytest.raises(AssertionError, match="-1 rows out"):
        step_counts(3, {"bad_role": 2, "license": 2}, corpus=False)


def test_summary_text_lists_steps_reasons_and_distributions():
    _, report = _report()
    text = summary_text(report)
    for needle in ("derive", "exact_dedup", "near_dedup", "untokenizable 1", "21.11%", "p90 0.300", "kept 70",
                   "max 8", "passes: prepare_and_dedup 2.5 s, finish 7.2 s"):
        assert needle in text, needle


def test_summary_text_per_split_lengths_context_and_inputs():
    _, report = _report()
    tok = {"count": 80, "min": 10, "p50": 300.0, "p90": 900.0, "p99": 2000.0, "max": 2500, "sum": 30000}
    report.update({
        "rows_in_per_split": {"chat": 60, "code": 40}, "rows_out_per_split": {"chat": 50, "code": 20},
        "quarantined_per_split": {"chat": {"bad_role": 10}, "code": {"too_many_tokens": 20}},
        "inputs": {"layout": "hub", "root": "file:///d", "files": {"chat": ["a", "b"], "code": ["c"]},
                   "missing_shards": {"code": ["code-00001-of-00002.parquet"]}},
        "length": {"policy": "drop", "seq_len": 1024, "per_split": {
            "chat": {"tokens": tok, "rows_dropped": 0, "tokens_dropped": 0, "rows_truncated": 0, "rows_split": 0},
            "code": {"tokens": tok, "rows_dropped": 20, "tokens_dropped": 41000, "rows_truncated": 0,
                     "rows_split": 0}}},
    })
    report["similarity"].update({"min_score": 0.4, "rows_with_context_added": 7, "texts_chunked": 3, "rows_chunked": 2,
                                 "per_split": {"chat": {"rows_with_candidates": 25, "rows_with_context_added": 5,
                                                        "texts_chunked": 3, "all_sentences": {"count": 0},
                                                        "kept_sentences": {"count": 0}}}})
    lines = summary_text(report).splitlines()
    chat = next(x for x in lines if x.startswith("chat "))
    code = next(x for x in lines if x.startswith("code "))
    assert chat.split()[:8] == ["chat", "2", "60", "50", "10", "50%", "10%", "3"] and chat.endswith("all fit")
    assert code.split()[:5] == ["code", "1", "40", "20", "20"] and code.endswith("dropped 20 rows / 41000 tokens")
    assert "300" in chat and "2000" in chat and "2500" in chat
    text = "\n".join(lines)
    assert "length policy (drop, seq_len 1024)" in text and "inputs: hub layout at file:///d" in text
    assert "code: missing shards code-00001-of-00002.parquet" in text
    assert "given a context block (a sentence at or above min_score 0.4): 7" in text


def test_summary_text_corpus_section():
    _, report = _report()
    dist = {"count": 4, "min": 0.41, "p50": 0.5, "p90": 0.6, "p99": 0.62, "max": 0.63}
    corpus = {"files": [{"uri": "s3://b/docs.jsonl"}], "documents": 12, "key": "k0", "sentences_split": 60,
              "duplicates_collapsed": 11, "sentences": 49, "reused": False, "sentences_embedded_this_run": 49,
              "embed_seconds": 3.2, "contaminated_removed": 1, "searchable": 48, "method": "approximate",
              "exact_max_sentences": 10, "recall": {"k": 3, "recall": 1.0, "rows": 20}, "ann_build_seconds": 0.1,
              "retrieve_seconds": 1.5,
              "rows": 70, "rows_added": 4, "rows_own_context": 50,
              "rows_below_min_score": 16, "min_score": 0.4, "sentences_added": 4,
              "sentences_dropped_at_block_check": 0, "scores": dist, "question": dist, "answer": dist,
              "per_split": {"chat": {"rows": 70, "rows_added": 4, "scores": dist}},
              "top_documents": [{"doc_id": "doc-7", "sentences_added": 3, "rows": 2}]}
    report["corpus"] = corpus
    text = summary_text(report)
    for needle in ("context corpus (1 file(s), 12 documents", "11 exact duplicates collapsed",
                   "embedded 49 sentences in 3.2 s", "removed as contaminated (an n-gram shared with the eval sets): 1",
                   "recall@3 1.0 vs exact on 20 rows", "rows given corpus context: 4 of 70", "doc-7 (3 in 2 rows)",
                   "chat          added 4 of 70", "retrieval 1.5 s of tasks"):
        assert needle in text, needle
    corpus.update(reused=True, sentences_embedded_this_run=0, method="exact", recall=None)
    assert "reused (0 sentences embedded" in summary_text(report) and "search exact" in summary_text(report)


def test_every_quarantine_reason_is_counted_by_exactly_one_step():
    """One vocabulary: each step reason belongs to one step of the report, in the steps' order, and the rest are
    derive's; a row quarantined for any reason lands in one step's count and the totals add up."""
    from raytrain.dataset.reasons import DERIVE_REASONS, STEP_REASONS, Reason
    from raytrain.enrich.report import _STEPS

    owned = [r for _, reasons in _STEPS for r in reasons]
    assert owned == list(STEP_REASONS) and set(DERIVE_REASONS) | set(STEP_REASONS) == set(Reason)
    per_reason = {str(r): i + 1 for i, r in enumerate(Reason)}  # as read back from the quarantine files
    steps = step_counts(1000, per_reason, corpus=True)
    counted = [r for s in steps for r, n in s.quarantined.items() for _ in range(n)]
    assert {type(r) for r in counted} == {str}  # the console prints these dicts: 'bad_role', not <Reason...>
    per_reason = {Reason(r): n for r, n in per_reason.items()}  # as the job tallies them
    steps = step_counts(1000, per_reason, corpus=True)
    counted = [r for s in steps for r, n in s.quarantined.items() for _ in range(n)]
    assert {type(r) for r in counted} == {str}
    assert sorted(counted) == sorted(r for r, n in per_reason.items() for _ in range(n))
    assert steps[-1].rows_out == 1000 - sum(per_reason.values())


def test_pair_report_counts_truncated_pairs_and_the_summary_says_so():
    def group(split, status, rows, truncated=0, tokens=0, with_context=0):
        return {"split": split, "domain": "general", "language": "english", "status": status, "rows": rows,
                "rows_truncated": truncated, "tokens_truncated": tokens, "rows_with_context": with_context,
                "context_sentences_kept": 2 * with_context, "system_prompt_chars_removed": 0,
                "rows_with_corpus_context": 0, "corpus_sentences_added": 0}

    groups = [group("train", "ok", 7, 2, 150, with_context=3), group("train", "too_many_tokens", 1),
              group("validation", "ok", 2, 1, 30)]
    report = build_pair_report(10, groups, [], [], 1.0, DatasetConfig(length_policy="truncate"),
                               EnrichConfig(pair_context=True))
    assert report["rows_out"] == 9 and report["quarantined"] == {"too_many_tokens": 1}
    assert report["length"] == {"policy": "truncate", "seq_len": 128, "rows_truncated": 3, "tokens_truncated": 180}
    assert "length policy truncate: 3 pairs kept with their responses cut (-180 tokens)" in pair_summary_text(report)
    assert report["context"] == {"on": True, "rows_with_context": 3, "context_sentences_kept": 6,
                                 "system_prompt_chars_removed": 0, "rows_with_corpus_context": 0,
                                 "corpus_sentences_added": 0}
    assert "context selection on the prompts: 3 pairs got 6 sentences\n" in pair_summary_text(report)
    none_cut = build_pair_report(10, [group("train", "ok", 10)], [], [], 1.0, DatasetConfig(), EnrichConfig())
    assert none_cut["length"] == {"policy": "drop", "seq_len": 128, "rows_truncated": 0, "tokens_truncated": 0}
    assert "truncate" not in pair_summary_text(none_cut) and "context selection" not in pair_summary_text(none_cut)


def test_seconds_split_into_the_rows_work_and_around_it():
    from raytrain.config import load_job_config
    from raytrain.enrich.job import rows_work

    one = load_job_config("configs/demo.yaml", ["enrich.num_executors=1", "enrich.executor_cores=1",
                                                "enrich.num_partitions=2"])
    assert rows_work(one, 10.0, 6.0) == {"rows_work_s": 6.0, "around_s": 4.0}  # one task at a time
    four = load_job_config("configs/demo.yaml", ["enrich.num_executors=2", "enrich.executor_cores=2",
                                                 "enrich.num_partitions=2"])
    assert rows_work(four, 10.0, 6.0) == {"rows_work_s": 3.0, "around_s": 7.0}  # two partitions: two at once
    _, report = _report()
    text = summary_text({**report, **rows_work(one, 1.0, 0.25)})
    assert "of the 1.0 s: the rows' work 0.2 s" in text and "around it 0.8 s" in text
    assert "the rows' work" not in summary_text(report)  # a report written before the split
