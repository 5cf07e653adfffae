"""The planted defects and where they go: the rows the answer key lists.

Exact duplicates (case and whitespace changed), near-duplicates (two background words swapped), the eval set
and the rows contaminated with one of its questions, a near miss one word short of a contaminating n-gram, and
malformed rows with one defect per quarantine reason. ``_split_rows`` lays out a split: its planted rows and
its ordinary rows, shuffled into file order, each with its answer-key entry.
"""

from __future__ import annotations

import json
import re

from raytrain.config import SPLITS
from raytrain.errors import RaytrainError
from raytrain.sample_data.rows import _Gen
from raytrain.sample_data.similarity import SeenRows, _char_jaccard
from raytrain.sample_data.spec import CONTEXT_SPLITS, DISALLOWED_LICENSES, MAX_CHARS, NGRAM, QUARANTINE_PER_REASON
from raytrain.sample_data.vocab import _EVAL_TEMPLATES, _SWAP_WORDS


def _clone(gen: _Gen, row: dict) -> dict:
    out = json.loads(json.dumps(row))
    out["uuid"] = gen.uuid()
    return out


def _exact_duplicate(gen: _Gen, base: dict) -> dict:
    """Same text up to case and whitespace: the user turns upper-cased, single spaces doubled in the answer."""
    row = _clone(gen, base)
    for m in row["messages"]:
        if m["role"] == "user":
            m["content"] = m["content"].upper()
    last = row["messages"][-1]
    last["content"] = last["content"].replace(" ", "  ")
    return row


def _near_duplicate(gen: _Gen, base: dict) -> dict:
    """Two words of the background paragraph swapped for others (about 0.9 character-5-gram Jaccard)."""
    row = _clone(gen, base)
    system = row["messages"][0]
    words = system["content"].split(" ")
    candidates = [i for i, w in enumerate(words) if w.isalpha() and len(w) >= 4 and w.islower()]
    for i in sorted(gen.rng.sample(candidates, 2)):
        words[i] = gen.rng.choice([w for w in _SWAP_WORDS if w != words[i]])
    system["content"] = " ".join(words)
    return row


def _eval_items(gen: _Gen, count: int) -> list[dict]:
    r = gen.rng
    items = []
    for i in range(count):
        q_tpl, a_tpl = _EVAL_TEMPLATES[i % len(_EVAL_TEMPLATES)]
        speed, start_h, hours = r.randint(12, 30), r.randint(6, 9), r.randint(1, 4)
        n, k, m = r.randint(10, 90), r.randint(2, 9), r.randint(20, 60)
        q = q_tpl.format(c1=gen.name(), c2=gen.name(), h=start_h, s=speed, d=speed * hours, p=gen.name(), n=n, k=k,
                         m=m, pct=r.randint(20, 80))
        ans = {0: start_h + hours, 1: n * k * m, 5: n * 12}.get(i % len(_EVAL_TEMPLATES), "")
        items.append({"id": f"eval-{i:03d}", "question": q, "answer": a_tpl.format(ans=ans)})
    return items


def _contaminated(gen: _Gen, split: str, item: dict) -> dict:
    r = gen.rng
    intro = r.choice((f"This came up in a quiz from {gen.name()}:", "My teacher set this problem:",
                      f"{gen.name()} keeps asking me the following.", "Help me with homework, please."))
    msgs = [{"role": "user", "content": f"{intro} {item['question']} {r.choice(('Please solve it.', 'Thanks!', ''))}"},
            {"role": "assistant", "content": r.choice(("Working through it carefully, the answer is",
                                                       "Step by step, this gives", "The answer:"))
             + f" {item['answer']}."}]
    return gen.row(split, msgs, False, "quiz")


def _near_miss(gen: _Gen, split: str, item: dict) -> dict:
    words = re.findall(r"[A-Za-z0-9]+", item["question"])
    fragment = " ".join(words[2 : 2 + NGRAM - 1])  # 12 words: one short of a contaminating n-gram
    msgs = [{"role": "user", "content": f"Fragment: \"{fragment}\" (unfinished). What might come next?"},
            {"role": "assistant", "content": f"It reads like the start of a word problem by {gen.name()}; "
             "without the rest I can only guess."}]
    return gen.row(split, msgs, False, "fragment")


def _malformed(gen: _Gen, split: str, reason: str, variant: int) -> dict:
    """A row with exactly one defect, of the given quarantine reason."""
    row = gen.row(split, [{"role": "user", "content": f"Tell me about {gen.name()}."},
                          {"role": "assistant", "content": f"{gen.name()} is a small town by a lake."}], False, "plain")
    msgs = row["messages"]
    if reason == "missing_uuid":
        row["uuid"] = None if variant == 0 else ""
    elif reason == "missing_messages":
        row["messages"] = None if variant == 0 else []
    elif reason == "bad_role":
        if variant == 0:
            msgs[1]["role"] = "narrator"
        else:
            msgs.reverse()  # the assistant speaks before any user turn
    elif reason == "undecodable_text":
        msgs[1]["content"] = msgs[1]["content"].replace("small", "sm\ufffdll" if variant == 0 else "sm\x07ll")
    elif reason == "empty_answer":
        if variant == 0:
            msgs[1]["content"] = "   "
        else:
            row["messages"] = msgs[:1]  # ends on the user turn
    elif reason == "too_long":
        # One paragraph repeated: over max_chars, yet zstd stores it in a few kilobytes.
        paragraph = f"The shoreline of {gen.name()} keeps changing with the seasons and the tides. "
        msgs[1]["content"] = paragraph * (MAX_CHARS // len(paragraph) + 1 + variant)
    else:  # pragma: no cover - reasons are the fixed tuple below
        raise ValueError(reason)
    return row


_REASONS = ("missing_uuid", "missing_messages", "bad_role", "undecodable_text", "empty_answer", "too_long")


def _split_rows(gen: _Gen, split: str, s_idx: int, rows_per_split: int, eval_items: list[dict]) -> list[tuple]:
    """One split's rows in file order: (row, planted kind or "", answer-key entry)."""
    malformed = [(reason, v) for j, (reason, v) in enumerate((r, v) for v in range(QUARANTINE_PER_REASON)
                                                             for r in _REASONS) if j % len(SPLITS) == s_idx]
    disallowed = s_idx < len(DISALLOWED_LICENSES)
    near_dups = 2 if split in CONTEXT_SPLITS else 0
    num_planted = len(malformed) + disallowed + 1 + (split == "chat") + 1 + near_dups  # +1s: contaminated, exact
    num_normals = rows_per_split - num_planted
    gen.start_split(num_normals + disallowed)  # one length band per grown row
    seen = SeenRows()  # 5-gram sets of the grown rows so far (see _Gen.grow)
    special: list[tuple[dict, str, dict]] = []  # (row, planted kind, key entry)
    for reason, v in malformed:
        special.append((_malformed(gen, split, reason, v), "quarantine", {"reason": reason}))
    if disallowed:
        row = gen.normal(split, 0, seen)[0]
        row["license"] = DISALLOWED_LICENSES[s_idx]
        special.append((row, "disallowed_license", {"license": row["license"]}))
    item = eval_items[s_idx]
    special.append((_contaminated(gen, split, item), "contaminated", {"eval_id": item["id"]}))
    if split == "chat":
        miss = eval_items[len(SPLITS)]
        special.append((_near_miss(gen, split, miss), "not_contaminated", {"eval_id": miss["id"]}))
    normals = [gen.normal(split, i, seen) for i in range(num_normals)]
    exact_base = normals[0][0]
    special.append((_exact_duplicate(gen, exact_base), "exact_duplicates", {"duplicate_of": exact_base["uuid"]}))
    if split in CONTEXT_SPLITS:
        near = []
        for base, key in normals[1:]:
            if key is None:  # only context rows have a background paragraph to change
                continue
            twin = _near_duplicate(gen, base)
            # Keep only clear near-duplicates (true Jaccard >= 0.9), far from a 0.8 threshold's noise.
            if _char_jaccard(base, twin) >= 0.9:
                near.append((twin, "near_duplicates", {"duplicate_of": base["uuid"]}))
            if len(near) == 2:
                break
        if len(near) < 2:  # pragma: no cover - background paragraphs are long enough in practice
            raise RaytrainError(f"sample_data: could not plant near-duplicates in {split}; raise rows_per_split")
        special.extend(near)
    rows = [(row, "context_answers" if key else "", key or {}) for row, key in normals] + special
    gen.rng.shuffle(rows)
    return rows
