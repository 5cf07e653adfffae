"""Why a row leaves through the quarantine door: one vocabulary for the checks that decide it and the report that
counts it. Every row of an enrichment is kept or quarantined with exactly one of these."""

from __future__ import annotations

from enum import StrEnum


class Reason(StrEnum):
    """A quarantine reason; the value is what the quarantine files and the report hold."""

    # derive: the row itself (the JVM row guard, raytrain.dataset.conversation_rules, raytrain.enrich.conversation)
    MISSING_UUID = "missing_uuid"
    MISSING_MESSAGES = "missing_messages"
    BAD_ROLE = "bad_role"
    UNDECODABLE_TEXT = "undecodable_text"
    EMPTY_ANSWER = "empty_answer"
    TOO_LONG = "too_long"
    TOO_MANY_TURNS = "too_many_turns"
    # derive, preference pairs only (raytrain.enrich.preference)
    MISSING_RESPONSE = "missing_response"
    BAD_PREFERENCE = "bad_preference"
    TIE = "tie"
    # the steps after derive, in the order they decide (raytrain.enrich.batches and passes; the length policy)
    LICENSE = "license"
    EXACT_DUPLICATE = "exact_duplicate"
    NEAR_DUPLICATE = "near_duplicate"
    CONTAMINATED = "contaminated"
    UNTOKENIZABLE = "untokenizable"
    TOO_MANY_TOKENS = "too_many_tokens"


DERIVE_REASONS: tuple[Reason, ...] = tuple(Reason)[: list(Reason).index(Reason.LICENSE)]
"""The reasons decided while deriving a row's conversation (before any step)."""
STEP_REASONS: tuple[Reason, ...] = tuple(Reason)[len(DERIVE_REASONS):]
"""The reasons the steps after derive decide, in their order."""
