"""Refuse the rows a Python worker must never receive, with Spark SQL expressions that run in the executor's JVM.

In:  the raw input DataFrame (uuid, license, category, reasoning, messages, ...), ``max_chars``, ``max_turns``.
Out: the same rows plus ``guard_reason`` / ``guard_detail`` (null for a row that passes). A refused row leaves
     with its uuid and category only (made valid UTF-8, at most 200 characters); its other text columns become
     null, so its bytes stop in the JVM and the first pass (batches.prepare_batch) quarantines it with that reason.

Why in the JVM: Spark hands rows to Python in Arrow batches cut by row count only
(spark.sql.execution.arrow.maxRecordsPerBatch; Spark 3.5 has no bytes-based setting), so one 50 MB row would
travel, and be copied into pandas, with its whole batch before the Python ``max_chars`` check saw it; and a
string column holding bytes that are not UTF-8 makes pyarrow's conversion to pandas raise for the whole batch,
which fails the task and so the job. Checked here, in order (the first that applies is the reason):

- ``undecodable_text``: a string anywhere in the row whose bytes are not valid UTF-8 (its bytes differ from its
  re-encoding, which replaces each invalid sequence with U+FFFD), among the strings of at most ``max_chars``;
- ``too_many_turns``: more than ``max_turns`` messages;
- ``too_long``: the row's message text and tool-call arguments together over ``max_chars`` characters (the
  measure conversation.derive_example uses), or any single string of the row over ``max_chars``.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import reduce

from pyspark.sql import Column, DataFrame
from pyspark.sql import functions as F
from pyspark.sql import types as T

from raytrain.dataset.conversation_rules import UNDECODABLE_TEXT
from raytrain.enrich.batches import GUARD_DETAIL, GUARD_REASON
from raytrain.enrich.conversation import TOO_LONG, TOO_LONG_DETAIL, TOO_MANY_TURNS, TOO_MANY_TURNS_DETAIL

KEPT_CHARS = 200
"""Characters of a refused row's uuid and category kept for the quarantine record."""
_CHECKED = ("uuid", "license", "category", "reasoning", "messages")


def _leaf_checks(col: Column, dtype: T.DataType, path: str, test: Callable[[Column], Column]) -> list[tuple[str, Column]]:
    """(path, Column true when ``test`` holds for that string anywhere in ``col``) for every string leaf of
    ``dtype``: struct fields by name, array elements through ``exists``. Never null (a null value passes)."""
    if isinstance(dtype, T.StringType):
        return [(path, F.coalesce(test(col), F.lit(False)))]
    if isinstance(dtype, T.StructType):
        return [leaf for f in dtype.fields for leaf in _leaf_checks(col[f.name], f.dataType, f"{path}.{f.name}", test)]
    if isinstance(dtype, T.ArrayType):
        inner = f"{path}[]"
        paths = [p for p, _ in _leaf_checks(F.lit(None).cast(dtype.elementType), dtype.elementType, inner, test)]
        return [(p, F.coalesce(F.exists(col, _element_check(i, dtype.elementType, inner, test)), F.lit(False)))
                for i, p in enumerate(paths)]
    return []


def _element_check(i: int, dtype: T.DataType, path: str, test: Callable[[Column], Column]) -> Callable[[Column], Column]:
    # a one-argument function: pyspark reads a lambda's parameter count to pick the element (and index) variables
    def check(x: Column) -> Column:
        return _leaf_checks(x, dtype, path, test)[i][1]
    return check


def _invalid_utf8(s: Column, max_chars: int) -> Column:
    # UTF8String -> java.lang.String replaces every invalid sequence, so only valid UTF-8 re-encodes to its own bytes.
    # The re-encoding copies the string twice: one over max_chars is refused as too_long without it (And is
    # evaluated left to right and stops at the first false).
    return s.isNotNull() & (F.length(s) <= max_chars) & (s.cast("binary") != F.encode(s, "UTF-8"))


def message_chars(messages: Column, dtype: T.DataType) -> Column:
    """Characters of every message's content and tool-call arguments (derive_example's too_long measure); 0 for
    a null list, fields the file's schema lacks count 0."""
    element = dtype.elementType if isinstance(dtype, T.ArrayType) else None
    if not isinstance(element, T.StructType):
        return F.lit(0).cast("long")
    fields = {f.name: f.dataType for f in element.fields}

    def per_message(m: Column) -> Column:
        n = F.coalesce(F.length(m["content"]), F.lit(0)).cast("long") \
            if isinstance(fields.get("content"), T.StringType) else F.lit(0).cast("long")
        calls = fields.get("tool_calls")
        call = calls.elementType if isinstance(calls, T.ArrayType) else None
        fn = dict((f.name, f.dataType) for f in call.fields).get("function") if isinstance(call, T.StructType) else None
        if isinstance(fn, T.StructType) and isinstance(dict((f.name, f.dataType) for f in fn.fields).get("arguments"),
                                                       T.StringType):
            args = F.aggregate(m["tool_calls"], F.lit(0).cast("long"), lambda acc, c: acc + F.coalesce(
                F.length(c["function"]["arguments"]), F.lit(0)).cast("long"))
            n = n + F.coalesce(args, F.lit(0).cast("long"))
        return n

    return F.coalesce(F.aggregate(messages, F.lit(0).cast("long"), lambda acc, m: acc + per_message(m)),
                      F.lit(0).cast("long"))


def _first(checks: list[tuple[str, Column]], detail: Callable[[str], str]) -> tuple[Column, Column]:
    """(any check true, the detail of the first true one) over ``checks``."""
    if not checks:
        return F.lit(False), F.lit(None).cast("string")
    hit = reduce(lambda a, b: a | b, (c for _, c in checks))
    text = reduce(lambda acc, pc: acc.when(pc[1], F.lit(detail(pc[0]))), checks[1:],
                  F.when(checks[0][1], F.lit(detail(checks[0][0]))))
    return hit, text


def guard_rows(raw: DataFrame, max_chars: int, max_turns: int) -> DataFrame:
    """``raw`` with ``guard_reason`` and ``guard_detail`` added and the refused rows' text nulled (module
    docstring). Columns of ``_CHECKED`` the DataFrame lacks are skipped."""
    types = {f.name: f.dataType for f in raw.schema.fields}
    present = [c for c in _CHECKED if c in types]
    def undecodable(s: Column) -> Column:
        return _invalid_utf8(s, max_chars)

    utf8, utf8_detail = _first([leaf for c in present for leaf in _leaf_checks(F.col(c), types[c], c, undecodable)],
                               lambda p: f"{p} holds bytes that are not valid UTF-8 (the row was not decoded)")
    long_leaf, long_detail = _first(
        [leaf for c in present for leaf in _leaf_checks(F.col(c), types[c], c, lambda s: F.length(s) > max_chars)],
        lambda p: f"{p} holds a string of more than max_chars={max_chars} characters")
    has_messages = "messages" in types and isinstance(types["messages"], T.ArrayType)
    turns = F.coalesce(F.size("messages"), F.lit(0)) if has_messages else F.lit(0)
    chars = message_chars(F.col("messages"), types["messages"]) if has_messages else F.lit(0).cast("long")
    reason = (F.when(utf8, F.lit(UNDECODABLE_TEXT)).when(turns > max_turns, F.lit(TOO_MANY_TURNS))
              .when(chars > max_chars, F.lit(TOO_LONG)).when(long_leaf, F.lit(TOO_LONG)))
    # The checks run once per row; the detail, built from the reason in a projection of its own, re-reads them
    # only for the rows refused.
    checked = raw.withColumn(GUARD_REASON, reason)
    refused_as = F.col(GUARD_REASON)
    too_long = F.when(chars > max_chars, F.format_string(
        TOO_LONG_DETAIL.format(num_chars="%d", max_chars=max_chars), chars)).otherwise(long_detail)
    detail = (F.when(refused_as == UNDECODABLE_TEXT, utf8_detail)
              .when(refused_as == TOO_MANY_TURNS,
                    F.format_string(TOO_MANY_TURNS_DETAIL.format(turns="%d", max_turns=max_turns), turns))
              .when(refused_as == TOO_LONG, too_long))
    checked = checked.withColumn(GUARD_DETAIL, detail)
    refused = F.col(GUARD_REASON).isNotNull()

    def kept_text(c: str) -> Column:  # valid UTF-8 (U+FFFD for invalid bytes) and short, for the quarantine record
        return F.when(refused, F.substring(F.decode(F.encode(F.col(c), "UTF-8"), "UTF-8"), 1, KEPT_CHARS)) \
            .otherwise(F.col(c))

    out = []
    for name in checked.columns:
        if name in ("uuid", "category") and isinstance(types.get(name), T.StringType):
            out.append(kept_text(name).alias(name))
        elif name in present:
            out.append(F.when(refused, F.lit(None)).otherwise(F.col(name)).alias(name))
        else:
            out.append(F.col(name))
    return checked.select(*out)
