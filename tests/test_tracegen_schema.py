"""The synthetic traces of ``tests/_tracegen.py`` have the schema of a real trace: every span,
attribute and span event they write is one the tracer writes, with the same OTLP value type,
and hazards sit where the tracer puts them (on the ``copytrace.hazards`` span only)."""

from __future__ import annotations

import copy
import gzip
import json
import warnings
from collections import defaultdict
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn
from _realtrace import Net
from _tracegen import trace_lines, write_many

import copytrace
from copytrace.dashboards._load import decode_value
from copytrace.schema import OMITTED_DEFAULTS as _OMITTED_DEFAULTS


def _value_type(value: dict[str, Any]) -> str:
    """``stringValue``, ``intValue``, ... or ``arrayValue[<element type>]``."""
    (kind,) = value.keys()
    if kind == "arrayValue":
        kinds = {_value_type(v) for v in value[kind].get("values", [])}
        return f"arrayValue[{'|'.join(sorted(kinds))}]"
    return kind


def _spans(lines: list[str]) -> list[dict[str, Any]]:
    return [
        sp
        for line in lines
        for rs in json.loads(line)["resourceSpans"]
        for ss in rs["scopeSpans"]
        for sp in ss["spans"]
    ]


def _kind(span: dict[str, Any]) -> str:
    """Event spans share one schema whatever the op; the others by name."""
    if span["name"] in ("copytrace.run", "copytrace.step", "copytrace.hazards"):
        return span["name"]
    attrs = {a["key"] for a in span.get("attributes", [])}
    return "group" if "copytrace.group" in attrs else "event"


def _schema(spans: list[dict[str, Any]]) -> dict[str, dict[str, set[str]]]:
    """kind -> {"fields": span fields, "attr:<key>": value types, "event:<name>:<key>": ...}."""
    out: dict[str, dict[str, set[str]]] = defaultdict(lambda: defaultdict(set))
    for sp in spans:
        schema = out[_kind(sp)]
        schema["fields"] |= set(sp)
        for a in sp.get("attributes", []):
            schema["attr:" + a["key"]].add(_value_type(a["value"]))
        for ev in sp.get("events", []):
            schema["span events"].add(ev["name"])
            for a in ev.get("attributes", []):
                schema[f"event:{ev['name']}:{a['key']}"].add(_value_type(a["value"]))
    return out


def _real_lines(tmp_path: Path) -> list[str]:
    """A real trace with every kind of span and the attributes the synthetic one uses."""
    w = torch.randn(10, 100, requires_grad=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with copytrace.trace(tmp_path, compression="none") as t:
            Net()(w)  # a clone and a detach in a forward: copytrace.module
            t.step()
            copy.deepcopy(nn.Linear(10, 10))  # a deepcopy group and its children
            torch.tensor(w)  # a hazard: the copytrace.hazards span
            w.to(torch.float32)  # a no-op
            w.to(torch.float64, non_blocking=True)
    assert t.trace_path is not None
    raw = t.trace_path.read_bytes()
    assert raw[:2] != b"\x1f\x8b"
    return raw.decode().splitlines()


def test_synthetic_traces_use_the_real_schema(tmp_path: Path) -> None:
    real = _schema(_spans(_real_lines(tmp_path / "real")))
    # a CPU-only run copies between no devices: copytrace.transfer (h2d, d2h, d2d; string, see
    # docs/trace-format.md) is left out of all its spans
    assert "attr:copytrace.transfer" not in real["event"]
    real["event"]["attr:copytrace.transfer"] = {"stringValue"}
    assert set(real) == {"event", "group", "copytrace.step", "copytrace.run", "copytrace.hazards"}
    # hazards only on the hazards span, never on event spans
    assert [k for k, s in real.items() if "span events" in s] == ["copytrace.hazards"]
    many = write_many(tmp_path / "many", 600, large_every=50, hazard_every=100)
    synthetic_lines = trace_lines() + many.read_text().splitlines()
    synthetic = _schema(_spans(synthetic_lines))
    assert set(synthetic) == set(real)
    for kind, schema in synthetic.items():
        for key, types in schema.items():
            assert key in real[kind], f"{kind}: {key} is not in a real trace"
            assert types <= real[kind][key], f"{kind}: {key} is {types}, really {real[kind][key]}"
    # no attribute at a value the tracer leaves out (false flags, 0 new bytes, no transfer)
    for sp in _spans(synthetic_lines):
        for a in sp.get("attributes", []):
            default = _OMITTED_DEFAULTS.get(a["key"], object())
            assert decode_value(a["value"]) != default, (sp["name"], a)
    # the hazard events carry every attribute the tracer writes
    hazard_keys = {k for k in real["copytrace.hazards"] if k.startswith("event:")}
    assert {k for k in synthetic["copytrace.hazards"] if k.startswith("event:")} == hazard_keys
    # code, severity, message, fix, call_sites, bytes, events, span_ids
    assert len(hazard_keys) == 8


def test_gzip_and_plain_synthetic_files_hold_the_same_lines(tmp_path: Path) -> None:
    from _tracegen import write_trace

    plain = write_trace(tmp_path / "a")
    gz = write_trace(tmp_path / "b", gz=True)
    assert gzip.decompress(gz.read_bytes()) == plain.read_bytes()
    assert plain.read_text().splitlines() == trace_lines()
