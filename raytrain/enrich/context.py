"""What the relevance selection reads from a conversation and how its result goes back in; pure Python.

Three rules, so that selection never costs a row its instructions:

- **Instructions reach the tokenizer verbatim.** A reasoning toggle ("detailed thinking on", "/no_think", ...) is
  an instruction, never a context sentence. With ``enrich.system_prompt=keep`` (default) no system prompt is
  changed at all: the selected sentences go into a delimited block of their own at the top of the last user
  turn (``with_context_block``), and the question follows unchanged.
- **Candidates are prose of the context**: the sentences (raytrain.enrich.sentences) of the system prompt(s) less
  their toggle lines, and of the turns before the last user turn. JSON (tool lists, tool results), rendered tool
  calls and fenced code are not sentences a reader can be pointed at and are left out.
- **The answer side of the score reads the answer**: the text after ``</think>`` (``final_answer``), not the start
  of the reasoning trace, unless ``enrich.answer_text=full``.

``enrich.system_prompt=select`` is the user's explicit choice to trim long prose system prompts to their selected
sentences (``with_selected_system_prompt``); toggle lines stay, rows with tool calls keep their system prompt (it
is their tool list), and the enrichment reports the rows changed and the characters removed.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

from raytrain.enrich.conversation import render_message_text
from raytrain.enrich.sentences import split_sentences

CONTEXT_OPEN = "<context>"
CONTEXT_CLOSE = "</context>"
THINK_CLOSE = "</think>"

# Whole lines that switch reasoning on or off (Nemotron/Llama-Nemotron "detailed thinking", Qwen3 "/think").
_TOGGLE_LINE = re.compile(r"^\s*(?:detailed thinking (?:on|off)|/think|/no_think)\s*$", re.IGNORECASE)
# Units that are data, not prose: JSON, rendered tool calls, markup, fenced code.
_NOT_PROSE_START = ("{", "[", "<", "```", "~~~")
_MIN_PROSE_WORDS = 3


def is_toggle_line(line: str) -> bool:
    """True for a line that is only a reasoning toggle ("detailed thinking on", "/no_think", ...)."""
    return bool(_TOGGLE_LINE.match(line))


def split_system_prompt(text: str) -> tuple[list[str], str]:
    """(toggle lines in order, the rest of the prompt with those lines removed and stripped)."""
    toggles, rest = [], []
    for line in text.splitlines():
        (toggles if is_toggle_line(line) else rest).append(line)
    return [t.strip() for t in toggles], "\n".join(rest).strip()


def final_answer(answer: str) -> str:
    """The text after the last ``</think>`` (the answer without its reasoning trace), stripped.

    A turn without a closed trace is returned whole; a turn that is only a trace (its answer is a tool call, say)
    falls back to the whole text rather than an empty string, which embeds to nothing useful."""
    if THINK_CLOSE not in answer:
        return answer.strip()
    tail = answer.rsplit(THINK_CLOSE, 1)[1].strip()
    return tail or answer.strip()


def answer_for_scoring(answer: str, mode: str) -> str:
    """The answer text the score embeds: ``final_answer`` for mode "final", the whole turn for "full"."""
    return final_answer(answer) if mode == "final" else answer


def prose_units(units: Sequence[str]) -> list[str]:
    """The units that are prose: not JSON, markup or code, at least three words."""
    return [u for u in units if not u.startswith(_NOT_PROSE_START) and len(u.split()) >= _MIN_PROSE_WORDS]


@dataclass(frozen=True)
class Candidates:
    """A row's candidate context sentences, in conversation order, and where they came from."""

    system: list[str]
    """Sentences of the system prompt(s), toggle lines excluded."""
    earlier: list[str]
    """Sentences of the turns before the last user turn."""

    @property
    def all(self) -> list[str]:
        return self.system + self.earlier


def last_user_index(messages: Sequence[dict]) -> int:
    return max(i for i, m in enumerate(messages) if m["role"] == "user")


def candidate_sentences(messages: Sequence[dict], include_earlier_turns: bool = True) -> Candidates:
    """The prose sentences a row's selection may choose from (see the module docstring).

    In: normalized messages (conversation.Example.messages). Out: Candidates; both lists empty when the row has
    no context (single turn, empty or toggle-only system prompt)."""
    system: list[str] = []
    earlier: list[str] = []
    last_user = last_user_index(messages)
    for m in messages[:last_user]:
        if m["role"] == "system":
            system.extend(prose_units(split_sentences(split_system_prompt(m["content"])[1])))
        elif include_earlier_turns:
            earlier.extend(prose_units(split_sentences(render_message_text(m))))
    return Candidates(system, earlier)


def _copy(m: dict) -> dict:
    return {**m, "tool_calls": [dict(c, function=dict(c["function"])) for c in m.get("tool_calls") or []]}


def context_block(sentences: Sequence[str]) -> str:
    """``<context>\\n<s1>\\n<s2>\\n</context>``: the selected sentences, one per line, clearly delimited."""
    return "\n".join([CONTEXT_OPEN, *sentences, CONTEXT_CLOSE])


def with_context_block(messages: Sequence[dict], sentences: Sequence[str]) -> list[dict]:
    """Copies of ``messages`` with ``context_block(sentences)`` and a blank line put before the last user turn's
    text; every other message (system prompts included) unchanged. No sentences: plain copies."""
    out = [_copy(m) for m in messages]
    kept = [s.strip() for s in sentences if s and s.strip()]
    if kept:
        last_user = last_user_index(out)
        out[last_user]["content"] = context_block(kept) + "\n\n" + out[last_user]["content"]
    return out


def with_selected_system_prompt(messages: Sequence[dict], sentences: Sequence[str]) -> tuple[list[dict], int]:
    """``enrich.system_prompt=select``: every system message replaced by its toggle lines, a blank line and the
    selected sentences (one per line; only the first system message gets them); returns (messages, characters
    removed). A system message left empty is dropped."""
    out: list[dict] = []
    before = after = 0
    placed = False
    kept = [s.strip() for s in sentences if s and s.strip()]
    for m in messages:
        m = _copy(m)
        if m["role"] == "system":
            before += len(m["content"])
            toggles, _ = split_system_prompt(m["content"])
            parts = ["\n".join(toggles), "" if placed else "\n".join(kept)]
            placed = True
            m["content"] = "\n\n".join(p for p in parts if p)
            after += len(m["content"])
            if not m["content"]:
                continue
        out.append(m)
    return out, before - after
