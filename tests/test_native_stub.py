"""The C++ observer's boundary: its typed stub (``observer.pyi``) against the built module's
entry points, its named ``Facts`` against ``copytrace.tracer._facts.Facts``, the C record's
fields against the schema's, and the build key against every source of the build."""

from __future__ import annotations

import ast
import os
from pathlib import Path

import pytest
import torch

from copytrace.tracer import _facts as F
from copytrace.tracer import _native

NATIVE = _native.load()
needs_native = pytest.mark.skipif(
    NATIVE is None and not os.environ.get("COPYTRACE_REQUIRE_INTEGRATION"),
    reason="C++ observer unavailable here",
)
HERE = Path(_native.__file__).parent


def _stub_names() -> set[str]:
    """Top-level functions, classes and constants of observer.pyi."""
    tree = ast.parse((HERE / "observer.pyi").read_text())
    names = set()
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.add(node.target.id)
    return names


@needs_native
def test_the_stub_types_exactly_the_module_s_entry_points():
    public = {name for name in dir(NATIVE) if not name.startswith("_")}
    assert _stub_names() == public


@needs_native
def test_facts_have_the_python_readers_field_names_in_their_order():
    assert NATIVE.Facts.__match_args__ == F.Facts._fields
    assert NATIVE.Facts.n_fields == len(F.Facts._fields) == 14


@needs_native
def test_facts_read_by_name_and_by_index_agree_with_the_python_reader():
    leaf = torch.randn(3, 4, requires_grad=True)
    view = leaf.clone()[1:, ::2]  # a view with a grad_fn: storage offset 4, strides (4, 2)
    native = NATIVE.facts(view, True)
    python = F.py_facts(view, True)
    assert isinstance(native, tuple) and isinstance(python, F.Facts)
    assert native.shape == python.shape == (2, 2)
    assert native.offset == native[F.OFFSET] == 4
    assert native.stride == python.stride == (4, 2)
    assert native.grad_fn_name == python.grad_fn_name == type(view.grad_fn).__name__
    # every field but the node (the same C++ object, a new Python wrapper); the storage is
    # named by its StorageImpl's address on both paths
    for name in F.Facts._fields:
        if name != "grad_fn":
            assert getattr(native, name) == getattr(python, name), name
    (shape, *_rest, fake) = native  # unpacks as the 14-tuple it was
    assert shape == (2, 2) and fake is False


@needs_native
def test_the_c_record_writes_only_fields_the_schema_lists():
    fields = _native._event_fields()
    assert set(NATIVE.RECORD_FIELDS) <= set(fields)
    assert "seq" in NATIVE.RECORD_FIELDS and "thread_name" in NATIVE.RECORD_FIELDS


@needs_native
def test_record_setup_names_a_field_the_schema_lacks():
    fields = tuple(f for f in _native._event_fields() if f != "via")
    try:
        with pytest.raises(ValueError, match="no event field via"):
            NATIVE.record_setup(fields)
    finally:
        NATIVE.record_setup(_native._event_fields())


def test_the_build_key_hashes_every_unit_and_the_header():
    on_disk = {p.name for p in HERE.iterdir() if p.suffix in (".cpp", ".h")}
    assert {p.name for p in _native._INPUTS} == on_disk
    # every unit is built: as a source of its own or included by torch_units.cpp
    combined = (HERE / "torch_units.cpp").read_text()
    included = {line.split('"')[1] for line in combined.splitlines() if line.startswith("#include")}
    built = {p.name for p in _native._SOURCES}
    assert built | included == {n for n in on_disk if n.endswith(".cpp")}
    assert not built & included
    assert _native._SOURCES[-1].name == "module.cpp"


def test_no_unit_is_over_the_house_limit():
    for path in HERE.iterdir():
        if path.suffix in (".cpp", ".h"):
            assert len(path.read_text().splitlines()) <= 900, path.name
