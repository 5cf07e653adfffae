"""The length policy: what happens to a conversation longer than ``dataset.seq_len`` tokens. Pure.

Real Nemotron code and math rows average 40-48 KB, most of them longer than 4,096 Mistral tokens, so this is a
per-run choice (``dataset.length_policy``), applied the same way by the enrichment (which counts and quarantines)
and by packing (which builds the sequences):

- ``drop`` (default): the row is quarantined as ``too_many_tokens`` with its token count; nothing of it trains.
- ``truncate``: the prompt is kept whole and the final answer is cut at ``seq_len`` tokens, so the model learns
  the start of the answer to its own question. A row whose prompt leaves no answer token inside ``seq_len`` is
  dropped as above (its detail says so).
- ``split``: the tokens are cut into ``seq_len`` chunks, each trained as its own document (the pre-existing
  behaviour, opt-in): every token trains, but the chunks after the first see the answer without its question.

The final answer is the last run of loss-mask tokens (the last assistant turn, its EOS included).

A preference pair (``decide_pair_length``) takes its prompt twice and both responses in ONE pack, so the policy
applies to the pair as a whole: ``drop`` quarantines it; ``truncate`` keeps the prompt whole and cuts the end of the
responses, the longer one first, so the two stay comparable and each keeps at least one token (a cut response loses
its EOS, as a truncated answer does); ``split`` cannot apply (the two sequences must share one pack), so the config
refuses it with ``train.objective: dpo``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from raytrain.dataset.reasons import Reason
from raytrain.errors import RaytrainError

KEEP, DROP, TRUNCATE, SPLIT = "keep", "drop", "truncate", "split"
TOO_MANY_TOKENS = Reason.TOO_MANY_TOKENS
"""Quarantine reason of a conversation the policy drops."""


@dataclass(frozen=True)
class LengthDecision:
    """What the policy does with one conversation."""

    action: str
    """KEEP (fits), DROP, TRUNCATE or SPLIT."""
    num_tokens: int
    """Tokens of the whole conversation."""
    train_tokens: int
    """Tokens that go into packs: num_tokens, seq_len after truncation, 0 when dropped."""
    detail: str = ""
    """Why a row was dropped (the quarantine detail)."""

    @property
    def tokens_removed(self) -> int:
        return self.num_tokens - self.train_tokens


def final_answer_start(loss_mask: Sequence[bool]) -> int:
    """Index of the first token of the last run of True in ``loss_mask`` (len(loss_mask) when there is none)."""
    end = len(loss_mask)
    while end > 0 and not loss_mask[end - 1]:
        end -= 1
    start = end
    while start > 0 and loss_mask[start - 1]:
        start -= 1
    return start if end else len(loss_mask)


def decide_length(loss_mask: Sequence[bool], seq_len: int, policy: str) -> LengthDecision:
    """Apply ``policy`` (drop | truncate | split) to a tokenized conversation given by its loss mask."""
    n = len(loss_mask)
    if policy not in (DROP, TRUNCATE, SPLIT):
        raise RaytrainError(f"dataset.length_policy {policy!r}: choose 'drop', 'truncate' or 'split'")
    if n <= seq_len:
        return LengthDecision(KEEP, n, n)
    if policy == SPLIT:
        return LengthDecision(SPLIT, n, n)
    if policy == TRUNCATE:
        start = final_answer_start(loss_mask)
        # Position t's label is token t+1: at least one answer token must sit at an index in [1, seq_len).
        if start < seq_len:
            return LengthDecision(TRUNCATE, n, seq_len)
        return LengthDecision(DROP, n, 0, f"{n} tokens > dataset.seq_len={seq_len}, and the prompt alone is "
                                          f"{start} tokens: nothing of the answer would fit (length_policy "
                                          "truncate)")
    return LengthDecision(DROP, n, 0, f"{n} tokens > dataset.seq_len={seq_len} (length_policy drop; "
                                      "choose truncate or split, or a longer seq_len, to keep such rows)")


def apply_length(input_ids: Sequence[int], loss_mask: Sequence[bool], seq_len: int, policy: str,
                 doc_id: str = "") -> tuple[Sequence[int], Sequence[bool]]:
    """The tokens packing uses: cut to ``seq_len`` under truncate, unchanged under split or when they fit.

    A conversation the policy drops is an error here: the enrichment quarantines those, so meeting one means the
    enriched data was made with other settings."""
    decision = decide_length(loss_mask, seq_len, policy)
    if decision.action == DROP:
        raise RaytrainError(f"document {doc_id!r}: {decision.detail}; the enrichment should have quarantined it. "
                            "Re-run the enrichment with the same dataset settings as packing.")
    if decision.action == TRUNCATE:
        return input_ids[:seq_len], loss_mask[:seq_len]
    return input_ids, loss_mask


@dataclass(frozen=True)
class PairLengthDecision:
    """What the policy does with one preference pair."""

    action: str
    """KEEP (fits), DROP or TRUNCATE."""
    prompt: int
    """Tokens of the prompt (kept whole; it is in the pack twice)."""
    num_tokens: int
    """Tokens the whole pair takes in a pack: 2 * prompt + chosen + rejected, before any cut."""
    chosen: int
    """Tokens of the chosen response that go into the pack (its start); 0 when dropped."""
    rejected: int
    """Tokens of the rejected response that go into the pack (its start); 0 when dropped."""
    detail: str = ""
    """Why a pair was dropped (the quarantine detail)."""

    @property
    def train_tokens(self) -> int:
        """Tokens that go into the pack: 0 when dropped."""
        return 0 if self.action == DROP else 2 * self.prompt + self.chosen + self.rejected

    @property
    def tokens_removed(self) -> int:
        """Tokens cut by truncation (0 when kept whole or dropped: a dropped pair is counted as a quarantined row)."""
        return self.num_tokens - self.train_tokens if self.action == TRUNCATE else 0


def decide_pair_length(prompt: int, chosen: int, rejected: int, seq_len: int, policy: str) -> PairLengthDecision:
    """Apply ``policy`` (drop | truncate) to a preference pair given by its token counts.

    Under truncate the budget B = seq_len - 2 * prompt goes to the responses, the longer cut first: a shorter one
    that fits in B / 2 stays whole and the longer gets the rest; otherwise each gets B // 2, the odd token to the
    longer (chosen on a tie). A pair whose prompt leaves fewer than one token per response is dropped. ``split``
    raises RaytrainError: a pair's two sequences share one pack."""
    if policy == SPLIT:
        raise RaytrainError("dataset.length_policy 'split' cannot apply to a preference pair: its two sequences "
                            "share one pack; choose 'drop' or 'truncate'")
    if policy not in (DROP, TRUNCATE):
        raise RaytrainError(f"dataset.length_policy {policy!r}: choose 'drop' or 'truncate' for preference pairs")
    n = 2 * prompt + chosen + rejected
    if n <= seq_len:
        return PairLengthDecision(KEEP, prompt, n, chosen, rejected)
    counts = (f"the pair takes {n} tokens in a pack (prompt {prompt} twice, chosen {chosen}, rejected {rejected}) "
              f"> dataset.seq_len={seq_len}")
    if policy == DROP:
        return PairLengthDecision(DROP, prompt, n, 0, 0, f"{counts}; a pair is never split (length_policy drop; "
                                                         "choose truncate, or a longer seq_len, to keep such pairs)")
    budget = seq_len - 2 * prompt
    if budget < 2:
        return PairLengthDecision(DROP, prompt, n, 0, 0, (
            f"{counts}, and the prompt alone is {prompt} tokens: twice that leaves {max(budget, 0)} of seq_len for "
            "the two responses, fewer than one token each (length_policy truncate; raise dataset.seq_len to keep "
            "such pairs)"))
    chosen_longer = chosen >= rejected
    shorter = min(chosen, rejected)
    if 2 * shorter <= budget:
        keep_shorter, keep_longer = shorter, budget - shorter
    else:
        keep_shorter, keep_longer = budget // 2, budget - budget // 2
    kept = (keep_longer, keep_shorter) if chosen_longer else (keep_shorter, keep_longer)
    return PairLengthDecision(TRUNCATE, prompt, n, *kept)
