"""Fuzz the inputs a user controls: the job config (YAML file + dotted overrides) and the enrichment reader's pure
parts (input schema check, row -> Example/Quarantined, Parquet footer check). Every case must end in a JobConfig /
Example / row count, or in RaytrainError (ConfigError) / a Quarantined record: never another exception (the time per
family is printed, not asserted: timings are never asserted on these noisy machines).

hypothesis is not installed in the venv, so the cases come from a seeded random generator (reproducible: a failure
message carries the case). Each family runs a few hundred cases; the whole module takes a few seconds.
"""

from __future__ import annotations

import io
import json
import math
import os
import random
import string
import time
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from raytrain.config import JobConfig, load_job_config
from raytrain.enrich.conversation import QUARANTINE_REASONS, Example, Quarantined, derive_example
from raytrain.enrich.inputs import LAYOUT_SPLIT_FOLDERS, InputFiles, validate_inputs
from raytrain.enrich.schema import NEMOTRON_V1_SCHEMA, validate_schema
from raytrain.errors import ConfigError, RaytrainError
from raytrain.storage import resolve

DEMO_YAML = os.path.join(os.path.dirname(__file__), "..", "..", "configs", "demo.yaml")

# every dotted field of the job config, from the dataclasses themselves
FIELDS = [f"{section}.{name}" for section, values in JobConfig().to_dict().items() for name in values]


class Outcomes:
    """Collects unexpected exceptions with the case that caused them, so one run reports all of them at once."""

    def __init__(self) -> None:
        self.bad: list[str] = []
        self.counts: dict[str, int] = {}
        self.t0 = time.perf_counter()

    def note(self, kind: str) -> None:
        self.counts[kind] = self.counts.get(kind, 0) + 1

    def unexpected(self, case: Any, exc: BaseException) -> None:
        self.bad.append(f"{type(exc).__name__}: {str(exc)[:160]} <- case {_short(case)}")

    def check(self, family: str) -> None:
        elapsed = time.perf_counter() - self.t0
        assert not self.bad, f"{family}: {len(self.bad)} case(s) raised outside RaytrainError:\n" + "\n".join(
            sorted(set(self.bad))[:25])
        print(f"[fuzz] {family}: {sum(self.counts.values())} cases {self.counts} in {elapsed:.2f}s")


def _short(value: Any) -> str:
    r = repr(value)
    return r if len(r) <= 200 else r[:197] + "..."


# ---- random values ------------------------------------------------------------------------------------------------
def random_text(rng: random.Random, max_len: int = 40) -> str:
    alphabet = string.printable + "äß€\u2028\ufeff\ud800\udfff\x00\x7f\u200b"
    return "".join(rng.choice(alphabet) for _ in range(rng.randint(0, max_len)))


def random_scalar(rng: random.Random) -> Any:
    return rng.choice([
        None, True, False, 0, -1, 1, 2**31, 10**30, -(10**30), 10**400, 0.0, -0.0, 1e-300, 1e308, math.inf,
        -math.inf, math.nan, "", " ", "0", "1e400", "-5", "true", "no", "sample", "9" * 5000, "x" * 100_000,
        random_text(rng), b"\xff\xfe", b"ok", [], {}, [1, "a", None], {"k": "v"}, {"nested": {"deep": [1]}},
    ])


def random_yaml_value(rng: random.Random) -> str:
    """A value as YAML text, including ones YAML itself finds odd (dates, tags, anchors, huge numbers)."""
    return rng.choice([
        "null", "~", "true", "yes", "0", "-3", "1e400", "1.0e400", ".nan", ".inf", "-.inf", "0x1F", "0o17",
        "2001-12-14", "2001-12-14t21:59:43.10-05:00", "'quoted'", '"\\u00e9"', "[1, 2, [3]]", "{a: 1}",
        "!!binary aGVsbG8=", "!!set {a, b}", "!!python/object:os.system x", "&a [1]", "*missing",
        "9" * 5000, "[" * 50 + "]" * 50, "|\n  block\n  text", random_text(rng, 20).replace("\n", " "),
        str(rng.randint(-(10**6), 10**6)), repr(rng.uniform(-1e6, 1e6)),
    ])


# ---- 1. config loader ---------------------------------------------------------------------------------------------
def _mutate_text(rng: random.Random, text: str) -> str:
    chars = list(text)
    for _ in range(rng.randint(1, 6)):
        op = rng.randrange(4)
        pos = rng.randrange(len(chars) + 1)
        if op == 0 and chars:
            del chars[min(pos, len(chars) - 1)]
        elif op == 1:
            chars.insert(pos, rng.choice(list(":-[]{}#&*!|>'\"\t\n %@`,?") + [random_text(rng, 5)]))
        elif op == 2 and chars:
            chars[min(pos, len(chars) - 1)] = rng.choice("\t:\n ")
        else:
            chars.insert(pos, "\n" + rng.choice(FIELDS).replace(".", ":\n  ", 1) + ": " + random_yaml_value(rng))
    return "".join(chars)


def _config_documents(rng: random.Random, demo: str) -> list[bytes]:
    docs: list[bytes] = [b"", b"   \n\n", b"\xef\xbb\xbf", b"---\n...\n", b"- a\n- b\n", b"just a string",
                         b"42", b"null", b"train: 5\n", b"train: [1, 2]\n", b"train:\n  lr: [1, 2]\n",
                         b"storage: {root: ''}\n", b"\xff\xfe\x00t\x00r\x00a\x00i\x00n",  # UTF-16
                         b"train:\n  lr: \xe9\n",  # latin-1 byte inside otherwise valid YAML
                         ("a:\n" + "".join("  " * i + f"b{i}:\n" for i in range(1, 200))).encode(),
                         ("x: " + "[" * 2000 + "]" * 2000 + "\n").encode(),  # deep flow nesting
                         ("x: " + "{a: " * 500 + "1" + "}" * 500 + "\n").encode(),
                         b"train:\n  max_steps: " + b"9" * 5000 + b"\n",
                         b"train:\n  lr: 1.0e400\n", b"train:\n  max_steps: 1.0e400\n",
                         b"anchors: &a [*a]\n", b"train: &t {lr: 1}\nmodel: *t\n",
                         ("storage:\n  root: " + "x" * 1_000_000 + "\n").encode()]
    for _ in range(250):
        kind = rng.randrange(4)
        if kind == 0:
            docs.append(_mutate_text(rng, demo).encode("utf-8", "surrogatepass"))
        elif kind == 1:
            docs.append(bytes(rng.randrange(256) for _ in range(rng.randint(1, 200))))
        elif kind == 2:
            field = rng.choice(FIELDS)
            section, name = field.split(".")
            docs.append(f"{section}:\n  {name}: {random_yaml_value(rng)}\n".encode("utf-8", "surrogatepass"))
        else:
            raw = bytearray(demo.encode())
            for _ in range(rng.randint(1, 8)):
                raw[rng.randrange(len(raw))] = rng.randrange(256)
            docs.append(bytes(raw))
    return docs


def _random_override(rng: random.Random) -> str:
    key = rng.choice(FIELDS + ["train", "train.lr.x", "nope.x", "", ".", "..", "train..lr", "a.b.c.d.e",
                               "storage.root.deeper", random_text(rng, 12)])
    if rng.random() < 0.1:
        return key  # no '='
    return f"{key}={random_yaml_value(rng)}"


def _expect_config_or_error(outcomes: Outcomes, case: Any, path: str | None, overrides: list[str]) -> None:
    try:
        cfg = load_job_config(path, overrides)
    except ConfigError:
        outcomes.note("ConfigError")
    except RaytrainError:
        outcomes.note("RaytrainError")
    except Exception as exc:  # noqa: BLE001 - the point: anything else is a finding
        outcomes.unexpected(case, exc)
    else:
        assert isinstance(cfg, JobConfig)
        outcomes.note("accepted")


def test_fuzz_config_files(tmp_path):
    rng = random.Random(1234)
    demo = open(DEMO_YAML, encoding="utf-8").read()
    outcomes = Outcomes()
    path = str(tmp_path / "job.yaml")
    for doc in _config_documents(rng, demo):
        with open(path, "wb") as f:
            f.write(doc)
        _expect_config_or_error(outcomes, doc[:300], path, [])
    outcomes.check("config files")
    assert outcomes.counts.get("accepted", 0) > 0 and outcomes.counts.get("ConfigError", 0) > 100


def test_fuzz_config_overrides(tmp_path):
    rng = random.Random(99)
    outcomes = Outcomes()
    for _ in range(400):
        overrides = [_random_override(rng) for _ in range(rng.randint(1, 4))]
        _expect_config_or_error(outcomes, overrides, DEMO_YAML if rng.random() < 0.5 else None, overrides)
    # wrong Python types reaching the loader through the override strings' YAML
    for field in FIELDS:
        for value in ("[1, 2]", "{a: 1}", "null", "1.0e400", "-1", "9" * 5000, "''"):
            _expect_config_or_error(outcomes, (field, value), None, [f"{field}={value}"])
    outcomes.check("config overrides")
    assert outcomes.counts.get("accepted", 0) > 0


def test_config_rejects_non_finite_and_reports_the_field():
    """Spot checks with known answers: the error names the field, and non-finite numbers are not taken as lr."""
    with pytest.raises(ConfigError, match="train.lr"):
        load_job_config(None, ["train.lr=.nan"])
    with pytest.raises(ConfigError, match="train.max_steps"):
        load_job_config(None, ["train.max_steps=[1]"])
    with pytest.raises(ConfigError, match="not UTF-8"):
        path = os.path.join(os.path.dirname(DEMO_YAML), "..", ".pytest_fuzz_nonutf8.yaml")
        try:
            with open(path, "wb") as f:
                f.write(b"train:\n  lr: \xe9\n")
            load_job_config(path)
        finally:
            os.unlink(path)


# ---- 2. input schema check ----------------------------------------------------------------------------------------
def _random_type(rng: random.Random, depth: int = 0) -> pa.DataType:
    leaves = [pa.string(), pa.large_string(), pa.string_view(), pa.binary(), pa.int64(), pa.int8(), pa.float64(),
              pa.bool_(), pa.null(), pa.timestamp("us"), pa.date32(), pa.decimal128(10, 2),
              pa.dictionary(pa.int32(), pa.string())]
    if depth >= 3 or rng.random() < 0.5:
        return rng.choice(leaves)
    kind = rng.randrange(5)
    child = _random_type(rng, depth + 1)
    if kind == 0:
        return pa.list_(child)
    if kind == 1:
        return pa.large_list(child)
    if kind == 2:
        return pa.list_view(child)
    if kind == 3:
        return pa.map_(pa.string(), child)
    names = rng.sample(["role", "content", "tool_calls", "id", "type", "function", "name", "arguments", "x"],
                       rng.randint(0, 4))
    return pa.struct([pa.field(n, _random_type(rng, depth + 1)) for n in names])


def _mutate_type(rng: random.Random, t: pa.DataType) -> pa.DataType:
    """Replace one node somewhere inside `t` (or `t` itself) by a random type or a compatible variant."""
    if pa.types.is_struct(t) and t.num_fields and rng.random() < 0.7:
        fields = [t.field(i) for i in range(t.num_fields)]
        i = rng.randrange(len(fields))
        op = rng.randrange(3)
        if op == 0:
            del fields[i]
        elif op == 1:
            fields[i] = pa.field(fields[i].name, _mutate_type(rng, fields[i].type))
        else:
            fields.append(pa.field(rng.choice(["extra", fields[i].name]), _random_type(rng)))
        return pa.struct(fields)
    if (pa.types.is_list(t) or pa.types.is_large_list(t)) and rng.random() < 0.7:
        inner = _mutate_type(rng, t.value_type)
        return rng.choice([pa.list_, pa.large_list, pa.list_view])(inner)
    if pa.types.is_string(t) and rng.random() < 0.5:
        return rng.choice([pa.large_string(), pa.string_view(), pa.null()])
    return _random_type(rng)


def _random_schema(rng: random.Random) -> pa.Schema:
    fields = list(NEMOTRON_V1_SCHEMA)
    for _ in range(rng.randint(0, 3)):
        op = rng.randrange(4)
        i = rng.randrange(len(fields)) if fields else 0
        if op == 0 and fields:
            del fields[i]
        elif op == 1 and fields:
            fields[i] = pa.field(fields[i].name, _mutate_type(rng, fields[i].type))
        elif op == 2 and fields:
            fields.append(pa.field(fields[i].name, _random_type(rng)))  # duplicate column name
        else:
            fields.insert(i, pa.field(rng.choice(["extra", "Messages", "uuid ", ""]), _random_type(rng)))
    rng.shuffle(fields) if rng.random() < 0.3 else None
    return pa.schema(fields)


def test_fuzz_validate_schema():
    rng = random.Random(7)
    outcomes = Outcomes()
    validate_schema(NEMOTRON_V1_SCHEMA, "ref.parquet")  # the reference schema itself is accepted
    for i in range(500):
        schema = _random_schema(rng) if i % 5 else pa.schema([pa.field(f"c{j}", _random_type(rng))
                                                                for j in range(rng.randint(0, 6))])
        try:
            validate_schema(schema, f"fuzz-{i}.parquet")
        except RaytrainError as exc:
            assert f"fuzz-{i}.parquet" in str(exc)  # the message names the file
            outcomes.note("RaytrainError")
        except Exception as exc:  # noqa: BLE001
            outcomes.unexpected(schema, exc)
        else:
            outcomes.note("accepted")
            # accepted means readable: a table of that schema round-trips through Parquet (pyarrow as the judge)
            table = pa.table({f.name: pa.nulls(2, f.type) for f in schema}, schema=schema) \
                if len(set(schema.names)) == len(schema.names) else None
            if table is not None:
                buf = io.BytesIO()
                try:
                    pq.write_table(table, buf)
                except (pa.ArrowNotImplementedError, pa.ArrowInvalid):
                    continue  # a type Parquet cannot store (e.g. list_view) cannot arrive in a Parquet file
                validate_schema(pq.read_schema(io.BytesIO(buf.getvalue())), "roundtrip.parquet")
    outcomes.check("validate_schema")
    assert outcomes.counts.get("accepted", 0) > 10 and outcomes.counts.get("RaytrainError", 0) > 100


# ---- 3. derive_example --------------------------------------------------------------------------------------------
def _valid_row(rng: random.Random, i: int) -> dict:
    return {"uuid": f"u-{i}", "license": "cc-by-4.0", "generator": "g", "version": "v1", "category": "math",
            "reasoning": rng.choice(["on", "off", None]), "metadata": "{}",
            "messages": [{"role": "system", "content": "Be brief.", "tool_calls": None},
                         {"role": "user", "content": "What is 2+2?", "tool_calls": []},
                         {"role": "assistant", "content": "4", "tool_calls": []}]}


def _weird_value(rng: random.Random) -> Any:
    return rng.choice([
        None, math.nan, 0, 1.5, True, "", "   ", "\ud800", "a\udfffb", "ok\x00", "\ufffd", b"\xff\xfe", b"fine",
        "x" * rng.choice([10, 70_000, 1_000_000]), ["list"], {"d": 1}, {1: "a", "b": 2}, {1, 2},
        np.array(["a", "b"], dtype=object), np.array([[1, 2]]), np.array([]), object(), float("inf"),
        random_text(rng),
    ])


def _mutate_row(rng: random.Random, row: dict) -> dict:
    row = dict(row)
    messages = [dict(m) for m in row["messages"]]
    for _ in range(rng.randint(1, 4)):
        target = rng.randrange(6)
        if target == 0:
            row[rng.choice(["uuid", "license", "category", "reasoning", "metadata"])] = _weird_value(rng)
        elif target == 1:
            row["messages"] = _weird_value(rng)
            return row
        elif target == 2 and any(isinstance(m, dict) for m in messages):
            m = rng.choice([m for m in messages if isinstance(m, dict)])
            m[rng.choice(["role", "content", "tool_calls"])] = _weird_value(rng)
        elif target == 3:
            call = {"id": _weird_value(rng), "type": _weird_value(rng),
                    "function": rng.choice([None, _weird_value(rng),
                                            {"name": _weird_value(rng), "arguments": _weird_value(rng)}])}
            messages.append({"role": rng.choice(["assistant", "tool", "user", "robot", None]),
                             "content": _weird_value(rng), "tool_calls": rng.choice([[call], call, None, [call, 3]])})
        elif target == 4 and messages:
            del messages[rng.randrange(len(messages))]
        else:
            messages.insert(rng.randrange(len(messages) + 1), _weird_value(rng))
    row["messages"] = messages if rng.random() < 0.8 else np.array(messages, dtype=object)
    return row


def test_fuzz_derive_example():
    rng = random.Random(2024)
    outcomes = Outcomes()
    rows = [_valid_row(rng, i) for i in range(20)]
    cases = rows + [_mutate_row(rng, rng.choice(rows)) for _ in range(600)]
    cases += [{}, {"uuid": None}, {"uuid": "x", "messages": None}, {k: None for k in NEMOTRON_V1_SCHEMA.names},
              {"uuid": "x", "messages": [None, None]}, {"uuid": "x", "messages": "not a list"}]
    for row in cases:
        try:
            result = derive_example(row, max_chars=60_000)
        except Exception as exc:  # noqa: BLE001
            outcomes.unexpected(row, exc)
            continue
        if isinstance(result, Quarantined):
            assert result.reason in QUARANTINE_REASONS and isinstance(result.detail, str)
            outcomes.note(result.reason)
        else:
            assert isinstance(result, Example)
            outcomes.note("example")
            # what the Spark job writes next: the strings must be valid Arrow (pyarrow as the judge of the strings)
            try:
                pa.array([result.uuid, result.context, result.question, result.answer, result.full_text(),
                          json.dumps(list(result.messages), ensure_ascii=False)], type=pa.string())
            except Exception as exc:  # noqa: BLE001
                outcomes.unexpected(("example not writable", row), exc)
    outcomes.check("derive_example")
    assert outcomes.counts.get("example", 0) >= 20 and len(outcomes.counts) > 4


# ---- 4. Parquet footer check --------------------------------------------------------------------------------------
def _good_parquet_bytes() -> bytes:
    rows = [{"uuid": f"u{i}", "license": "mit", "generator": "g", "version": "1", "category": "chat",
             "reasoning": "off", "messages": [{"role": "user", "content": "hi", "tool_calls": []},
                                              {"role": "assistant", "content": "hello", "tool_calls": []}],
             "metadata": ""} for i in range(50)]
    buf = io.BytesIO()
    pq.write_table(pa.Table.from_pylist(rows, schema=NEMOTRON_V1_SCHEMA), buf, row_group_size=10)
    return buf.getvalue()


def _one_file(loc) -> InputFiles:
    return InputFiles(root=loc.parent, layout=LAYOUT_SPLIT_FOLDERS, files={"chat": (loc,)}, missing_shards={})


def test_fuzz_validate_inputs(tmp_path):
    rng = random.Random(5)
    good = _good_parquet_bytes()
    wrong_schema = io.BytesIO()
    pq.write_table(pa.table({"uuid": [1, 2], "messages": ["a", "b"]}), wrong_schema)
    payloads: list[tuple[str, bytes]] = [("empty", b""), ("magic-only", b"PAR1"), ("two-magics", b"PAR1PAR1"),
                                         ("text", b"uuid,messages\n1,hi\n"), ("json", b'{"uuid": 1}'),
                                         ("wrong-schema", wrong_schema.getvalue()), ("good", good)]
    for cut in sorted(rng.sample(range(1, len(good)), 60)):
        payloads.append((f"truncated-{cut}", good[:cut]))
    for i in range(40):
        raw = bytearray(good)
        for _ in range(rng.randint(1, 20)):
            raw[rng.randrange(len(raw) - 8, len(raw))] = rng.randrange(256)  # the footer length / magic
        payloads.append((f"footer-flipped-{i}", bytes(raw)))
    for i in range(40):
        payloads.append((f"random-{i}", b"PAR1" + bytes(rng.randrange(256) for _ in range(rng.randint(0, 400)))
                         + b"PAR1"))
    outcomes = Outcomes()
    for name, data in payloads:
        path = tmp_path / name / f"{name}.parquet"
        path.parent.mkdir()
        path.write_bytes(data)
        loc = resolve(str(path))
        try:
            rows = validate_inputs(_one_file(loc))
        except RaytrainError as exc:
            assert loc.uri in str(exc), str(exc)  # the message names the file
            outcomes.note("RaytrainError")
        except Exception as exc:  # noqa: BLE001
            outcomes.unexpected(name, exc)
        else:
            outcomes.note("accepted")
            # accepted means pyarrow can read the footer and it agrees on the row count
            meta = pq.ParquetFile(str(path)).metadata
            groups = [meta.row_group(g).num_rows for g in range(meta.num_row_groups)]
            assert rows == {"chat": {"files": 1, "rows": meta.num_rows, "file_row_groups": [groups],
                                     "schema": meta.schema.to_arrow_schema().remove_metadata()}}
    outcomes.check("validate_inputs")
    assert outcomes.counts.get("accepted", 0) >= 1 and outcomes.counts.get("RaytrainError", 0) >= 100
    # a folder named like a Parquet file (Spark writes those) is an input error too, not a crash
    spark_style = tmp_path / "spark-out.parquet"
    spark_style.mkdir()
    with pytest.raises(RaytrainError):
        validate_inputs(_one_file(resolve(str(spark_style))))
