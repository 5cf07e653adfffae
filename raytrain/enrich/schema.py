"""The Arrow schema of the raw Nemotron-Post-Training-Dataset-v1 rows the enrichment reads (the tables the enrichment
writes are described in raytrain.enrich.batches; the message roles and the conversation rules in
raytrain.dataset.conversation_rules).

Pure pyarrow; no Spark. ``validate_schema`` runs on each input file's schema before any row is read, so a file
in the wrong shape fails with its path and the offending column instead of deep inside a Spark task.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa

from raytrain.errors import RaytrainError

TOOL_CALL_TYPE = pa.struct(
    [
        pa.field("id", pa.string()),
        pa.field("type", pa.string()),
        pa.field("function", pa.struct([pa.field("name", pa.string()), pa.field("arguments", pa.string())])),
    ]
)
MESSAGE_TYPE = pa.struct(
    [
        pa.field("role", pa.string()),
        pa.field("content", pa.string()),
        pa.field("tool_calls", pa.list_(TOOL_CALL_TYPE)),
    ]
)

NEMOTRON_V1_SCHEMA = pa.schema(
    [
        pa.field("uuid", pa.string()),
        pa.field("license", pa.string()),
        pa.field("generator", pa.string()),
        pa.field("version", pa.string()),
        pa.field("category", pa.string()),
        pa.field("reasoning", pa.string()),
        pa.field("messages", pa.list_(MESSAGE_TYPE)),
        pa.field("metadata", pa.string()),
    ]
)

def _describe(t: pa.DataType) -> str:
    return str(t)


def _check_type(actual: pa.DataType, expected: pa.DataType, column: str, path: str) -> None:
    """Raise naming ``column`` when ``actual`` cannot be read as ``expected``.

    Accepted variants (each is what some writer produces for the same logical data):
    large_string / string_view for string, large_list / list_view for list, and the ``null`` type anywhere
    (pyarrow and HF datasets infer ``null`` for a column whose values are all null, e.g. tool_calls in the chat
    split). Extra struct fields are allowed, like extra columns.
    """
    if pa.types.is_null(actual):
        return
    if pa.types.is_string(expected):
        if pa.types.is_string(actual) or pa.types.is_large_string(actual) or pa.types.is_string_view(actual):
            return
    elif pa.types.is_list(expected):
        if pa.types.is_list(actual) or pa.types.is_large_list(actual) or pa.types.is_list_view(actual):
            _check_type(actual.value_type, expected.value_type, f"{column}[]", path)
            return
    elif pa.types.is_struct(expected):
        if pa.types.is_struct(actual):
            names = [actual.field(i).name for i in range(actual.num_fields)]
            for i in range(expected.num_fields):
                want = expected.field(i)
                if want.name not in names:
                    raise RaytrainError(
                        f"{path}: column {column}.{want.name} is missing (struct has {names}); expected "
                        f"{_describe(want.type)}. Fix: write the file with the Nemotron v1 schema "
                        "(raytrain.enrich.schema.NEMOTRON_V1_SCHEMA)."
                    )
                if names.count(want.name) > 1:
                    raise RaytrainError(f"{path}: column {column}.{want.name} appears more than once in the struct. "
                                        "Fix: rewrite the file with the Nemotron v1 schema.")
                _check_type(actual.field(want.name).type, want.type, f"{column}.{want.name}", path)
            return
    else:  # pragma: no cover - the schema above only uses string, list and struct
        if actual.equals(expected):
            return
    raise RaytrainError(
        f"{path}: column {column} has type {_describe(actual)}, expected {_describe(expected)}. "
        "Fix: write the file with the Nemotron v1 schema (raytrain.enrich.schema.NEMOTRON_V1_SCHEMA)."
    )


def validate_schema(arrow_schema: pa.Schema, path: str, expected: pa.Schema = NEMOTRON_V1_SCHEMA) -> None:
    """Check that a file's Arrow schema holds every column of ``expected`` with a compatible type.

    In: the file's schema (e.g. ``pyarrow.parquet.read_schema(path)``) and the path for the message.
    Out: None. Raises RaytrainError naming the missing or mistyped column (dotted for nested fields, ``[]`` for
    list elements) and the file. Extra columns and extra struct fields are allowed.
    """
    for want in expected:
        idx = arrow_schema.get_field_index(want.name)
        if idx < 0:
            raise RaytrainError(
                f"{path}: column {want.name!r} is missing (file has {arrow_schema.names}); expected "
                f"{_describe(want.type)}. Fix: point the job at Nemotron-Post-Training-Dataset-v1 Parquet files "
                "or regenerate the sample with `python -m raytrain.sample_data OUT_DIR`."
            )
        if idx != arrow_schema.get_all_field_indices(want.name)[-1]:
            raise RaytrainError(f"{path}: column {want.name!r} appears more than once. Fix: rewrite the file.")
        _check_type(arrow_schema.field(idx).type, want.type, want.name, path)


def null_typed_paths(arrow_schema: pa.Schema, expected: pa.Schema = NEMOTRON_V1_SCHEMA) -> dict[str, bool]:
    """Every path of ``expected`` the file has (dotted, ``[]`` for list elements) -> whether the file's type there
    is ``null`` (what pyarrow and HF datasets write for a column whose values were all null). For a schema that
    passed ``validate_schema``; a path under a null-typed one is not listed."""
    out: dict[str, bool] = {}

    def walk(actual: pa.DataType, want: pa.DataType, path: str) -> None:
        out[path] = pa.types.is_null(actual)
        if out[path]:
            return
        if pa.types.is_struct(want) and pa.types.is_struct(actual):
            for f in want:
                if actual.get_field_index(f.name) >= 0:
                    walk(actual.field(f.name).type, f.type, f"{path}.{f.name}")
        elif pa.types.is_list(want) and hasattr(actual, "value_type"):
            walk(actual.value_type, want.value_type, f"{path}[]")

    for want in expected:
        if arrow_schema.get_field_index(want.name) >= 0:
            walk(arrow_schema.field(want.name).type, want.type, want.name)
    return out


def conform_table(table: pa.Table, path: str, expected: pa.Schema = NEMOTRON_V1_SCHEMA) -> pa.Table:
    """Validate ``table`` and return it with exactly ``expected``'s columns, in order, cast to its types.

    Drops extra columns and struct fields (a cast to the canonical schema), so files from different writers
    concatenate. Raises RaytrainError as ``validate_schema`` does, or when the cast itself fails.
    """
    validate_schema(table.schema, path, expected)
    columns = []
    for want in expected:
        col = table.column(want.name)
        if not col.type.equals(want.type):
            try:
                col = _cast_column(col, want.type)
            except (pa.ArrowInvalid, pa.ArrowNotImplementedError) as e:
                raise RaytrainError(f"{path}: column {want.name!r} cannot be cast to {want.type}: {e}") from e
        columns.append(col)
    return pa.Table.from_arrays(columns, schema=expected)


def _cast_column(col: pa.ChunkedArray, target: pa.DataType) -> pa.ChunkedArray:
    # Arrow's struct cast refuses extra fields, so rebuild structs field by field (recursively through lists).
    chunks = [_cast_array(chunk, target) for chunk in col.chunks]
    return pa.chunked_array(chunks, type=target)


def _cast_array(arr: pa.Array, target: pa.DataType) -> pa.Array:
    if pa.types.is_null(arr.type):
        return pa.nulls(len(arr), type=target)
    if pa.types.is_struct(target):
        # flatten() gives the children with this (possibly sliced) array's offset applied
        by_name = dict(zip([f.name for f in arr.type], arr.flatten(), strict=True))
        children = [_cast_array(by_name[f.name], f.type) for f in target]
        return pa.StructArray.from_arrays(children, fields=list(target), mask=arr.is_null())
    if pa.types.is_list(target):
        if pa.types.is_list_view(arr.type):
            arr = arr.cast(pa.large_list(arr.type.value_type))
        # Rebase the (possibly sliced) offsets to 0 and cut the child to match: Arrow refuses a null mask
        # together with sliced offsets.
        offsets = np.asarray(arr.offsets, dtype=np.int64)
        start = int(offsets[0])
        values = _cast_array(arr.values.slice(start, int(offsets[-1]) - start), target.value_type)
        rebased = pa.array(offsets - start, type=pa.int32())
        return pa.ListArray.from_arrays(rebased, values, type=target, mask=arr.is_null())
    return arr.cast(target)
