"""The row factory's machinery: one seeded random stream, fresh names, template slots, row assembly, length growth.

``_RowFactory`` wraps the ``random.Random`` that drives the whole dataset; every method draws from it in a fixed
order, so the same seed writes the same bytes. It draws each row's target length (stratified lognormal, see
``grow``) and fills the row's final turn up to it with filler sentences whose slots (``_Slots``) take fresh
values, keeping each row below ``MAX_ROW_SIMILARITY`` of the earlier rows of its split. The small message
helpers (``_msg``, ``_call``, ``_tool_spec``) live here too.
"""

from __future__ import annotations

import json
import math
import random
import uuid as uuidlib
from statistics import NormalDist

from raytrain.sample_data.similarity import SeenRows
from raytrain.sample_data.spec import CARD_BYTES_PER_ROW, LENGTH_SIGMA, MAX_LENGTH_QUANTILE
from raytrain.sample_data.vocab import (
    _ADJS,
    _CURRENCIES,
    _DATA_STRUCTURES,
    _DAYS,
    _EVENTS,
    _FIELDS,
    _FILLER_LINES,
    _FOODS,
    _MONTHS,
    _PREFERENCES,
    _SOURCES,
    _SYLLABLES,
    _THINGS,
    _TOGGLES,
    _TOOL_NAMES,
    _TOOL_SPECS,
    _TYPES,
)

_GROW = "\x00grow\x00"  # where a row's length filler goes; replaced (by filler or nothing) before writing


def _slot_makers() -> dict:
    def num(lo, hi):
        return lambda g, s: g.rng.randint(lo, hi)

    def pick(options):
        return lambda g, s: g.rng.choice(options)

    def name(g, s):
        return g.word()

    return {
        "N": name, "N2": name, "P": name, "P2": name, "k": num(2, 99), "k2": num(100, 9999), "k3": num(3, 999),
        "dec": lambda g, s: f"{g.rng.randint(0, 99)}.{g.rng.randint(0, 999):03d}",
        "dec2": lambda g, s: f"{g.rng.randint(100, 400)}.{g.rng.randint(0, 99):02d}",
        "year": num(1700, 2024), "h": num(6, 22), "mm": lambda g, s: f"{g.rng.randint(0, 59):02d}",
        "pct": num(5, 95), "tz": num(0, 12), "month": pick(_MONTHS), "day": pick(_DAYS), "thing": pick(_THINGS),
        "event": pick(_EVENTS), "adj": pick(_ADJS), "adj2": pick(_ADJS), "cur": pick(_CURRENCIES),
        "var": lambda g, s: g.word().lower(), "var2": lambda g, s: g.word().lower(),
        "fn": lambda g, s: f"{g.word().lower()}_{g.rng.choice(('calc', 'helper', 'fn', 'op', 'util'))}",
        "mod": lambda g, s: g.word().lower(), "ret": pick(("None", "0", "[]", "False", "''", "-1")),
        "ds": pick(_DATA_STRUCTURES), "ds2": pick(_DATA_STRUCTURES), "cx": pick(("1", "log n", "n")),
        "ty": pick(_TYPES), "ty2": pick(_TYPES),
        "a": num(12, 999), "b": num(2, 99), "c": num(1, 999),
        "ab": lambda g, s: s["a"] * s["b"], "abc": lambda g, s: s["ab"] + s["c"],
        "ar": lambda g, s: round(s["a"], -1), "arb": lambda g, s: s["ar"] * s["b"],
        "parity": lambda g, s: "even" if s["ab"] % 2 == 0 else "odd",
        "a1": lambda g, s: s["a"] // 2, "a2": lambda g, s: s["a"] - s["a1"],
        "digsum": lambda g, s: sum(int(d) for d in str(s["ab"])), "bxa": lambda g, s: s["b"] * s["c"] + s["a"],
        "b2": lambda g, s: s["b"] ** 2, "b2a": lambda g, s: s["b2"] + s["a"],
        "kb": lambda g, s: s["k"] * s["b"], "kbc": lambda g, s: s["kb"] + s["c"],
        "tk": num(200, 900), "vol": num(1, 90), "kpa": lambda g, s: round(s["k"] * 8.314 * s["tk"] / s["vol"], 1),
        "wl": num(380, 750), "freq": lambda g, s: round(2998 / s["wl"], 2),
        "ev": lambda g, s: round(1239.84 / s["wl"], 2), "L": pick("ABCD"),
        "mass": num(2, 950), "force": num(5, 4000), "acc": lambda g, s: round(s["force"] / s["mass"], 3),
        "ml": lambda g, s: s["vol"] * 1000, "grams": lambda g, s: s["mass"] * 1000,
        "frac": lambda g, s: round(100 / 2 ** s["k"], 4) if s["k"] < 20 else "almost 0",
        "tool": pick(_TOOL_NAMES), "tool2": pick(_TOOL_NAMES), "pref": pick(_PREFERENCES),
        "status": pick(("200", "ok", "success", "partial")), "field": pick(_FIELDS),
    }


_SLOT_MAKERS = _slot_makers()


class _Slots(dict):
    """Template slots made on first use (in the template's left-to-right order, so deterministic)."""

    def __init__(self, gen: _RowFactory) -> None:
        super().__init__()
        self.gen = gen

    def __missing__(self, key: str):
        value = _SLOT_MAKERS[key](self.gen, self)
        self[key] = value
        return value



def _num_chars(row: dict) -> int:
    """Message text plus tool-call arguments: what EnrichConfig.max_chars limits."""
    return sum(len(m["content"] or "") + sum(len(c["function"]["arguments"]) for c in m["tool_calls"])
               for m in row["messages"] or [])


def _tool_spec(name: str) -> dict:
    description, params = _TOOL_SPECS[name]
    return {"name": name, "description": description,
            "parameters": {"type": "object", "properties": {p: {"type": t} for p, t in params.items()},
                           "required": list(params)}}


def _date(r: random.Random) -> str:
    return f"2025-{r.randint(1, 12):02d}-{r.randint(1, 28):02d}"


def _msg(role: str, content: str | None, tool_calls: list | None = None) -> dict:
    return {"role": role, "content": content, "tool_calls": tool_calls or []}


def _call(gen: _RowFactory, name: str, args: dict) -> dict:
    return {"id": f"call_{gen.rng.getrandbits(48):012x}", "type": "function",
            "function": {"name": name, "arguments": json.dumps(args)}}


class _RowFactory:
    """Row factory around one random.Random; every method consumes the stream in a fixed order.

    The shared machinery: names, slots, toggles, length growth and row assembly; ``rows._Gen`` adds the
    generator of each kind of row.
    """

    def __init__(self, seed: int, size_scale: float) -> None:
        self.rng = random.Random(seed)
        self.size_scale = size_scale
        self.used_names: set[str] = set()
        self.num_bands = 1
        self.bands: list[int] = []

    def start_split(self, num_rows: int) -> None:
        """Deal the next split's rows one length quantile band each (see grow)."""
        self.num_bands = num_rows
        self.bands = list(range(num_rows))
        self.rng.shuffle(self.bands)

    def name(self) -> str:
        """A name used nowhere else in the dataset (facts, eval items: what must not collide)."""
        while True:
            n = self.word()
            if n not in self.used_names and len(n) >= 4:
                self.used_names.add(n)
                return n

    def word(self) -> str:
        """A made-up capitalized name, possibly used before (filler)."""
        return "".join(self.rng.choice(_SYLLABLES) for _ in range(self.rng.randint(2, 3))).capitalize()

    def uuid(self) -> str:
        return str(uuidlib.UUID(int=self.rng.getrandbits(128), version=4))

    def slots(self) -> dict:
        r = self.rng
        return {
            "e": self.name(), "v": self.name(), "year": r.randint(1450, 2020), "num": r.randint(120, 9800),
            "num3": r.randint(3, 180), "dec": f"{r.randint(1, 99)}.{r.randint(0, 99):02d}",
            "food": r.choice(_FOODS), "month": r.choice(_MONTHS),
        }

    def fact(self, pool, avoid: tuple = ()) -> tuple[str, str, str]:
        """(context sentence, question, answer) from a template of ``pool`` other than those in ``avoid``."""
        tpl = self.rng.choice([t for t in pool if t not in avoid])
        s = self.slots()
        return tpl[0].format(**s), tpl[1].format(**s), tpl[2].format(**s)

    def toggle(self, on: bool) -> str | None:
        """A system prompt as the real rows have them: None (no system turn), "" or a reasoning toggle."""
        return None if self.rng.random() < 0.3 else self.rng.choice(_TOGGLES[on])

    def system(self, on: bool) -> list[dict]:
        t = self.toggle(on)
        return [] if t is None else [{"role": "system", "content": t}]

    @staticmethod
    def final(on: bool, trace: str, head: str, tail: str = "") -> str:
        """The final assistant turn, with the place its length filler goes: in the trace (on) or the explanation."""
        if on:
            return f"<think>\n{trace}{_GROW}\n</think>\n\n{head}" + (f"\n\n{tail}" if tail else "")
        return f"{head}{_GROW}" + (f"\n\n{tail}" if tail else "")

    def filler(self, split: str, min_chars: int) -> str:
        """Generated sentences of the split's kind, in paragraphs, at least ``min_chars`` characters."""
        r = self.rng
        lines = _FILLER_LINES[split]
        paragraphs, sentences, size = [], [], 0
        while size < min_chars:
            s = r.choice(lines).format_map(_Slots(self))
            sentences.append(s)
            size += len(s) + 1
            if len(sentences) >= r.randint(3, 6):
                paragraphs.append(" ".join(sentences))
                sentences = []
        if sentences:
            paragraphs.append(" ".join(sentences))
        return "\n\n".join(paragraphs)

    def grow(self, row: dict, split: str, seen: SeenRows) -> dict:
        """Draw the row's target length and fill its final turn up to it (or just drop the marker).

        ``seen``: the 5-gram sets of the split's rows so far. A row still too close to one of them (a short
        templated row next to its twin) gets more filler until it is not; its set is added to ``seen``.
        """
        mean = CARD_BYTES_PER_ROW[split] * self.size_scale
        # Stratified (Latin hypercube) draw: one quantile band per row, so a split's sample mean stays near
        # ``mean`` while the top bands still give the long tail.
        band = self.bands.pop() if self.bands else self.rng.randrange(self.num_bands)
        u = min((band + self.rng.random()) / self.num_bands, MAX_LENGTH_QUANTILE)
        target = math.exp(math.log(mean) - LENGTH_SIGMA**2 / 2 + LENGTH_SIGMA * NormalDist().inv_cdf(u))
        last = row["messages"][-1]
        template = last["content"]
        deficit = int(target) - (_num_chars(row) - len(_GROW)) - 2
        text = self.filler(split, deficit) if deficit > 0 else ""
        while True:
            last["content"] = template.replace(_GROW, "\n\n" + text if text else "")
            too_close, hashes, sig = seen.check(row)
            if not too_close:
                break
            text = (text + "\n\n" if text else "") + self.filler(split, 100)
        seen.add(hashes, sig)
        return row

    def row(self, split: str, messages: list[dict], reasoning: bool, template: str) -> dict:
        r = self.rng
        return {
            "uuid": self.uuid(),
            "license": "cc-by-4.0",
            "generator": r.choice(("DeepSeek-R1-0528", "Qwen3-235B-A22B")) if reasoning else "Qwen3-235B-A22B",
            "version": "v1",
            "category": split,
            "reasoning": "on" if reasoning else "off",
            "messages": [_msg(**m) for m in messages],
            "metadata": json.dumps({"source": r.choice(_SOURCES[split]),
                                    "difficulty": r.choice(("easy", "medium", "hard")), "template": template}),
        }

