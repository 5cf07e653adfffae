"""The word lists and templates the rows are made of: pure data, no randomness.

Name syllables and small vocabularies (foods, months, things, currencies), the fact templates of context rows
and their distractor asides, chat openers and sign-offs, the per-split filler sentences that grow a row to its
drawn length, the code tasks (with reference implementations), math word problems, the tool specs listed in
tool-calling system prompts, and the eval-set question templates, worded so that no training template shares a
13-gram with them.
"""

_SYLLABLES = (
    "ka lor ve min tha ros del ari quen bo sil mar eth ul pra zen gor li nav tes om rei dun cal fi "
    "jo brel tav ish mon sar vek ol dra pim hu ter gal yn cor ba"
).split()
_FOODS = "lichen,river snails,pine seeds,wild figs,algae,moss,clover,beetle larvae,acorns,plankton".split(",")
_MONTHS = "January February March April May June July August September October November December".split()
_DAYS = "Monday Tuesday Wednesday Thursday Friday Saturday Sunday".split()
_SWAP_WORDS = "amber bright quiet northern ancient famous narrow gentle distant hidden".split()
_TOGGLES = {True: ("detailed thinking on", "/think", ""), False: ("detailed thinking off", "/no_think", "")}
_SOURCES = {"chat": ("lmsys-style", "synthetic-chat", "helpsteer-style"), "code": ("codecontests", "synthetic-code"),
            "math": ("aops-style", "synthetic-math"), "stem": ("synthetic-stem", "mcq-style"),
            "tool_calling": ("synthetic-tools", "xlam-style")}

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
# Distractor sentences of a background paragraph (abbreviations on purpose: the sentence splitter must cope).
_ASIDES = (
    "Average rainfall in {e} is {dec} cm per month, e.g. in the wet season.",
    "Dr. {v} visited {e} in {year} and wrote about its markets.",
    "Most visitors reach {e} by train, approx. {num} of them per day.",
    "The old library of {e} holds {num} books.",
    "Local guides say the view from {e} Hill is best at 6 p.m. in {month}.",
)
_CLOSERS = ("", " Let me know if you want more detail.", " I hope that helps!", " That is all the background says.")
_OPENERS = ("", "Hi! ", "Quick question: ", "Hello there. ", "Sorry to bother you again. ", "I'm in a hurry. ",
            "Good morning! ", "One more thing. ")
_FOLLOWUPS = ("Thanks! ", "Great. ", "OK, next: ", "Another one. ", "Perfect, and ", "")
_SIGNOFFS = ("", " Anything else?", " Let me know if you need more.", " Have a good day!",
             " Shall I do anything else?", " Hope that helps.")

# Length filler: one tuple of sentence templates per split; _Slots fills each slot with a fresh random value.
_FILLER_LINES = {
    "chat": (
        "{N} told me the {thing} at the {P} market costs about {k2} {cur} these days.",
        "If you go in {month}, {P} has roughly {k} sunny days and the {event} draws {k2} visitors.",
        "A friend of {N} tried this in {P} and said it took {k} minutes, not the {k3} the guide promised.",
        "You could also ask {N} at the {P} library; they keep {k2} books on the subject.",
        "Budget around {k2} {cur} for {k} people, a bit more if {N} joins.",
        "In my notes from {year}, {N} ranked {P} number {k} out of {k3} towns for {thing}s.",
        "Trains from {P} to {P2} leave every {k} minutes and the ride costs {dec} {cur}.",
        "Keep in mind that {N}'s {thing} shop in {P} closes at {h}:{mm} on {day}s.",
        "Some people in {P} swear by {adj} {thing}s, others by the {adj2} ones {N} sells.",
        "As a rule of thumb, {pct}% of visitors to {P} stay {k} nights or fewer.",
    ),
    "code": (
        "Consider `{var}` with {k} items: the loop body runs {k} times and `{var2}` ends at {k2}.",
        "An empty `{var}` is the edge case; `{fn}` should return {ret} there instead of raising.",
        "Swapping the {ds} for a {ds2} keeps each lookup near O({cx}) even with {k2} elements.",
        "In `{mod}.py`, line {k3} calls `{fn}({var}={k})`, which is where an off-by-one would surface.",
        "On {k2} random inputs `{fn}` took {dec} ms, so there is no need to vectorize it.",
        "A test like `assert {fn}([{k}, {k3}]) == {ret}` would catch a regression in {N}'s refactor.",
        "Negative values such as -{k} need no special branch, because the comparison with {k3} still holds.",
        "`{var2}` is rebound on every pass, so the closure in `{fn}` never sees a stale `{var}`.",
        "Type hints like `list[{ty}]` help {N}'s linter flag a call with a {ty2} at line {k3}.",
        "The docstring of `{fn}` should say it copies `{var}` ({k2} bytes for {k} ints) instead of mutating it.",
    ),
    "math": (
        "Check: {a} × {b} = {ab}, and {ab} + {c} = {abc}.",
        "Dividing {ab} by {b} gives back {a}, so that product is right.",
        "As a sanity check, {a} rounds to {ar}, and {ar} × {b} = {arb}, close to {ab}.",
        "If instead we subtract, {abc} − {c} = {ab}, which matches the line before.",
        "Note that {a} × {b} = {ab} is {parity}, which the last digits {a} and {b} already tell us.",
        "Writing {a} as {a1} + {a2} gives {a1} × {b} + {a2} × {b} = {ab}.",
        "The digit sum of {ab} is {digsum}, a quick check modulo 9.",
        "Suppose x = {c}; then {b}x + {a} = {bxa}, which is not what the question asks.",
        "Squaring {b} gives {b2}; adding {a} gives {b2a}, a number that does not appear in the problem.",
        "Hmm, let me recount: {k} groups of {b} make {kb}, and {kb} + {c} = {kbc}.",
    ),
    "stem": (
        "Recall that {N}ium has {k} protons, so a neutral atom of it carries {k} electrons.",
        "For {k} mol of gas at {tk} K in {vol} L, pV = nRT gives p ≈ {kpa} kPa.",
        "Light at {wl} nm has a frequency of about {freq} × 10^14 Hz.",
        "Option ({L}) fails because {N}ol boils at {dec} °C, not at {dec2} °C.",
        "A {mass} kg cart pushed with {force} N accelerates at {acc} m/s², by Newton's second law.",
        "The {N} effect only matters above {k2} K, far from this setup.",
        "Converting units: {vol} L is {ml} mL, and {mass} kg is {grams} g.",
        "A half-life of {dec} h means that after {k} half-lives about {frac}% of {N}-{k3} remains.",
        "{N}'s {year} measurement put the constant at {dec} ± 0.{k3}, which agrees within error.",
        "Energy per photon is E = hf ≈ {ev} eV at {wl} nm, below the ionization energy of {N}ium.",
    ),
    "tool_calling": (
        "The {tool} result lists {k2} entries for {N}; only the first {k} matter here.",
        "{N} prefers {pref}, so the summary should lead with {P} before {P2}.",
        "The call returned in {k2} ms with status {status}, so no retry is needed.",
        "If {tool} had failed, the fallback would be asking {N} for the {field} directly.",
        "The arguments need `{field}` as a {ty}; passing {k} as text would be rejected.",
        "Earlier in {month}, {N} asked the same about {P}, when the answer was {k2}.",
        "There is no need to call {tool2} as well; {tool} already covers {P}.",
        "The response field `{field}` is {k}, which I should quote exactly rather than round to {k3}.",
        "{N}'s time zone is UTC+{tz}, so {h}:{mm} local is what the reply should say.",
        "Only {k} of the {k2} results fit the budget of {dec} {cur} that {N} mentioned.",
    ),
}
_THINGS = ("bicycle", "tea", "bread", "lamp", "rug", "kite", "cheese", "candle", "hat", "map", "soap", "honey")
_EVENTS = ("lantern parade", "harvest fair", "boat race", "jazz week", "book market", "kite festival")
_ADJS = ("cheap", "hand-made", "imported", "local", "old", "tiny", "bright", "heavy", "spiced", "foldable")
_CURRENCIES = ("EUR", "USD", "GBP", "JPY", "CHF", "SEK")
_DATA_STRUCTURES = ("list", "dict", "set", "deque", "heap", "sorted list", "tuple", "trie")
_TYPES = ("int", "str", "float", "bytes", "bool", "dict")
_PREFERENCES = ("short answers", "metric units", "morning flights", "quiet restaurants", "plain language",
                "exact figures", "window seats", "cheap options")
_FIELDS = ("date", "city", "price", "ticker", "status", "amount", "reference", "total", "count", "eta")
_TOOL_NAMES = ("get_weather", "convert_currency", "get_stock_price", "book_table", "search_flights", "send_email",
               "create_event", "translate_text", "track_package", "search_products")

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
    ("{p} reads {b} pages a day for {c} days and had already read {a} pages. How many pages is that in all?",
     "{a} + {b} * {c}", lambda a, b, c: a + b * c),
    ("Find the remainder when {a} * {b} is divided by {c}.", "({a} * {b}) % {c}", lambda a, b, c: (a * b) % c),
)
_ITEMS = "apples,pencils,marbles,stamps,lemons,candles,buttons,shells,tickets,bricks".split(",")

# name -> (description, {parameter: JSON type}); every parameter is required
_TOOL_SPECS = {
    "get_weather": ("Current weather for a city.", {"city": "string"}),
    "convert_currency": ("Convert an amount between currencies.",
                         {"amount": "number", "from_currency": "string", "to_currency": "string"}),
    "get_stock_price": ("Latest trade price of a stock.", {"ticker": "string"}),
    "book_table": ("Reserve a restaurant table.", {"restaurant": "string", "people": "integer", "time": "string"}),
    "search_flights": ("Search flights on a date.", {"origin": "string", "destination": "string", "date": "string"}),
    "send_email": ("Send an email.", {"to": "string", "subject": "string", "body": "string"}),
    "create_event": ("Add a calendar event.", {"title": "string", "date": "string", "duration_min": "integer"}),
    "translate_text": ("Translate text.", {"text": "string", "target_language": "string"}),
    "track_package": ("Shipping status of a parcel.", {"tracking_id": "string"}),
    "search_products": ("Search the shop's catalogue.", {"query": "string", "max_price": "number"}),
}

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
