"""A small document corpus for the sample dataset (enrich.context_corpus=[sample]), with its answer key.

Written next to the sample, from its rows, deterministic in ``seed``:

    <out_dir>/corpus/documents.jsonl   {"id": "doc-0000", "text": "..."} one document a line
    <out_dir>/corpus/planted.json      the answer key

For each of up to ``answered_rows`` single-turn rows without context (no system prose: absent, empty or a
reasoning toggle; one user turn) one document holds exactly one sentence that answers it (the row's final
answer, first line, in the reference's words) between sentences about unrelated archives, markets and
timetables; the same boilerplate sentence closes every document (exact duplicates: collapsed to one). Also
planted: ``unrelated`` documents that answer nothing, and one ``contaminated`` document whose sentence carries a
whole eval item next to a row's answer (it must never reach a training prompt). A few hundred sentences: the
demo's embedding cost stays at seconds.
"""

from __future__ import annotations

import json
import os
import random

import pyarrow.parquet as pq

from raytrain.enrich.context import final_answer, is_toggle_line, prose_units
from raytrain.enrich.corpus import document_sentences
from raytrain.enrich.sentences import split_sentences

CORPUS_DIR = "corpus"
DOCUMENTS = "documents.jsonl"
KEY = "planted.json"
BOILERPLATE = "This page belongs to the community reference shelf and may be copied freely."
_TOPICS = ("archive", "market", "ferry timetable", "orchard", "observatory", "tram depot", "bakery guild",
           "lighthouse", "river survey", "choir", "botanical garden", "print shop")
_PLACES = ("Ostvik", "Marrow Bay", "Quillan", "Tessaly", "Brannock", "Velden", "Hollis Ford", "Carrow", "Dunmere",
           "Ilsbeck", "Pellworth", "Sarnia Cove")


def _filler(r: random.Random) -> str:
    topic, place = r.choice(_TOPICS), r.choice(_PLACES)
    return r.choice((
        f"The {topic} of {place} was founded in {r.randint(1780, 1990)} by {r.randint(3, 40)} families.",
        f"Each spring the {topic} in {place} repaints its {r.randint(2, 19)} wooden signs in green.",
        f"Records of the {topic} near {place} fill {r.randint(4, 90)} ledgers kept in the town hall cellar.",
        f"Visitors to the {topic} at {place} are asked to sign the guest book by the north door.",
        f"In {r.randint(1850, 2010)} a storm closed the {topic} of {place} for {r.randint(2, 30)} days.",
    ))


def _no_context(messages) -> bool:
    users = [m for m in messages if m["role"] == "user"]
    systems = [m["content"] or "" for m in messages if m["role"] == "system"]
    prose = [line for s in systems for line in s.splitlines() if line.strip() and not is_toggle_line(line)]
    return len(users) == 1 and not prose and messages[-1]["role"] == "assistant" and \
        not any(m.get("tool_calls") for m in messages)


def write_sample_corpus(out_dir: str, split_files: dict[str, list[str]], eval_path: str, seed: int = 0,
                        answered_rows: int = 40, unrelated: int = 8) -> str:
    """Write the corpus and its key under ``out_dir``/corpus/ from the sample's rows and eval set; returns the
    documents' path. The key lists, per answered row, its uuid, doc id and answering sentence."""
    r = random.Random(f"corpus-{seed}")
    rows = []
    for split in ("chat", "stem", "math"):
        for path in split_files.get(split, []):
            rows += [row for row in pq.read_table(path, columns=["uuid", "messages"]).to_pylist()
                     if row["uuid"] and row["messages"] and _no_context(row["messages"])]
    with open(eval_path, encoding="utf-8") as f:
        eval_items = [json.loads(line) for line in f if line.strip()]
    answers, seen = [], set()
    for row in rows:
        content = row["messages"][-1]["content"] or ""
        if len(content) > 2_000:  # the planted too_long rows and the long tail: rows unlikely to be trained whole
            continue
        units = split_sentences(final_answer(content))
        sentence = units[0] if units else ""
        # one prose sentence of ordinary length (not a planted too_long row), one row per answer text
        if 4 <= len(sentence.split()) <= 40 and sentence[-1] in ".!?" and sentence not in seen \
                and prose_units([sentence]):
            seen.add(sentence)
            answers.append((row["uuid"], sentence))
    answers = answers[:answered_rows]
    docs, key = [], {"seed": seed, "answered": [], "unrelated": [], "contaminated": [], "boilerplate": BOILERPLATE}
    for k, (uuid, sentence) in enumerate(answers):
        before = [_filler(r) for _ in range(r.randint(1, 3))]
        after = [_filler(r) for _ in range(r.randint(1, 2))]
        doc_id = f"doc-{k:04d}"
        text = " ".join([*before, sentence, *after, BOILERPLATE])
        if sentence not in [u for _, u in document_sentences(text)]:  # it must stay one unit in its document
            continue
        docs.append({"id": doc_id, "text": text})
        key["answered"].append({"uuid": uuid, "doc_id": doc_id, "sentence": sentence})
    for k in range(unrelated):
        doc_id = f"doc-u{k:03d}"
        sentences = [_filler(r) for _ in range(4)]
        docs.append({"id": doc_id, "text": " ".join(sentences)})
        key["unrelated"].append({"doc_id": doc_id, "sentences": sentences})
    if answers and eval_items:
        uuid, sentence = answers[0]
        item = eval_items[0]
        # one sentence (a lower-case word after the "?"): the eval item and the row's answer travel together
        leak = f"{sentence.rstrip('.')}; as a worked example, {item['question']} (answer: {item['answer']})."
        docs.append({"id": "doc-x000", "text": f"{_filler(r)} {leak}"})
        key["contaminated"].append({"doc_id": "doc-x000", "uuid": uuid, "eval_id": item["id"], "sentence": leak})
    folder = os.path.join(out_dir, CORPUS_DIR)
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, DOCUMENTS)
    with open(path, "w", encoding="utf-8") as f:
        f.writelines(json.dumps(d, sort_keys=True) + "\n" for d in docs)
    with open(os.path.join(folder, KEY), "w", encoding="utf-8") as f:
        json.dump(key, f, indent=1, sort_keys=True)
    return path


def load_corpus_key(out_dir: str) -> dict:
    """The corpus answer key written by write_sample_corpus."""
    with open(os.path.join(out_dir, CORPUS_DIR, KEY), encoding="utf-8") as f:
        return json.load(f)
