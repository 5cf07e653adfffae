"""A small synthetic dataset in the Nemotron-Post-Training-Dataset-v1 schema, with an answer key.

The real dataset cannot be downloaded here (FACTS.md), so demos and tests run on this:

    <out_dir>/<split>/part-00000.parquet   one per split (chat, code, math, stem, tool_calling)
    <out_dir>/eval/eval_set.jsonl          the eval set to decontaminate against ({"id", "question", "answer"})
    <out_dir>/planted.json                 the answer key: every planted row, by split, row index and uuid

Rows are templated but varied: context paragraphs where one sentence answers the question and the others are
unrelated, code with a code-runner tool, math with a calculator tool and <think> traces, tool calling with
tool-role messages, some multi-turn, reasoning on/off. Planted: exact duplicates (case/whitespace changed),
near-duplicates (a few words changed), eval-contaminated rows (a whole eval question inside), a near miss
(12 words of one: not contaminated at n=13), non-allowed licenses, and malformed rows, a known number for
each quarantine reason. Same seed, same bytes: one ``random.Random(seed)`` drives everything.

    python -m raytrain.sample_data OUT_DIR [--seed 0] [--rows-per-split 60]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import uuid as uuidlib
from dataclasses import dataclass

import pyarrow as pa
import pyarrow.parquet as pq

from raytrain.enrich.schema import NEMOTRON_V1_SCHEMA, SPLITS
from raytrain.errors import RaytrainError

MAX_CHARS = 60_000  # EnrichConfig.max_chars default; the too_long rows exceed it
ALLOWED_LICENSES = ("cc-by-4.0", "cc-by-sa-4.0", "apache-2.0", "mit", "odc-by")  # EnrichConfig.licenses default
DISALLOWED_LICENSES = ("cc-by-nc-4.0", "proprietary", "CC-BY-NC-SA-4.0")
QUARANTINE_PER_REASON = 2
NGRAM = 13
NEAR_DUP_THRESHOLD = 0.8
MIN_ROWS_PER_SPLIT = 20

_SYLLABLES = (
    "ka lor ve min tha ros del ari quen bo sil mar eth ul pra zen gor li nav tes om rei dun cal fi "
    "jo brel tav ish mon sar vek ol dra pim hu ter gal yn cor ba"
).split()
_FOODS = "lichen,river snails,pine seeds,wild figs,algae,moss,clover,beetle larvae,acorns,plankton".split(",")
_MONTHS = "January February March April May June July August September October November December".split()
_SWAP_WORDS = "amber bright quiet northern ancient famous narrow gentle distant hidden".split()

# (fact sentence in the context, question, answer sentence)
_GENERAL_FACTS = (
    ("The capital of {e} is {v}.", "What is the capital of {e}?", "The capital of {e} is {v}."),
    ("The {e} loom was invented by {v} in {year}.", "Who invented the {e} loom?",
     "The {e} loom was invented by {v}, back in {year}."),
    ("The {e} River is {num} kilometres long.", "How long is the {e} River?",
     "The {e} River is about {num} kilometres long."),
    ("{e} Ltd. was founded in the city of {v} in {year}.", "In which city was {e} Ltd. founded?",
     "{e} Ltd. was founded in {v}."),
    ("The {e} beetle feeds mainly on {food}.", "What does the {e} beetle mainly eat?",
     "The {e} beetle feeds mainly on {food}."),
    ("Mount {e} rises {num} metres above sea level.", "How high is Mount {e}?", "Mount {e} is {num} metres high."),
    ("The novel {e} was written by {v} in {year}.", "Who wrote the novel {e}?", "The novel {e} was written by {v}."),
    ("The festival of {e} is held every year in {month}.", "When is the festival of {e} held?",
     "The festival of {e} takes place every {month}."),
)
_SCIENCE_FACTS = (
    ("The element {e}ium has atomic number {num3}.", "What is the atomic number of {e}ium?",
     "{e}ium has atomic number {num3}."),
    ("The star {e} lies {dec} light-years from Earth.", "How far from Earth is the star {e}?",
     "The star {e} is {dec} light-years away."),
    ("The compound {e}ol boils at {dec} degrees Celsius.", "At what temperature does {e}ol boil?",
     "{e}ol boils at {dec} degrees Celsius."),
    ("The enzyme {e}ase breaks down {food} in the gut.", "What does the enzyme {e}ase break down?",
     "The enzyme {e}ase breaks down {food}."),
    ("Dr. {v} first described the {e} effect in {year}.", "Who first described the {e} effect?",
     "The {e} effect was first described by Dr. {v} in {year}."),
    ("The half-life of {e}-{num3} is {dec} hours.", "What is the half-life of {e}-{num3}?",
     "{e}-{num3} has a half-life of {dec} hours."),
)
_FILLERS = (
    "Average rainfall in {e} is {dec} cm per month, e.g. in the wet season.",
    "Dr. {v} visited {e} in {year} and wrote about its markets.",
    "Most visitors reach {e} by train, approx. {num} of them per day.",
    "The old library of {e} holds {num} books.",
    "Local guides say the view from {e} Hill is best at 6 p.m. in {month}.",
)
_CLOSERS = ("", " Let me know if you want more detail.", " I hope that helps!", " That is all the background says.")

# (task description, function body on argument {a}, reference implementation, kind of sample input)
_CODE_TASKS = (
    ("returns the sum of the squares of a list of numbers", "return sum(x * x for x in {a})",
     lambda v: sum(x * x for x in v), "nums"),
    ("returns the largest even number in a list, or None", "evens = [x for x in {a} if x % 2 == 0]\n"
     "    return max(evens) if evens else None", lambda v: max([x for x in v if x % 2 == 0], default=None), "nums"),
    ("counts how many strings in a list start with a vowel", "return sum(1 for s in {a} if s[:1].lower() in 'aeiou')",
     lambda v: sum(1 for s in v if s[:1].lower() in "aeiou"), "words"),
    ("reverses the order of words in a sentence", "return ' '.join(reversed({a}.split()))",
     lambda v: " ".join(reversed(v.split())), "text"),
    ("returns the running total of a list of numbers", "out, total = [], 0\n    for x in {a}:\n"
     "        total += x\n        out.append(total)\n    return out",
     lambda v: [sum(v[: i + 1]) for i in range(len(v))], "nums"),
    ("removes duplicates from a list while keeping the first occurrence",
     "seen = set()\n    return [x for x in {a} if not (x in seen or seen.add(x))]", lambda v: list(dict.fromkeys(v)), "nums"),
    ("checks whether a string is a palindrome, ignoring case", "t = {a}.lower()\n    return t == t[::-1]",
     lambda v: v.lower() == v.lower()[::-1], "text"),
    ("returns the length of the longest word in a sentence", "return max((len(w) for w in {a}.split()), default=0)",
     lambda v: max((len(w) for w in v.split()), default=0), "text"),
)
_PROJECTS = ("an inventory script", "a grading tool", "a small web service", "a data-cleaning notebook",
             "a command-line game", "a billing report", "a sensor logger", "a chat bot")
_ARG_NAMES = ("values", "items", "data", "xs", "seq", "numbers", "words", "text")

_MATH_TEMPLATES = (
    ("{p} packs {a} boxes with {b} {item} each, then finds {c} more {item}. How many {item} does {p} have now?",
     "{a} * {b} + {c}", lambda a, b, c: a * b + c),
    ("A {item} stall sells {a} crates of {b} {item} on Monday and {c} loose {item} on Tuesday. "
     "How many {item} were sold in total?", "{a} * {b} + {c}", lambda a, b, c: a * b + c),
    ("{p} has {a} {item} and gives away {b} of them to each of {c} friends. How many are left?",
     "{a} - {b} * {c}", lambda a, b, c: a - b * c),
    ("What is ({a} + {b}) multiplied by {c}?", "({a} + {b}) * {c}", lambda a, b, c: (a + b) * c),
)
_ITEMS = "apples,pencils,marbles,stamps,lemons,candles,buttons,shells,tickets,bricks".split(",")

_TOOLS = {
    "get_weather": "get_weather(city)",
    "convert_currency": "convert_currency(amount, from_currency, to_currency)",
    "get_stock_price": "get_stock_price(ticker)",
    "book_table": "book_table(restaurant, people, time)",
    "search_flights": "search_flights(origin, destination, date)",
}
_PREFERENCES = ("short answers", "metric units", "morning flights", "quiet restaurants", "plain language",
                "exact figures", "window seats", "cheap options")
_OPENERS = ("", "Hi! ", "Quick question: ", "Hello there. ", "Sorry to bother you again. ", "I'm in a hurry. ",
            "Good morning! ", "One more thing. ")
_SIGNOFFS = ("", " Anything else?", " Let me know if you need more.", " Have a good day!",
             " Shall I do anything else?", " Hope that helps.")
_CURRENCIES = ("EUR", "USD", "GBP", "JPY", "CHF", "SEK")
_CONDITIONS = ("sunny", "cloudy", "light rain", "windy", "foggy", "snowing")

# Eval questions use wording no training template uses, so only planted rows share 13-grams with them.
_EVAL_TEMPLATES = (
    ("A cyclist leaves {c1} at {h} in the morning riding at {s} kilometres per hour toward {c2}, which is {d} "
     "kilometres away; at what hour does the cyclist arrive if nothing slows the journey down?", "{ans} o'clock"),
    ("In a small orchard owned by {p}, every one of the {n} trees yields {k} baskets of plums each autumn and "
     "every basket holds {m} plums; how many plums does the whole orchard produce in one season?", "{ans} plums"),
    ("Suppose the fictional planet {c1} keeps an atmosphere that is {pct} percent argon by volume; which noble "
     "gas would a visiting probe tuned to detect argon report as the most abundant one there?", "argon"),
    ("Choose the word that best completes the proverb recorded by {p}: a stitch taken early in the season saves "
     "how many stitches later, according to the old tailors of {c1}?", "nine"),
    ("Given a triangle whose sides measure {n}, {k} and {m} units, decide whether the three lengths could ever "
     "form a real triangle and explain which inequality settles the matter.", "see the triangle inequality"),
    ("During the reign of queen {p} the harbour of {c2} shipped {n} tonnes of salt per month; what was the "
     "yearly total that the chroniclers wrote down for the royal treasury?", "{ans} tonnes"),
)


@dataclass(frozen=True)
class SampleManifest:
    """Where write_sample_dataset put things, and how much."""

    out_dir: str
    """The dataset root."""
    seed: int
    """The seed the rows were generated from."""
    rows_per_split: int
    """Rows in each split file, planted rows included."""
    split_paths: dict
    """split name -> path of its Parquet file."""
    eval_path: str
    """The eval set (JSONL with id, question, answer)."""
    planted_path: str
    """planted.json, the answer key."""
    num_bytes: int
    """Total size of the files written."""


class _Gen:
    """Row factory around one random.Random; every method consumes the stream in a fixed order."""

    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)
        self.used_names: set[str] = set()

    def name(self) -> str:
        while True:
            n = "".join(self.rng.choice(_SYLLABLES) for _ in range(self.rng.randint(2, 3))).capitalize()
            if n not in self.used_names and len(n) >= 4:
                self.used_names.add(n)
                return n

    def uuid(self) -> str:
        return str(uuidlib.UUID(int=self.rng.getrandbits(128), version=4))

    def slots(self) -> dict:
        r = self.rng
        return {
            "e": self.name(), "v": self.name(), "year": r.randint(1450, 2020), "num": r.randint(120, 9800),
            "num3": r.randint(3, 180), "dec": f"{r.randint(1, 99)}.{r.randint(0, 99):02d}",
            "food": r.choice(_FOODS), "month": r.choice(_MONTHS),
        }

    def fact(self, pool) -> tuple[str, str, str]:
        tpl = self.rng.choice(pool)
        s = self.slots()
        return tpl[0].format(**s), tpl[1].format(**s), tpl[2].format(**s)

    def think(self, on: bool, text: str) -> str:
        return f"<think>\n{text}\n</think>\n\n" if on else ""

    def row(self, split: str, messages: list[dict], reasoning: bool, template: str) -> dict:
        return {
            "uuid": self.uuid(),
            "license": "cc-by-4.0",
            "generator": self.rng.choice(("DeepSeek-R1-0528", "Qwen3-235B-A22B")) if reasoning else "Qwen3-235B-A22B",
            "version": "v1",
            "category": split,
            "reasoning": "on" if reasoning else "off",
            "messages": [_msg(**m) for m in messages],
            "metadata": json.dumps({"source": "raytrain-sample", "template": template}),
        }

    # --- one generator per split -------------------------------------------------------------------------
    def context_qa(self, split: str) -> tuple[dict, dict]:
        """A system paragraph where one sentence answers the (last) question; some rows are two-turn."""
        r = self.rng
        pool = _SCIENCE_FACTS if split == "stem" else _GENERAL_FACTS
        on = r.random() < 0.5
        target = self.fact(pool)
        first = self.fact(pool) if r.random() < 0.3 else None
        distractors = [self.fact(pool)[0] for _ in range(3)] + [r.choice(_FILLERS).format(**self.slots())]
        sentences = [target[0]] + ([first[0]] if first else []) + distractors
        r.shuffle(sentences)
        system = ("You are a helpful assistant. " if r.random() < 0.5 else "") + " ".join(sentences)
        msgs = [{"role": "system", "content": system}]
        if first:
            msgs += [{"role": "user", "content": first[1]},
                     {"role": "assistant", "content": self.think(on, f"The background states: {first[0]}")
                      + first[2] + r.choice(_CLOSERS)}]
        msgs += [{"role": "user", "content": target[1]},
                 {"role": "assistant", "content": self.think(on, f"Looking at the context: {target[0]}")
                  + target[2] + r.choice(_CLOSERS)}]
        key = {"question": target[1], "answer_sentence": target[0], "distractors": distractors}
        return self.row(split, msgs, on, "context_qa_multi" if first else "context_qa"), key

    def code(self, split: str) -> dict:
        r = self.rng
        on = r.random() < 0.5
        desc, body, ref, kind = r.choice(_CODE_TASKS)
        owner = self.name()
        fname = f"{self.name().lower()}_{r.choice(('calc', 'helper', 'fn', 'op', 'util'))}"
        arg = r.choice(_ARG_NAMES)
        if kind == "nums":
            sample = [r.randint(-9, 60) for _ in range(r.randint(4, 8))]
        elif kind == "words":
            sample = [self.name() if r.random() < 0.5 else self.name().lower() for _ in range(r.randint(3, 6))]
        else:
            sample = " ".join(self.name().lower() for _ in range(r.randint(3, 6)))
        result = ref(sample)
        code = f"def {fname}({arg}):\n    \"\"\"Part of {owner}'s {r.choice(_PROJECTS)[2:]}.\"\"\"\n    {body.format(a=arg)}\n"
        user = r.choice((f"For {owner}'s project I need a Python function `{fname}` that {desc}.",
                         f"Could you write `{fname}` in Python? It {desc.replace('returns', 'should return', 1)}.",
                         f"{owner} asked me for a function called `{fname}` which {desc}. How would you do it?"))
        answer = self.think(on, f"A one-line idea should do; check it on {sample!r}.") \
            + f"```python\n{code}```\nFor example, `{fname}({sample!r})` returns `{result!r}`."
        if r.random() < 0.4:
            call = _call(self, "run_python", {"code": code + f"print({fname}({sample!r}))"})
            msgs = [{"role": "user", "content": user},
                    {"role": "assistant", "content": "Let me write it and run it once on a sample input.",
                     "tool_calls": [call]},
                    {"role": "tool", "content": repr(result)},
                    {"role": "assistant", "content": answer}]
            return self.row(split, msgs, on, "code_tool")
        msgs = [{"role": "user", "content": user}, {"role": "assistant", "content": answer}]
        if r.random() < 0.3:
            other = [r.randint(0, 99) for _ in range(3)] if kind == "nums" else self.name().lower() + " " + self.name()
            msgs += [{"role": "user", "content": f"And what does it give for {other!r}?"},
                     {"role": "assistant", "content": f"`{fname}({other!r})` returns `{ref(other)!r}`."}]
        return self.row(split, msgs, on, "code")

    def math(self, split: str) -> dict:
        r = self.rng
        on = r.random() < 0.6
        text, expr, fn = r.choice(_MATH_TEMPLATES)
        a, b, c = r.randint(12, 400), r.randint(2, 60), r.randint(1, 90)
        if "gives away" in text:
            a = b * c + r.randint(1, 300)
        q = text.format(p=self.name(), a=a, b=b, c=c, item=r.choice(_ITEMS))
        expression, result = expr.format(a=a, b=b, c=c), fn(a, b, c)
        think = self.think(on, r.choice((f"I need {expression}. Working it out step by step gives {result}.",
                                         f"First the product, then the rest: {expression} is {result}.",
                                         f"Let me set it up as {expression}; that evaluates to {result}.",
                                         f"So {q.split('.')[0].lower()}; the arithmetic is {expression}.")))
        if r.random() < 0.4:
            msgs = [{"role": "user", "content": q},
                    {"role": "assistant", "content": "", "tool_calls": [_call(self, "calculator", {"expression": expression})]},
                    {"role": "tool", "content": str(result)},
                    {"role": "assistant", "content": think + r.choice((
                         f"The calculator confirms {expression} = {result}, so the answer is **{result}**.",
                         f"The tool returned {result}. Final answer: **{result}**.",
                         f"Result: {result} (from {expression}).",
                     ))}]
            return self.row(split, msgs, on, "math_tool")
        msgs = [{"role": "user", "content": q},
                {"role": "assistant", "content": think + r.choice((
                    f"We compute {expression} = {result}. The answer is **{result}**.",
                    f"Since {expression} = {result}, there are **{result}** in the end.",
                    f"**{result}**, because {expression} = {result}.",
                ))}]
        return self.row(split, msgs, on, "math")

    def tool_calling(self, split: str) -> dict:
        r = self.rng
        on = r.random() < 0.3
        user_name, home, helper = self.name(), self.name(), self.name()
        tools = r.sample(sorted(_TOOLS), 2)
        system = (f"You are {helper}, the assistant of {user_name}, who lives in {home} and prefers "
                  f"{r.choice(_PREFERENCES)}. Today is {r.randint(1, 28)} {r.choice(_MONTHS)} 2025. "
                  "Tools: " + "; ".join(_TOOLS[t] for t in tools) + ".")
        msgs = [{"role": "system", "content": system}]
        for k, tool in enumerate(tools[: 1 + (r.random() < 0.3)]):
            ask, args, result, reply = self._tool_exchange(tool, home)
            msgs += [{"role": "user", "content": r.choice(_OPENERS) + ask},
                     {"role": "assistant", "content": self.think(on and k == 0, f"{user_name} asked; {tool} fits."),
                      "tool_calls": [_call(self, tool, args)]},
                     {"role": "tool", "content": json.dumps(result)},
                     {"role": "assistant", "content": reply + r.choice(_SIGNOFFS)}]
        return self.row(split, msgs, on, "tool_calling")

    def _tool_exchange(self, tool: str, home: str) -> tuple[str, dict, dict, str]:
        r = self.rng
        if tool == "get_weather":
            city = r.choice((home, self.name()))
            t, cond = r.randint(-12, 36), r.choice(_CONDITIONS)
            return (f"How is the weather in {city} right now?", {"city": city}, {"temp_c": t, "condition": cond},
                    f"Right now it is {t} °C and {cond} in {city}.")
        if tool == "convert_currency":
            amount = r.randint(5, 5000)
            src, dst = r.sample(_CURRENCIES, 2)
            rate = round(r.uniform(0.2, 150.0), 4)
            out = round(amount * rate, 2)
            return (f"Convert {amount} {src} to {dst}, please.",
                    {"amount": amount, "from_currency": src, "to_currency": dst}, {"converted": out, "rate": rate},
                    f"{amount} {src} is about {out} {dst} at a rate of {rate}.")
        if tool == "get_stock_price":
            ticker = self.name()[:4].upper()
            price = round(r.uniform(3, 900), 2)
            return (f"What's {ticker} trading at?", {"ticker": ticker}, {"ticker": ticker, "price": price},
                    f"{ticker} last traded at {price}.")
        if tool == "book_table":
            place, people, hour = self.name() + " Bistro", r.randint(2, 9), f"{r.randint(17, 22)}:{r.choice(('00', '30'))}"
            return (f"Book a table for {people} at {place} at {hour}.",
                    {"restaurant": place, "people": people, "time": hour}, {"status": "confirmed", "ref": self.name()},
                    f"Done: a table for {people} at {place} at {hour} is confirmed.")
        origin, dest = home, self.name()
        date = f"2025-{r.randint(1, 12):02d}-{r.randint(1, 28):02d}"
        n = r.randint(0, 4)
        return (f"Find me flights from {origin} to {dest} on {date}.", {"origin": origin, "destination": dest, "date": date},
                {"flights": n}, f"I found {n} flights from {origin} to {dest} on {date}.")

    def normal(self, split: str) -> tuple[dict, dict | None]:
        if split in ("chat", "stem"):
            return self.context_qa(split)
        return {"code": self.code, "math": self.math, "tool_calling": self.tool_calling}[split](split), None


def _msg(role: str, content: str | None, tool_calls: list | None = None) -> dict:
    return {"role": role, "content": content, "tool_calls": tool_calls or []}


def _call(gen: _Gen, name: str, args: dict) -> dict:
    return {"id": f"call_{gen.rng.getrandbits(48):012x}", "type": "function",
            "function": {"name": name, "arguments": json.dumps(args)}}


def _clone(gen: _Gen, row: dict) -> dict:
    out = json.loads(json.dumps(row))
    out["uuid"] = gen.uuid()
    return out


def _exact_duplicate(gen: _Gen, base: dict) -> dict:
    """Same text up to case and whitespace: the user turn upper-cased, single spaces doubled in the answer."""
    row = _clone(gen, base)
    for m in row["messages"]:
        if m["role"] == "user":
            m["content"] = m["content"].upper()
    last = row["messages"][-1]
    last["content"] = last["content"].replace(" ", "  ")
    return row


def _near_duplicate(gen: _Gen, base: dict) -> dict:
    """Two words of the system paragraph swapped for others (about 0.9 character-5-gram Jaccard)."""
    row = _clone(gen, base)
    system = row["messages"][0]
    words = system["content"].split(" ")
    candidates = [i for i, w in enumerate(words) if w.isalpha() and len(w) >= 4 and w.islower()]
    for i in sorted(gen.rng.sample(candidates, 2)):
        words[i] = gen.rng.choice([w for w in _SWAP_WORDS if w != words[i]])
    system["content"] = " ".join(words)
    return row


def _char_jaccard(a: dict, b: dict, n: int = 5) -> float:
    """Exact Jaccard of the two rows' lower-cased, whitespace-collapsed character n-gram sets."""
    def shingles(row: dict) -> set[str]:
        text = " ".join(" ".join((m["content"] or "") for m in row["messages"]).lower().split())
        return {text[i : i + n] for i in range(len(text) - n + 1)}
    sa, sb = shingles(a), shingles(b)
    return len(sa & sb) / max(1, len(sa | sb))


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
        paragraph = f"The shoreline of {gen.name()} keeps changing with the seasons and the tides. "
        msgs[1]["content"] = paragraph * (MAX_CHARS // len(paragraph) + 1 + variant)
    else:  # pragma: no cover - reasons are the fixed tuple below
        raise ValueError(reason)
    return row


_REASONS = ("missing_uuid", "missing_messages", "bad_role", "undecodable_text", "empty_answer", "too_long")


def write_sample_dataset(out_dir: str, seed: int = 0, rows_per_split: int = 60) -> SampleManifest:
    """Write the sample dataset, its eval set and planted.json under ``out_dir``; return where.

    Deterministic: the same (seed, rows_per_split) writes byte-identical files. Existing files are replaced.
    """
    if rows_per_split < MIN_ROWS_PER_SPLIT:
        raise RaytrainError(f"rows_per_split must be >= {MIN_ROWS_PER_SPLIT} to fit the planted rows, got {rows_per_split}")
    gen = _Gen(seed)
    eval_items = _eval_items(gen, 8)
    planted: dict = {
        "seed": seed, "rows_per_split": rows_per_split, "max_chars": MAX_CHARS, "ngram": NGRAM,
        "near_dup_threshold": NEAR_DUP_THRESHOLD, "allowed_licenses": list(ALLOWED_LICENSES),
        "quarantine": [], "quarantine_counts": {r: QUARANTINE_PER_REASON for r in _REASONS},
        "exact_duplicates": [], "near_duplicates": [], "contaminated": [], "not_contaminated": [],
        "disallowed_license": [], "context_answers": [],
    }
    malformed = [(reason, v) for v in range(QUARANTINE_PER_REASON) for reason in _REASONS]
    split_rows: dict[str, list[tuple[dict, str, dict]]] = {}
    for s_idx, split in enumerate(SPLITS):
        special: list[tuple[dict, str, dict]] = []  # (row, planted kind, key entry)
        for j, (reason, v) in enumerate(malformed):
            if j % len(SPLITS) == s_idx:
                special.append((_malformed(gen, split, reason, v), "quarantine", {"reason": reason}))
        if s_idx < len(DISALLOWED_LICENSES):
            row = gen.normal(split)[0]
            row["license"] = DISALLOWED_LICENSES[s_idx]
            special.append((row, "disallowed_license", {"license": row["license"]}))
        item = eval_items[s_idx]
        special.append((_contaminated(gen, split, item), "contaminated", {"eval_id": item["id"]}))
        if split == "chat":
            miss = eval_items[len(SPLITS)]
            special.append((_near_miss(gen, split, miss), "not_contaminated", {"eval_id": miss["id"]}))
        normals = []
        while len(normals) + len(special) + 1 + (2 if split in ("chat", "stem") else 0) < rows_per_split:
            normals.append(gen.normal(split))
        exact_base = normals[0][0]
        special.append((_exact_duplicate(gen, exact_base), "exact_duplicates", {"duplicate_of": exact_base["uuid"]}))
        if split in ("chat", "stem"):
            near = []
            for base, _ in normals[1:]:
                twin = _near_duplicate(gen, base)
                # Keep only clear near-duplicates (true Jaccard >= 0.9), far from a 0.8 threshold's noise.
                if _char_jaccard(base, twin) >= 0.9:
                    near.append((twin, "near_duplicates", {"duplicate_of": base["uuid"]}))
                if len(near) == 2:
                    break
            if len(near) < 2:  # pragma: no cover - context paragraphs are long enough in practice
                raise RaytrainError(f"sample_data: could not plant near-duplicates in {split}; raise rows_per_split")
            special.extend(near)
        rows = [(row, "context_answers" if key else "", key or {}) for row, key in normals] + special
        gen.rng.shuffle(rows)
        split_rows[split] = rows

    os.makedirs(out_dir, exist_ok=True)
    split_paths, num_bytes = {}, 0
    for split, rows in split_rows.items():
        for idx, (row, kind, key) in enumerate(rows):
            if kind:
                planted[kind].append({"split": split, "row": idx, "uuid": row["uuid"], **key})
        path = os.path.join(out_dir, split, "part-00000.parquet")
        os.makedirs(os.path.dirname(path), exist_ok=True)
        pq.write_table(pa.Table.from_pylist([r for r, _, _ in rows], schema=NEMOTRON_V1_SCHEMA), path,
                       compression="zstd")
        split_paths[split] = path
        num_bytes += os.path.getsize(path)
    eval_path = os.path.join(out_dir, "eval", "eval_set.jsonl")
    os.makedirs(os.path.dirname(eval_path), exist_ok=True)
    with open(eval_path, "w", encoding="utf-8") as f:
        f.writelines(json.dumps(item, sort_keys=True) + "\n" for item in eval_items)
    planted_path = os.path.join(out_dir, "planted.json")
    with open(planted_path, "w", encoding="utf-8") as f:
        json.dump(planted, f, indent=1, sort_keys=True)
    num_bytes += os.path.getsize(eval_path) + os.path.getsize(planted_path)
    return SampleManifest(out_dir, seed, rows_per_split, split_paths, eval_path, planted_path, num_bytes)


def load_planted(out_dir: str) -> dict:
    """The answer key written by write_sample_dataset."""
    with open(os.path.join(out_dir, "planted.json"), encoding="utf-8") as f:
        return json.load(f)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m raytrain.sample_data", description=__doc__.split("\n")[0])
    parser.add_argument("out_dir")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--rows-per-split", type=int, default=60)
    args = parser.parse_args(argv)
    m = write_sample_dataset(args.out_dir, seed=args.seed, rows_per_split=args.rows_per_split)
    print(f"wrote {len(m.split_paths)} splits x {m.rows_per_split} rows ({m.num_bytes} bytes) to {m.out_dir}; "
          f"answer key {m.planted_path}, eval set {m.eval_path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
