"""One Parquet file of good rows and rows built to break a reader, laid out as the hub publishes the dataset
(``<out_dir>/data/chat-00000-of-00001.parquet``), with the quarantine reason each bad row must get.

The bad rows are the ones a Parquet footer check cannot see: invalid UTF-8 bytes inside a nested string (written
through a binary array viewed as string: neither pyarrow's Parquet writer nor its reader validate UTF-8), a message
that is null where a struct belongs, one row of ``huge_chars`` characters (50 MB by default), and a row of
``many_turns`` turns. A file-level type mismatch (``content`` written as a list) is ``write_wrong_schema_file``:
every row of such a file has the wrong type, which the footer check refuses before any row is read.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import pyarrow as pa
import pyarrow.parquet as pq

from raytrain.enrich.schema import MESSAGE_TYPE, NEMOTRON_V1_SCHEMA

SHARD = "chat-00000-of-00001.parquet"
HUGE_CHARS = 50_000_000
MANY_TURNS = 10_000

_TOPICS = (("tide", "Why does the tide rise twice a day?", "The moon's pull and the earth's rotation make two bulges."),
           ("bread", "Why does bread dough rise?", "Yeast ferments sugar and the carbon dioxide lifts the dough."),
           ("rust", "What makes iron rust?", "Iron reacts with oxygen and water to form hydrated iron oxide."),
           ("rainbow", "How does a rainbow form?", "Sunlight refracts in raindrops and each colour bends apart."))


@dataclass(frozen=True)
class BadRowsFile:
    """What ``write_bad_rows_file`` wrote: the dataset root, the shard, and each row's expected door."""

    out_dir: str
    path: str
    expected: dict[str, str]
    """uuid -> "ok" (kept) or the quarantine reason the row must get."""


def _row(uuid: str, messages: list | None) -> dict:
    return {"uuid": uuid, "license": "cc-by-4.0", "generator": "hand", "version": "v1", "category": "chat",
            "reasoning": "off", "messages": messages, "metadata": "{}"}


def _msg(role: str, content: str) -> dict:
    return {"role": role, "content": content, "tool_calls": None}


def _qa(question: str, answer: str) -> list[dict]:
    return [_msg("user", question), _msg("assistant", answer)]


def write_bad_rows_file(out_dir: str, huge_chars: int = HUGE_CHARS, many_turns: int = MANY_TURNS) -> BadRowsFile:
    """Write ``<out_dir>/data/chat-00000-of-00001.parquet``: four good rows, then one row each of invalid UTF-8
    (``undecodable_text``), a null message (``bad_role``), ``huge_chars`` characters (``too_long``) and
    ``many_turns`` turns (``too_many_turns``). Returns the path and the expected door of every row."""
    rows = [_row(f"good-{name}", _qa(q, a)) for name, q, a in _TOPICS]
    expected = {r["uuid"]: "ok" for r in rows}
    marker = "\x01BAD-UTF8\x01"  # replaced by invalid bytes below; its own bytes are unique in the file
    rows.append(_row("bad-utf8", _qa(f"What is {marker} in this text?", "Bytes that decode to nothing.")))
    rows.append(_row("bad-nested", [_msg("user", "Is this message list well formed?"), None]))
    rows.append(_row("huge-row", _qa("Summarize this: " + "all work and no play " * (huge_chars // 21 + 1),
                                     "It repeats one sentence.")))
    turns = [_msg("user" if i % 2 == 0 else "assistant", f"turn {i}") for i in range(many_turns)]
    rows.append(_row("many-turns", turns))
    expected.update({"bad-utf8": "undecodable_text", "bad-nested": "bad_role", "huge-row": "too_long",
                     "many-turns": "too_many_turns"})

    table = pa.Table.from_pylist(rows, schema=NEMOTRON_V1_SCHEMA)
    table = table.set_column(table.schema.get_field_index("messages"), "messages",
                             _with_invalid_utf8(table.column("messages").combine_chunks(), marker))
    path = os.path.join(out_dir, "data", SHARD)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    pq.write_table(table, path, compression="zstd")
    return BadRowsFile(out_dir, path, expected)


def _with_invalid_utf8(messages: pa.ListArray, marker: str) -> pa.ListArray:
    """``messages`` with ``marker`` in any content replaced by the bytes ff fe (never valid UTF-8), rebuilt from a
    binary array viewed as string: pyarrow checks UTF-8 when it builds a string array from Python, not here."""
    structs = messages.values
    content = structs.field("content").cast(pa.binary())
    fixed = [None if v is None else v.replace(marker.encode(), b"\xff\xfe") for v in content.to_pylist()]
    content = pa.array(fixed, pa.binary()).view(pa.string())
    children = [content if f.name == "content" else structs.field(f.name) for f in MESSAGE_TYPE]
    structs = pa.StructArray.from_arrays(children, fields=list(MESSAGE_TYPE), mask=structs.is_null())
    return pa.ListArray.from_arrays(messages.offsets, structs, type=messages.type, mask=messages.is_null())


def write_wrong_schema_file(out_dir: str) -> str:
    """Write ``<out_dir>/data/chat-00000-of-00001.parquet`` whose ``messages[].content`` is a list of strings (some
    exports keep multi-part content so): a whole file of the wrong nested type. Returns its path."""
    message = pa.struct([("role", pa.string()), ("content", pa.list_(pa.string()))])
    schema = pa.schema([*(f for f in NEMOTRON_V1_SCHEMA if f.name != "messages"), ("messages", pa.list_(message))])
    rows = [{**_row("parts", None), "messages": [{"role": "user", "content": ["Hello", "there"]},
                                                 {"role": "assistant", "content": ["Hi"]}]}]
    path = os.path.join(out_dir, "data", SHARD)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    pq.write_table(pa.Table.from_pylist(rows, schema=schema), path)
    return path
