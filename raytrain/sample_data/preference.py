"""A small synthetic preference dataset shaped like nvidia/HelpSteer3's ``preference`` config, with an answer key.

Written as the hub lays HelpSteer3 out:

    <out_dir>/preference/train.jsonl.gz        pairs: domain, language, context, response1, response2,
                                               overall_preference, individual_preference
    <out_dir>/preference/validation.jsonl.gz   clean pairs only
    <out_dir>/eval/preference_eval_set.jsonl   the eval set to decontaminate against ({"id", "question", "answer"})
    <out_dir>/preference_planted.json          the answer key: every planted row of train.jsonl.gz by line (a
                                               duplicate names the line it copies: dedup keeps one of the two)

Domains general, code, multilingual and stem, as HelpSteer3's; languages english, a programming language for code,
german / french / spanish for multilingual. About a third of the contexts hold an earlier exchange (multi-turn),
some are plain strings (as derived copies have them). The chosen response answers the last question, the rejected
one does not; which of response1 / response2 is chosen and by how much (1..3) is drawn per row. Ordinary pairs stay
below 0.5 character-5-gram Jaccard of each other, so only the planted near-duplicate is one.

Planted in train.jsonl.gz: ties (overall_preference 0), a missing response, a context ending with an assistant turn,
preferences out of range and not a number, exact duplicates (case and spacing changed), a near-duplicate, and pairs
contaminated with an eval question (one in the prompt, one in a response).
Same seed, same bytes (gzip without a timestamp).
"""

from __future__ import annotations

import gzip
import json
import os
import random
from dataclasses import dataclass

MIN_SIMILARITY_GAP = 0.5
"""Ordinary pairs stay below this character-5-gram Jaccard of each other (dedup flags 0.8 and above)."""
NAMES = ("Amara", "Bodhi", "Cosima", "Dario", "Elif", "Farid", "Greta", "Hiro", "Ines", "Jonas", "Kaia", "Luca",
         "Mirela", "Nils", "Oona", "Pavel", "Quinn", "Rosa", "Sven", "Talia", "Umar", "Vera", "Wanda", "Yusuf")
THINGS = ("marbles", "stamps", "apples", "seashells", "postcards", "pencils", "coins", "stickers", "books", "plums")
PLACES = ("the harbour", "a mountain hut", "the old mill", "a night market", "the botanical garden", "a ferry",
          "the library annex", "a rooftop cafe", "the observatory", "a village bakery")
TIES, BAD_ROWS = 2, ("missing_response", "bad_role", "bad_preference", "bad_preference")


@dataclass(frozen=True)
class PreferenceSample:
    """Where write_preference_sample put things."""

    train_path: str
    validation_path: str
    eval_path: str
    planted_path: str
    num_train_rows: int
    num_validation_rows: int


def _words(rng: random.Random, n: int) -> str:
    """A sentence of fresh names, places and numbers, so no two pairs share much text."""
    return " ".join(f"{rng.choice(NAMES)} saw {rng.randint(2, 999)} {rng.choice(THINGS)} near {rng.choice(PLACES)}."
                    for _ in range(n))


def _general(rng: random.Random) -> tuple[str, str, str, str, str]:
    name, thing, a, b = rng.choice(NAMES), rng.choice(THINGS), rng.randint(20, 90), rng.randint(2, 19)
    question = f"{name} collects {thing}. {_words(rng, 3)} If {name} has {a} {thing} and gives away {b}, how many are left?"
    chosen = f"{name} has {a - b} {thing} left: {a} minus the {b} given away is {a - b}. {_words(rng, 3)}"
    rejected = f"Collecting {thing} is a lovely hobby, and {name} should keep going. {_words(rng, 3)}"
    return "general", "english", question, chosen, rejected


def _code(rng: random.Random):
    language, word = rng.choice((("python", "largest"), ("javascript", "smallest"), ("python", "sum")))
    fn = f"{word}_{rng.choice(THINGS)}_{rng.randint(10, 999)}"
    question = f"Write a {language} function named {fn} that returns the {word} of a list of numbers. {_words(rng, 3)}"
    body = {"largest": "max(values)", "smallest": "Math.min(...values)", "sum": "sum(values)"}[word]
    code = (f"def {fn}(values):\n    return {body}" if language == "python"
            else f"function {fn}(values) {{\n  return {body};\n}}")
    chosen = f"Here is {fn}:\n\n```{language}\n{code}\n```\nIt returns the {word} value. {_words(rng, 3)}"
    rejected = f"You could search the web for a {language} tutorial about lists. {_words(rng, 3)}"
    return "code", language, question, chosen, rejected


def _multilingual(rng: random.Random):
    a, b, name = rng.randint(10, 99), rng.randint(10, 99), rng.choice(NAMES)
    language, question, chosen, rejected = rng.choice((
        ("german", f"{name} fragt: Wie viel ist {a} plus {b}?", f"{a} plus {b} ist {a + b}.",
         f"Das weiß ich leider nicht, {name}."),
        ("french", f"{name} demande : combien font {a} plus {b} ?", f"{a} plus {b} font {a + b}.",
         f"Je ne sais pas, {name}, désolé."),
        ("spanish", f"{name} pregunta: ¿cuánto es {a} más {b}?", f"{a} más {b} es {a + b}.",
         f"No lo sé, {name}, lo siento."),
    ))
    tail = _words(rng, 3)
    return "multilingual", language, f"{question} {tail}", f"{chosen} {tail}", f"{rejected} {_words(rng, 3)}"


def _stem(rng: random.Random):
    hours, speed, place = rng.randint(2, 9), rng.randint(30, 120), rng.choice(PLACES)
    question = (f"A train leaves {place} and covers {hours * speed} km in {hours} hours. What is its average "
                f"speed? {_words(rng, 3)}")
    chosen = f"Average speed is distance over time: {hours * speed} km / {hours} h = {speed} km/h. {_words(rng, 3)}"
    rejected = f"Trains near {place} are usually quite fast. {_words(rng, 3)}"
    return "stem", "english", question, chosen, rejected


KINDS = (_general, _code, _multilingual, _stem)


def _row(rng: random.Random, index: int) -> dict:
    domain, language, question, good, bad = KINDS[index % len(KINDS)](rng)
    context: list[dict] | str = [{"role": "user", "content": question}]
    if rng.random() < 0.35:  # an earlier exchange first
        earlier, reply = f"Hello, I have a question from {rng.choice(PLACES)}. {_words(rng, 3)}", "Of course, ask away."
        context = [{"role": "user", "content": earlier}, {"role": "assistant", "content": reply}, *context]
    elif rng.random() < 0.15:
        context = question  # a plain string, as derived copies have it
    preference = rng.choice((-3, -2, -1, 1, 2, 3))
    first, second = (good, bad) if preference < 0 else (bad, good)
    return {"domain": domain, "language": language, "context": context, "response1": first, "response2": second,
            "overall_preference": preference,
            "individual_preference": [{"score": preference, "reasoning": "@Response 1 answers the question."
                                       if preference < 0 else "@Response 2 answers the question."}]}


def _text(row: dict) -> str:
    context = row["context"] if isinstance(row["context"], str) else " ".join(t["content"] for t in row["context"])
    return " ".join(f"{context} {row['response1']} {row['response2']}".lower().split())


def _shingles(row: dict) -> set[str]:
    text = _text(row)
    return {text[i:i + 5] for i in range(len(text) - 4)}


def _ordinary_rows(rng: random.Random, count: int, start: int, seen: list[set[str]]) -> list[dict]:
    rows = []
    while len(rows) < count:
        row = _row(rng, start + len(rows))
        grams = _shingles(row)
        if all(len(grams & other) / len(grams | other) < MIN_SIMILARITY_GAP for other in seen):
            seen.append(grams)
            rows.append(row)
    return rows


def _eval_items(rng: random.Random) -> list[dict]:
    items = []
    for i in range(4):
        a, b, c = rng.randint(100, 999), rng.randint(100, 999), rng.choice(PLACES)
        items.append({"id": f"pref-eval-{i}", "question": f"A ferry leaving {c} carries {a} passengers in the morning "
                      f"and {b} in the evening of the same long day; how many passengers did it carry in total that "
                      "day?", "answer": f"{a + b}"})
    return items


def _planted(rng: random.Random, base: list[dict], eval_items: list[dict]) -> list[tuple[dict, str, str, int]]:
    """(row, kind, reason, the ordinary row it copies or -1) for every planted defect."""
    planted = []
    for i in range(TIES):
        planted.append(({**base[i], "overall_preference": 0}, "tie", "tie", -1))
    bad = [{**base[2], "response2": ""},
           {**base[3], "context": [{"role": "user", "content": "Hi."}, {"role": "assistant", "content": "Hello."}]},
           {**base[4], "overall_preference": 5},
           {**base[5], "overall_preference": "much better"}]
    planted += [(row, "malformed", reason, -1) for row, reason in zip(bad, BAD_ROWS, strict=True)]
    for i in (6, 7):
        dup = json.loads(json.dumps(base[i]))
        dup["response1"], dup["response2"] = dup["response1"].upper(), dup["response2"].replace(" ", "  ")
        planted.append((dup, "exact_duplicate", "exact_duplicate", i))
    near = json.loads(json.dumps(base[8]))
    near["response1"] = near["response1"].replace(" ", " really ", 1)
    planted.append((near, "near_duplicate", "near_duplicate", 8))
    leak = _row(rng, 0)
    leak["context"] = [{"role": "user", "content": f"My teacher asked: {eval_items[0]['question']} Please help."}]
    planted.append((leak, "contaminated", "contaminated", -1))
    leak = _row(rng, 1)
    leak["response1"] = f"{leak['response1']} By the way: {eval_items[1]['question']} {eval_items[1]['answer']}."
    planted.append((leak, "contaminated", "contaminated", -1))
    return planted


def _write_jsonl_gz(path: str, rows: list[dict]) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "wb") as raw, gzip.GzipFile(fileobj=raw, mode="wb", mtime=0, filename="") as f:
        f.write("".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows).encode("utf-8"))


def write_preference_sample(out_dir: str, seed: int = 0, train_pairs: int = 96,
                            validation_pairs: int = 16) -> PreferenceSample:
    """Write the HelpSteer3-shaped sample under ``out_dir``; return where. ``train_pairs`` ordinary pairs plus the
    planted ones go to train.jsonl.gz in a shuffled order, ``validation_pairs`` clean pairs to validation."""
    if train_pairs < 12:
        raise ValueError(f"train_pairs must be >= 12 to give the planted rows their bases, got {train_pairs}")
    rng, seen = random.Random(seed), []
    eval_items = _eval_items(rng)
    ordinary = _ordinary_rows(rng, train_pairs, 0, seen)
    validation = _ordinary_rows(rng, validation_pairs, train_pairs, seen)
    rows = [(row, "", "", i) for i, row in enumerate(ordinary)] + _planted(rng, ordinary, eval_items)
    rng.shuffle(rows)
    line_of = {i: line for line, (_, kind, _, i) in enumerate(rows) if not kind}
    paths = {name: os.path.join(out_dir, "preference", f"{name}.jsonl.gz") for name in ("train", "validation")}
    _write_jsonl_gz(paths["train"], [row for row, _, _, _ in rows])
    _write_jsonl_gz(paths["validation"], validation)
    eval_path = os.path.join(out_dir, "eval", "preference_eval_set.jsonl")
    os.makedirs(os.path.dirname(eval_path), exist_ok=True)
    with open(eval_path, "w", encoding="utf-8") as f:
        f.writelines(json.dumps(item, sort_keys=True) + "\n" for item in eval_items)
    key = {"seed": seed, "rows": len(rows), "validation_rows": len(validation),
           "planted": [{"line": line, "kind": kind, "reason": reason, **({"of_line": line_of[base]} if base >= 0 else {})}
                       for line, (_, kind, reason, base) in enumerate(rows) if kind]}
    planted_path = os.path.join(out_dir, "preference_planted.json")
    with open(planted_path, "w", encoding="utf-8") as f:
        json.dump(key, f, indent=1, sort_keys=True)
    return PreferenceSample(paths["train"], paths["validation"], eval_path, planted_path, len(rows), len(validation))
