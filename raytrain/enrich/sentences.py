"""Split context text into sentence-sized units for relevance scoring.

Regex-based, pure and deterministic (no model, no locale): the same text gives the same list on every worker.
Units are: fenced code blocks (kept whole), list items and other lines (a newline always ends a unit), and the
sentences inside a line. A sentence ends at ``.``, ``!`` or ``?`` (plus closing quotes/brackets) followed by
whitespace and a capital letter, digit or opening quote, unless the word before the period is a known
abbreviation ("e.g.", "Dr.") or an initial ("J. Smith", "U.S."). Decimals ("3.14") never split because no
whitespace follows their period. CJK full-width terminators split without needing whitespace.

The rules are ours, not pysbd's or blingfire's: neither keeps fenced code or newline units, and neither is faster
(docs/decisions.md, 'Sentence splitting by our own rules').
"""

from __future__ import annotations

import re

# Lower-cased words that end in a period without ending the sentence.
ABBREVIATIONS = frozenset(
    """
    e.g. i.e. cf. vs. viz. al. approx. ca. mr. mrs. ms. dr. prof. sr. jr. st. mt. inc. ltd. corp. dept.
    gen. gov. jan. feb. mar. apr. jun. jul. aug. sep. sept. oct. nov. dec. u.s. u.k. a.m. p.m. ph.d.
    """.split()
)
# Abbreviations that precede a number ("No. 5", "Fig. 3"); before anything else their period ends a sentence.
NUMBERED_ABBREVIATIONS = frozenset("no. nos. vol. fig. figs. eq. eqs. ch. sec. pp. p.".split())

# Opening fence of a code block: ``` or ~~~ (3+), optional language; the block runs to the same fence.
_FENCE = re.compile(r"^[ \t]*(`{3,}|~{3,})[^\n]*$", re.MULTILINE)
# A sentence end: terminator run, optional closing quotes/brackets, whitespace, then a sentence-like start.
_BOUNDARY = re.compile(r"[.!?]+[\"'\u201d\u2019)\]]*(\s+)(?=[\"'\u201c\u2018(\[]?[A-Z0-9\u00c0-\u00de])")
_CJK_BOUNDARY = re.compile(r"[\u3002\uff01\uff1f]+")
_LAST_WORD = re.compile(r"(\S+)$")
_INITIALS = re.compile(r"^(?:[A-Za-z]\.)+$")  # "J." or "U.S."


def split_code_blocks(text: str) -> list[tuple[bool, str]]:
    """[(is_code, chunk)] in order; an unclosed fence makes the rest of the text one code block."""
    out: list[tuple[bool, str]] = []
    pos = 0
    while True:
        m = _FENCE.search(text, pos)
        if m is None:
            out.append((False, text[pos:]))
            return out
        out.append((False, text[pos : m.start()]))
        fence = m.group(1)
        close = re.compile(r"^[ \t]*" + re.escape(fence[0]) + "{" + str(len(fence)) + r",}[ \t]*$", re.MULTILINE)
        end = close.search(text, m.end())
        stop = len(text) if end is None else end.end()
        out.append((True, text[m.start() : stop]))
        pos = stop


def _ends_with_abbreviation(segment: str, next_char: str) -> bool:
    """True when the period ending ``segment`` belongs to an abbreviation or initial, not to a sentence end.

    Reference abbreviations ("No.", "Fig.", "p.") only count before a number: "the answer is no. Then" splits.
    """
    m = _LAST_WORD.search(segment)
    if m is None or not m.group(1).endswith("."):
        return False
    word = m.group(1).lstrip("(\"'\u201c\u2018[")
    low = word.lower()
    if low in NUMBERED_ABBREVIATIONS:
        return next_char.isdigit()
    return low in ABBREVIATIONS or bool(_INITIALS.match(word))


def _split_line(line: str) -> list[str]:
    sentences = []
    start = 0
    for m in _BOUNDARY.finditer(line):
        end = m.start(1)  # just after the terminator and any closing quotes
        next_char = line[m.end()] if m.end() < len(line) else ""
        if _ends_with_abbreviation(line[start:end], next_char):
            continue
        sentences.append(line[start:end])
        start = m.end()
    sentences.append(line[start:])
    out = []
    for s in sentences:
        pieces = _CJK_BOUNDARY.split(s)
        marks = _CJK_BOUNDARY.findall(s)
        out.extend(p + (marks[i] if i < len(marks) else "") for i, p in enumerate(pieces))
    return out


def split_sentences(text: str) -> list[str]:
    """Split ``text`` into stripped, non-empty units in their original order (see the module docstring)."""
    if not text:
        return []
    units: list[str] = []
    for is_code, chunk in split_code_blocks(text):
        if is_code:
            units.append(chunk.strip("\n"))
            continue
        for line in chunk.splitlines():
            units.extend(_split_line(line))
    return [u.strip() for u in units if u.strip()]
