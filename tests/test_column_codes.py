"""A run's columns code call sites and list keys as their text would: equal codes exactly
where the texts are equal (``copytrace.analysis._columns``), whichever way the codes are made
(from the ``(file, line, function)`` triple, from list positions, or from the text)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from copytrace.analysis._columns import RunColumns


def _columns(**cols: Any) -> RunColumns:
    table = pa.table(cols)
    n = table.num_rows
    return RunColumns(n, 0, lambda name: table.column(name))


def _partition(codes: np.ndarray) -> list[list[int]]:
    """The rows grouped by equal code, as sorted lists (what equal codes mean)."""
    groups: dict[int, list[int]] = {}
    for i, c in enumerate(codes.tolist()):
        groups.setdefault(c, []).append(i)
    return sorted(groups.values())


def _by_text(texts: list[Any]) -> list[list[int]]:
    groups: dict[Any, list[int]] = {}
    for i, t in enumerate(texts):
        groups.setdefault(t, []).append(i)
    return sorted(groups.values())


def _check_sites(files: list[Any], lines: list[Any], funcs: list[Any]) -> np.ndarray:
    rc = _columns(file=pa.array(files, pa.string()).dictionary_encode(),
                  line=pa.array(lines, pa.int64()),
                  function=pa.array(funcs, pa.string()))  # fmt: skip
    rows = np.arange(rc.n)
    codes = rc.codes("site", rows)
    texts = rc.take("site", rows).to_pylist()
    assert _partition(codes) == _by_text(texts)
    # no site (no file, or an empty one): -1, the rules' "no call site"
    assert [c == -1 for c in codes.tolist()] == [t is None for t in texts]
    return codes


def test_site_codes_from_triples() -> None:
    # a function absent or empty reads the same ("a.py:1"); a line absent reads "a.py f";
    # no file, or an empty one, is no site whatever the line
    codes = _check_sites(
        ["a.py", "a.py", "a.py", "a.py", "b.py", None, "", "", "a.py", "a.py"],
        [1, 1, 1, 2, 1, 3, 3, 4, None, None],
        ["f", None, "", "f", "f", "f", "g", None, "f", None],
    )
    assert codes[1] == codes[2] != codes[0]


def test_site_codes_through_text_when_names_hold_separators() -> None:
    # "x.py:2" with no line and "x.py" at line 2 read alike: "x.py:2 f"; so do "y.py" at
    # line 1 with function "g h" and a file "y.py:1 g" at no line with function "h"
    codes = _check_sites(["x.py:2", "x.py", "y.py", "y.py:1 g", "C:\\w.py"],
                         [None, 2, 1, None, 5], ["f", "f", "g h", "h", "k"])  # fmt: skip
    assert codes[0] == codes[1] and codes[2] == codes[3]


def test_list_keys_coded_like_their_text() -> None:
    shapes = [[2, 3], [2, 3], [], None, [3, 2], [2], [2, 3, 1], [2, 3], [0], [1 << 40, 7]]
    rc = _columns(shape=pa.array(shapes, pa.list_(pa.int64())))
    rows = np.arange(rc.n)
    codes = rc.codes("shape_key", rows)
    text = rc.take("shape_key", rows).to_pylist()  # "" for an absent and an empty list
    assert _partition(codes) == _by_text(text)
    assert codes[2] == codes[3] and codes[0] == codes[1] == codes[7]
    picked = np.array([9, 0, 3, 7])
    assert _partition(rc.codes("shape_key", picked)) == [[0], [1, 3], [2]]


def test_string_codes_over_chunks_with_their_own_dictionaries() -> None:
    chunks = [pa.array(v, pa.string()).dictionary_encode()
              for v in (["a", "b", None], [], ["b", "c", "a"], [None])]  # fmt: skip
    col = pa.chunked_array(chunks)
    table = pa.table({"op": col})
    rc = RunColumns(table.num_rows, 0, lambda name: table.column(name))
    codes = rc.codes("op", np.arange(rc.n))
    values = pc.cast(col, pa.string()).to_pylist()
    assert _partition(codes) == _by_text(values)
    assert codes[2] == codes[6] == -1  # a null: -1
