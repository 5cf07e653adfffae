"""Schema validation against files written by pyarrow itself."""

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from raytrain.enrich.schema import MESSAGE_TYPE, NEMOTRON_V1_SCHEMA, conform_table, validate_schema
from raytrain.errors import RaytrainError

ROW = {
    "uuid": "u1", "license": "cc-by-4.0", "generator": "g", "version": "v1", "category": "chat", "reasoning": "off",
    "messages": [
        {"role": "user", "content": "hi", "tool_calls": []},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]},
    ],
    "metadata": "{}",
}


def _write(tmp_path, table, name="f.parquet"):
    path = str(tmp_path / name)
    pq.write_table(table, path)
    return path, pq.read_schema(path)


def test_canonical_file_validates_and_round_trips(tmp_path):
    path, schema = _write(tmp_path, pa.Table.from_pylist([ROW], schema=NEMOTRON_V1_SCHEMA))
    validate_schema(schema, path)
    assert pq.read_table(path).to_pylist() == [ROW]


def test_inferred_schema_with_extra_column_and_large_string_validates(tmp_path):
    # pyarrow's own inference from python dicts, plus an extra column and a large_string column
    table = pa.Table.from_pylist([dict(ROW, extra=1)])
    table = table.set_column(0, "uuid", table.column("uuid").cast(pa.large_string()))
    path, schema = _write(tmp_path, table)
    validate_schema(schema, path)
    conformed = conform_table(pq.read_table(path), path)
    assert conformed.schema.equals(NEMOTRON_V1_SCHEMA)
    assert conformed.to_pylist() == [ROW]


def test_all_null_tool_calls_column_is_accepted(tmp_path):
    rows = [dict(ROW, messages=[{"role": "user", "content": "q", "tool_calls": None},
                                {"role": "assistant", "content": "a", "tool_calls": None}])]
    path, schema = _write(tmp_path, pa.Table.from_pylist(rows))  # pyarrow infers tool_calls: null
    validate_schema(schema, path)
    assert conform_table(pq.read_table(path), path).column("messages").type == pa.list_(MESSAGE_TYPE)


def test_missing_column_names_column_and_file(tmp_path):
    table = pa.Table.from_pylist([ROW], schema=NEMOTRON_V1_SCHEMA).drop_columns(["reasoning"])
    path, schema = _write(tmp_path, table, "nore.parquet")
    with pytest.raises(RaytrainError, match=r"nore\.parquet.*'reasoning' is missing"):
        validate_schema(schema, path)


def test_mistyped_column_names_column(tmp_path):
    table = pa.Table.from_pylist([ROW], schema=NEMOTRON_V1_SCHEMA)
    table = table.set_column(table.schema.get_field_index("version"), "version", pa.array([3], pa.int64()))
    path, schema = _write(tmp_path, table)
    with pytest.raises(RaytrainError, match=r"column version has type int64, expected string"):
        validate_schema(schema, path)


def test_mistyped_nested_field_names_dotted_path(tmp_path):
    msgs = pa.array([[{"role": 1, "content": "x"}]], pa.list_(pa.struct([("role", pa.int32()), ("content", pa.string())])))
    table = pa.Table.from_pylist([ROW], schema=NEMOTRON_V1_SCHEMA)
    table = table.set_column(table.schema.get_field_index("messages"), "messages", msgs)
    path, schema = _write(tmp_path, table)
    with pytest.raises(RaytrainError, match=r"messages\[\]\.role has type int32"):
        validate_schema(schema, path)


def test_missing_nested_field_is_reported(tmp_path):
    msgs = pa.array([[{"content": "x"}]], pa.list_(pa.struct([("content", pa.string())])))
    table = pa.Table.from_pylist([ROW], schema=NEMOTRON_V1_SCHEMA)
    table = table.set_column(table.schema.get_field_index("messages"), "messages", msgs)
    path, schema = _write(tmp_path, table)
    with pytest.raises(RaytrainError, match=r"messages\[\]\.role is missing"):
        validate_schema(schema, path)


def test_conform_drops_extra_struct_fields_on_sliced_tables():
    rows = [dict(ROW, uuid=f"u{i}", messages=[dict(m, reasoning_content=f"r{i}", content=f"{m['content']}{i}")
                                              for m in ROW["messages"]]) for i in range(4)]
    rows[2]["messages"] = None
    table = pa.Table.from_pylist(rows).slice(1, 3)  # non-zero offsets in every nested array
    out = conform_table(table, "mem")
    expected = [dict(r, messages=None if r["messages"] is None else [
        {k: v for k, v in m.items() if k != "reasoning_content"} for m in r["messages"]]) for r in rows[1:4]]
    assert out.schema.equals(NEMOTRON_V1_SCHEMA)
    assert out.to_pylist() == expected
