"""The contract module: one field table makes CopyEvent, the attribute groups, the event
table's columns and the C observer's field list, and it stands on nothing heavy."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import torch

import copytrace
from copytrace import schema
from copytrace.schema import FIELDS, CopyEvent
from copytrace.tracefile import load_trace


def test_copy_event_is_made_from_the_field_table() -> None:
    names = [f.name for f in FIELDS]
    assert len(set(names)) == len(names)
    assert CopyEvent.__slots__ == schema.EVENT_SLOTS == tuple(names)
    ev = CopyEvent()
    assert ev.as_dict() == {f.name: f.default for f in FIELDS}
    assert not hasattr(ev, "__dict__")  # slots only: one record per event, no dict


def test_attribute_groups_and_columns_follow_the_table() -> None:
    keyed = [(f.name, f.key) for f in FIELDS if f.key is not None]
    assert list(schema.EVENT_FIELDS) == keyed
    groups = (schema.STR_FIELDS + schema.SCALAR_FIELDS + schema.ANALYSIS_FIELDS
              + schema.LIST_FIELDS + schema.GROUP_FIELDS)  # fmt: skip
    assert sorted(groups) == sorted(keyed)  # every attribute is written by exactly one group
    # the table's columns: 6 for the span, one per attribute, 2 of JSON
    columns = [name for name, _ in schema.TABLE_COLUMNS]
    assert columns[6:-2] == [name for name, _ in keyed]
    assert len(columns) == 6 + len(keyed) + 2
    kinds = dict(schema.TABLE_COLUMNS)
    assert (kinds["shape"], kinds["saved_by"], kinds["alias"], kinds["line"], kinds["file"]) == (
        "int_list", "str_list", "bool", "int", "str")  # fmt: skip


def test_omitted_attributes_read_back_as_the_in_memory_default() -> None:
    """An attribute left out because it holds its common value must be read back as the
    value a fresh event has, or a round trip would change the event."""
    for f in FIELDS:
        if f.omit:
            assert f.key in schema.OMITTED_DEFAULTS
            assert schema.FIELD_DEFAULTS[f.name] == f.default == schema.OMITTED_DEFAULTS[f.key]
    assert schema.OMITTED_DEFAULTS["copytrace.transfer"] == "none"
    assert len(schema.OMITTED_DEFAULTS) == 7  # 5 false flags, 0 new bytes, no transfer


def test_loaded_event_has_the_absent_defaults(tmp_path: Path) -> None:
    with copytrace.trace(tmp_path, compression="none") as t:
        torch.ones(3).clone()
    (ev,) = [e for e in load_trace(t.trace_path).runs[0].events if e.op == "clone"]
    assert "copytrace.alias" not in ev.attrs  # a copy: the false flag is left out ...
    assert ev.alias is False and ev.transfer == "none"  # ... and read back as the default
    assert ev.bytes_allocated == ev.bytes_logical == 3 * 4  # 3 float32


def test_schema_imports_neither_torch_nor_pyarrow() -> None:
    code = ("import sys, copytrace.schema as s; s.CopyEvent(op='clone'); "
            "print(sorted(m for m in ('torch', 'pyarrow', 'opentelemetry') if m in sys.modules))")  # fmt: skip
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_repr_names_the_kind_the_summary_counts() -> None:
    # a real run: x.to("cpu") on a CPU float32 tensor returns x itself (a no-op), detach()
    # shares x's storage (an alias), clone() writes new storage (a copy)
    x = torch.ones(2, 3)
    with copytrace.trace(write=False) as t:
        x.to("cpu")
        x.detach()
        x.clone()
    kinds = [(ev.op, repr(ev).split()[2]) for ev in t.events]
    assert kinds == [("to", "no-op"), ("detach", "alias"), ("clone", "copy")]
    assert [(ev.noop, ev.alias) for ev in t.events] == [(True, True), (False, True), (False, False)]
