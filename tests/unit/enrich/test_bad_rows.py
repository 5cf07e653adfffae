"""The bad-rows file (raytrain.sample_data.bad_rows) holds what it says, and its bad rows are invisible to the
footer check: the Parquet footers validate, pyarrow reads the file, and only decoding the one row's bytes fails.
The pure derive path (conversation.derive_example) agrees with the expected door of every row, so the Spark test
that runs the file (tests/integration/test_storage_forms.py) checks the JVM guard against an independent reference.
"""

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from raytrain.enrich.conversation import Example, derive_example
from raytrain.enrich.inputs import discover_inputs, validate_inputs
from raytrain.errors import RaytrainError
from raytrain.sample_data.bad_rows import write_bad_rows_file, write_wrong_schema_file
from raytrain.storage import resolve


def test_bad_rows_pass_the_footer_check_and_derive_to_their_expected_doors(tmp_path):
    bad = write_bad_rows_file(str(tmp_path), huge_chars=1_000_100, many_turns=1_001)
    assert bad.path == str(tmp_path / "data" / "chat-00000-of-00001.parquet")
    footers = validate_inputs(discover_inputs(resolve(str(tmp_path)), ("chat",)))
    assert footers["chat"]["rows"] == len(bad.expected) == 8
    table = pq.read_table(bad.path)
    with pytest.raises(pa.ArrowInvalid, match="Invalid UTF8"):
        table.validate(full=True)
    uuids = table.column("uuid").to_pylist()
    for i, uuid in enumerate(uuids):
        row = table.slice(i, 1)
        if uuid == "bad-utf8":
            with pytest.raises(UnicodeDecodeError):  # what broke the Spark task: the conversion to Python text
                row.to_pylist()
            # read as bytes instead, the row reaches derive_example, which refuses bytes that are not UTF-8
            as_bytes = pa.list_(pa.struct([("role", pa.string()), ("content", pa.binary())]))
            messages = row.column("messages").cast(as_bytes).to_pylist()[0]
            assert any(b"\xff\xfe" in m["content"] for m in messages)
            record = {**row.drop_columns(["messages"]).to_pylist()[0], "messages": messages}
        else:
            record = row.to_pylist()[0]
        out = derive_example(record)
        got = "ok" if isinstance(out, Example) else out.reason
        assert got == bad.expected[uuid], (uuid, out)


def test_a_file_of_the_wrong_nested_type_is_refused_naming_file_and_field(tmp_path):
    """content written as a list of strings: every row of the file has the wrong type, so the footer check refuses
    the file before Spark starts, with its path, the field and the fix."""
    path = write_wrong_schema_file(str(tmp_path))
    with pytest.raises(RaytrainError) as caught:
        validate_inputs(discover_inputs(resolve(str(tmp_path)), ("chat",)))
    message = str(caught.value)
    assert path in message and "column messages[].content has type list<element: string>, expected string" in message
    assert "Fix:" in message


def test_files_of_one_split_disagreeing_on_a_null_typed_field_are_refused_before_spark(tmp_path):
    """One file wrote tool_calls all-null (type null, as pyarrow and HF datasets do for an all-null column), its
    sibling with the struct type: each passes the schema check alone, but Spark reads the split with one schema
    and failed the task ("optional int32 tool_calls is not a group"). Refused naming the field and both files; the
    fix the message gives (conform_table) makes the split readable."""
    from raytrain.enrich.schema import NEMOTRON_V1_SCHEMA, conform_table

    def row(uuid):
        return {"uuid": uuid, "license": "cc-by-4.0", "generator": "g", "version": "v1", "category": "chat",
                "reasoning": "off", "metadata": "{}", "messages": [{"role": "user", "content": "hi", "tool_calls": None},
                             {"role": "assistant", "content": "hello", "tool_calls": None}]}

    typed, null = (str(tmp_path / "data" / f"chat-0000{i}-of-00002.parquet") for i in range(2))
    (tmp_path / "data").mkdir()
    pq.write_table(pa.Table.from_pylist([row("a")], schema=NEMOTRON_V1_SCHEMA), typed)
    pq.write_table(pa.Table.from_pylist([row("b")]), null)  # inferred: tool_calls is type null
    assert pa.types.is_null(pq.read_schema(null).field("messages").type.value_type.field("tool_calls").type)
    inputs = discover_inputs(resolve(str(tmp_path)), ("chat",))
    with pytest.raises(RaytrainError) as caught:
        validate_inputs(inputs)
    assert str(caught.value).startswith(f"split 'chat': column messages[].tool_calls is all-null (type null) in "
                                        f"file://{null} but typed in file://{typed}")
    pq.write_table(conform_table(pq.read_table(null), null), null)
    assert validate_inputs(inputs)["chat"]["schema"].equals(NEMOTRON_V1_SCHEMA)
