"""One generator per kind of row: context Q&A, chat, code, math, stem and tool calling.

``_Gen`` extends the row factory with the templates of each split (multi-turn chat, code with a code-runner
call, math with a calculator, multiple-choice stem questions, tool calls answered by tool-role turns, and
context rows whose background paragraph holds exactly one answering sentence); ``normal`` picks the kind for a
row index and grows the row to its drawn length.
"""

from __future__ import annotations

import json

from raytrain.sample_data.factory import _call, _date, _RowFactory, _Slots, _tool_spec
from raytrain.sample_data.similarity import SeenRows
from raytrain.sample_data.vocab import (
    _ADJS,
    _ARG_NAMES,
    _ASIDES,
    _CLOSERS,
    _CODE_TASKS,
    _CURRENCIES,
    _DAYS,
    _EVENTS,
    _FILLER_LINES,
    _FOLLOWUPS,
    _GENERAL_FACTS,
    _ITEMS,
    _MATH_TEMPLATES,
    _MONTHS,
    _OPENERS,
    _PROJECTS,
    _SCIENCE_FACTS,
    _SIGNOFFS,
    _THINGS,
    _TOOL_NAMES,
)


class _Gen(_RowFactory):
    """The full row factory: ``_RowFactory`` plus a generator for each kind of row."""

    # --- one generator per kind of row; normal() grows each to its drawn length ----------------------------
    def context_qa(self, split: str) -> tuple[dict, dict]:
        """A background paragraph in the system prompt where one sentence answers the (last) question."""
        r = self.rng
        pool = _SCIENCE_FACTS if split == "stem" else _GENERAL_FACTS
        on = r.random() < 0.5
        target_tpl = r.choice(pool)
        target = self.fact((target_tpl,))
        # Other sentences come from other templates: a same-template twin would embed as close as the answer.
        first = self.fact(pool, (target_tpl,)) if r.random() < 0.3 else None
        distractors = [self.fact(pool, (target_tpl,))[0] for _ in range(3)] + [r.choice(_ASIDES).format(**self.slots())]
        sentences = [target[0]] + ([first[0]] if first else []) + distractors
        r.shuffle(sentences)
        toggle = self.toggle(on)
        background = "Background:\n" + " ".join(sentences)
        msgs = [{"role": "system", "content": f"{toggle}\n\n{background}" if toggle else background}]
        if first:
            msgs += [{"role": "user", "content": first[1]},
                     {"role": "assistant", "content": (f"<think>\nThe background states: {first[0]}\n</think>\n\n"
                                                       if on else "") + first[2] + r.choice(_CLOSERS)}]
        msgs += [{"role": "user", "content": target[1]},
                 {"role": "assistant", "content": self.final(on, f"Looking at the context: {target[0]}",
                                                             target[2] + r.choice(_CLOSERS))}]
        key = {"question": target[1], "answer_sentence": target[0], "distractors": distractors}
        return self.row(split, msgs, on, "context_qa_multi" if first else "context_qa"), key

    def chat(self, split: str) -> dict:
        """Mostly single-turn requests, some conversations of 2-4 user turns."""
        r = self.rng
        on = r.random() < 0.4
        msgs = self.system(on)
        turns = 1 if r.random() < 0.7 else r.randint(2, 4)
        for t in range(turns):
            ask, trace, head = self._chat_exchange()
            msgs.append({"role": "user", "content": r.choice(_OPENERS if t == 0 else _FOLLOWUPS) + ask})
            last = t == turns - 1
            msgs.append({"role": "assistant", "content": self.final(on, trace, head) if last else head})
        return self.row(split, msgs, on, "chat_multi" if turns > 1 else "chat")

    def _chat_exchange(self) -> tuple[str, str, str]:
        """(user request, reasoning trace, answer) of one chat exchange."""
        r = self.rng
        kind = r.randrange(6)
        place, person, thing = self.word(), self.word(), r.choice(_THINGS)
        if kind == 0:
            k = r.randint(3, 5)
            ideas = [f"{self.word()} {r.choice(('& Co.', 'House', 'Corner', 'Works', 'Studio'))}" for _ in range(k)]
            return (f"Can you suggest {k} names for a {thing} shop in {place}?",
                    f"{k} short names for a {thing} shop; something that sounds local to {place} would fit.",
                    f"Here are {k} ideas: " + ", ".join(ideas) + ".")
        if kind == 1:
            days, month = r.randint(2, 14), r.choice(_MONTHS)
            items = r.sample(("rain jacket", "sun hat", "charger", "walking shoes", "scarf", "water bottle",
                              "snacks", "phrasebook", "umbrella", "sweater", "sunscreen", "torch"), 4)
            return (f"What should I pack for {days} days in {place} in {month}?",
                    f"{days} days in {month}; {place} can be changeable, so layers.",
                    f"For {days} days in {place} in {month}, bring: " + ", ".join(items) + f", plus {days} changes of socks.")
        if kind == 2:
            adj = r.choice(_ADJS)
            return (f"Write a two-line poem about {person}'s {adj} {thing}.",
                    f"Two lines, rhyme optional; mention the {thing} and {person}.",
                    f"{person} keeps a {adj} {thing} by the {r.choice(('door', 'window', 'stove', 'gate'))},\n"
                    f"and {r.choice(('counts', 'guards', 'polishes', 'forgets'))} it {r.randint(2, 40)} times a day.")
        if kind == 3:
            event, day = r.choice(_EVENTS), r.choice(_DAYS)
            return (f"How do I politely decline {person}'s invitation to the {event} on {day}?",
                    f"Thank {person}, give a short reason, suggest another time.",
                    f"You could write: \"Dear {person}, thank you for inviting me to the {event}. I am away on {day}, "
                    f"but I would love to meet in {r.choice(_MONTHS)} instead.\"")
        if kind == 4:
            note = r.choice(_FILLER_LINES["chat"]).format_map(_Slots(self))
            return (f"Summarize this note from {person} in one line: \"{note}\"",
                    "One fact in the note; keep the numbers.",
                    f"{person}'s note, in short: " + note[0].lower() + note[1:])
        h, ahead, other = r.randint(0, 23), r.randint(1, 11), self.word()
        return (f"If it is {h:02d}:{r.choice(('00', '15', '30', '45'))} in {place}, what time is it in {other}, "
                f"which is {ahead} hours ahead?",
                f"Add {ahead} hours to {h} and wrap at 24.",
                f"It is {(h + ahead) % 24:02d} o'clock-ish in {other} (the minutes stay the same).")

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
        code = f"def {fname}({arg}):\n    \"\"\"Part of {owner}'s {r.choice(_PROJECTS).split(' ', 1)[1]}.\"\"\"\n    {body.format(a=arg)}\n"
        user = r.choice((f"For {owner}'s project I need a Python function `{fname}` that {desc}.",
                         f"Could you write `{fname}` in Python? It {desc.replace('returns', 'should return', 1)}.",
                         f"{owner} asked me for a function called `{fname}` which {desc}. How would you do it?"))
        trace = (f"The task: a function `{fname}({arg})` that {desc}. A short body should do; "
                 f"check it on {sample!r}, which should give {result!r}.")
        head = f"```python\n{code}```\n\n`{fname}` {desc}."
        example = f"For example, `{fname}({sample!r})` returns `{result!r}`."
        msgs = self.system(on) + [{"role": "user", "content": user}]
        if r.random() < 0.4:
            call = _call(self, "run_python", {"code": code + f"print({fname}({sample!r}))"})
            msgs += [{"role": "assistant", "content": "Let me write it and run it once on a sample input.",
                      "tool_calls": [call]},
                     {"role": "tool", "content": repr(result)},
                     {"role": "assistant", "content": self.final(on, trace, head, example)}]
            return self.row(split, msgs, on, "code_tool")
        if r.random() < 0.3:
            other = [r.randint(0, 99) for _ in range(3)] if kind == "nums" else self.name().lower() + " " + self.name()
            msgs += [{"role": "assistant", "content": f"{head}\n\n{example}"},
                     {"role": "user", "content": f"And what does it give for {other!r}?"},
                     {"role": "assistant", "content": self.final(on, f"Apply `{fname}` to {other!r} by hand.",
                                                                 f"`{fname}({other!r})` returns `{ref(other)!r}`.")}]
            return self.row(split, msgs, on, "code_multi")
        msgs.append({"role": "assistant", "content": self.final(on, trace, head, example)})
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
        trace = r.choice((f"I need {expression}. Working it out step by step gives {result}.",
                          f"First the product, then the rest: {expression} is {result}.",
                          f"Let me set it up as {expression}; that evaluates to {result}.",
                          f"So {q.split('.')[0].lower()}; the arithmetic is {expression}."))
        boxed = r.choice((f"The answer is **{result}**.", f"**Answer:** $\\boxed{{{result}}}$",
                          f"Final answer: \\boxed{{{result}}}"))
        if r.random() < 0.4:
            call_text = f"<think>\nThe calculator can check {expression}.\n</think>" if on else ""
            msgs = self.system(on) + [
                {"role": "user", "content": q},
                {"role": "assistant", "content": call_text,
                 "tool_calls": [_call(self, "calculator", {"expression": expression})]},
                {"role": "tool", "content": str(result)},
                {"role": "assistant", "content": self.final(
                    on, trace, f"The calculator confirms {expression} = {result}.", boxed)}]
            return self.row(split, msgs, on, "math_tool")
        msgs = self.system(on) + [
            {"role": "user", "content": q},
            {"role": "assistant", "content": self.final(on, trace, f"We compute {expression} = {result}.", boxed)}]
        return self.row(split, msgs, on, "math")

    def stem(self, split: str) -> dict:
        """A multiple-choice science question with a computed answer."""
        r = self.rng
        on = r.random() < 0.6
        kind, thing = r.randrange(5), self.name()
        if kind == 0:
            m, c, t1, dt = r.randint(10, 500), r.randint(1, 42) / 10, r.randint(5, 40), r.randint(5, 80)
            q = (f"A {m} g sample of {thing}ol is heated from {t1} °C to {t1 + dt} °C. Its specific heat is "
                 f"{c} J/(g·K). How much heat does it absorb?")
            value, unit, formula = round(m * c * dt, 1), "J", f"Q = m c ΔT = {m} × {c} × {dt}"
        elif kind == 1:
            v, t = r.randint(2, 90), r.randint(3, 600)
            q = f"The {thing} probe moves at a constant {v} m/s for {t} s. How far does it travel?"
            value, unit, formula = v * t, "m", f"d = v t = {v} × {t}"
        elif kind == 2:
            i, res = r.randint(1, 99) / 10, r.randint(2, 470)
            q = f"A current of {i} A flows through the {thing} resistor of {res} Ω. What is the voltage across it?"
            value, unit, formula = round(i * res, 1), "V", f"V = I R = {i} × {res}"
        elif kind == 3:
            m, vol = r.randint(20, 900), r.randint(5, 300)
            q = f"A block of {thing}ite has a mass of {m} g and a volume of {vol} cm³. What is its density?"
            value, unit, formula = round(m / vol, 2), "g/cm³", f"ρ = m / V = {m} / {vol}"
        else:
            m, molar = r.randint(1, 500), r.randint(10, 250)
            q = f"How many moles are in {m} g of {thing}ine, whose molar mass is {molar} g/mol?"
            value, unit, formula = round(m / molar, 3), "mol", f"n = m / M = {m} / {molar}"
        options = [value, round(value * 2, 3), round(value / 2, 3), round(value * 1.1 + 1, 3)]
        r.shuffle(options)
        letter = "ABCD"[options.index(value)]
        q += "\n" + "\n".join(f"{'ABCD'[k]}) {o} {unit}" for k, o in enumerate(options))
        trace = f"Use {formula} = {value} {unit}, which is option {letter}."
        msgs = self.system(on) + [{"role": "user", "content": q},
                                  {"role": "assistant", "content": self.final(on, trace, f"{formula} = {value} {unit}.",
                                                                              f"The answer is ({letter}).")}]
        return self.row(split, msgs, on, "stem_mcq")

    def tool_calling(self, split: str) -> dict:
        """Tools listed as JSON in the system prompt; calls, tool-role replies, a final answer."""
        r = self.rng
        on = r.random() < 0.5
        user_name, home = self.name(), self.name()
        tools = r.sample(_TOOL_NAMES, r.choice((1, 2, 2, 3)))
        toggle = self.toggle(on)
        header = r.choice(("You are a helpful assistant with access to these functions:",
                           "You can call the following functions when they help answer the user:"))
        tool_list = f"{header}\n{json.dumps([_tool_spec(t) for t in tools])}"
        msgs = [{"role": "system", "content": f"{toggle}\n{tool_list}" if toggle else tool_list}]
        exchanges = 2 if len(tools) > 1 and r.random() < 0.3 else 1
        for k in range(exchanges):
            used = tools[k : k + 2] if k == 0 and len(tools) > 1 and r.random() < 0.25 else [tools[k]]  # sometimes two calls at once
            parts = [self._tool_exchange(t, home) for t in used]
            ask = " Also, ".join(p[0] for p in parts)
            calls = [_call(self, t, p[1]) for t, p in zip(used, parts, strict=True)]
            msgs.append({"role": "user", "content": r.choice(_OPENERS) + ask})
            trace = f"For {user_name}: " + " and ".join(f"`{t}` with {json.dumps(p[1])}"
                                                      for t, p in zip(used, parts, strict=True)) + "."
            msgs.append({"role": "assistant", "content": f"<think>\n{trace}\n</think>" if on else "",
                         "tool_calls": calls})
            msgs += [{"role": "tool", "content": json.dumps(p[2])} for p in parts]
            reply = " ".join(p[3] for p in parts) + r.choice(_SIGNOFFS)
            if k == exchanges - 1:
                reply = self.final(on, "The tool answered: " + "; ".join(json.dumps(p[2]) for p in parts) + ".", reply)
            msgs.append({"role": "assistant", "content": reply})
        return self.row(split, msgs, on, "tool_calling")

    def _tool_exchange(self, tool: str, home: str) -> tuple[str, dict, dict, str]:
        """(user request, call arguments, tool result, answer sentence) for one call of ``tool``."""
        r = self.rng
        if tool == "get_weather":
            city = r.choice((home, self.name()))
            t, cond = r.randint(-12, 36), r.choice(("sunny", "cloudy", "light rain", "windy", "foggy", "snowing"))
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
        if tool == "send_email":
            to, topic = self.name(), r.choice(_EVENTS)
            return (f"Email {to} that I will be late for the {topic}.",
                    {"to": f"{to.lower()}@example.org", "subject": f"Late for the {topic}",
                     "body": f"Hi {to}, I will be about {r.randint(5, 55)} minutes late. Sorry!"},
                    {"sent": True, "id": self.name().lower()}, f"I emailed {to} about the {topic}.")
        if tool == "create_event":
            title, date, mins = f"{self.name()} review", _date(r), r.choice((15, 30, 45, 60, 90))
            return (f"Put a {mins}-minute '{title}' in my calendar on {date}.",
                    {"title": title, "date": date, "duration_min": mins}, {"created": True, "event_id": r.randint(1000, 99999)},
                    f"'{title}' is in your calendar on {date} for {mins} minutes.")
        if tool == "translate_text":
            phrase, lang = f"the {r.choice(_THINGS)} is at {self.name()}'s house", r.choice(("French", "German", "Spanish"))
            fake = " ".join(self.word().lower() for _ in range(5))
            return (f"How do I say '{phrase}' in {lang}?", {"text": phrase, "target_language": lang},
                    {"translation": fake}, f"In {lang}: \"{fake}\".")
        if tool == "track_package":
            tid, days = f"{self.name()[:3].upper()}{r.randint(100000, 999999)}", r.randint(0, 6)
            return (f"Where is my package {tid}?", {"tracking_id": tid},
                    {"status": "in transit", "eta_days": days, "last_city": self.name()},
                    f"Package {tid} is in transit and should arrive in {days} days.")
        if tool == "search_products":
            item, budget = r.choice(_THINGS), r.randint(10, 400)
            n, best = r.randint(0, 9), round(r.uniform(5, 400), 2)
            return (f"Find me a {item} under {budget} {r.choice(_CURRENCIES)}.", {"query": item, "max_price": budget},
                    {"results": n, "cheapest": best}, f"I found {n} {item}s; the cheapest costs {best}.")
        origin, dest, date = home, self.name(), _date(r)
        n = r.randint(0, 4)
        return (f"Find me flights from {origin} to {dest} on {date}.", {"origin": origin, "destination": dest, "date": date},
                {"flights": n}, f"I found {n} flights from {origin} to {dest} on {date}.")

    def normal(self, split: str, index: int, seen: SeenRows) -> tuple[dict, dict | None]:
        """Row ``index`` of a split's ordinary rows (grown to its drawn length, see grow) and its context answer
        key. Every other chat row and three in five stem rows are context rows, so their number is known ahead."""
        key = None
        if (split == "chat" and index % 2 == 0) or (split == "stem" and index % 5 < 3):
            row, key = self.context_qa(split)
        else:
            row = {"chat": self.chat, "code": self.code, "math": self.math, "stem": self.stem,
                   "tool_calling": self.tool_calling}[split](split)
        return self.grow(row, split, seen), key
