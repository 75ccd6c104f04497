"""The house rules, checked on the source tree: sizes and layers.

- No Python module under ``copytrace/`` over 600 lines, no function over 80 lines, no C++ unit
  over 900 lines (the house style; past that, split by responsibility).
- The layer contract in ``pyproject.toml`` (``[tool.importlinter]``) holds: a room imports only
  rooms below it, counting imports inside functions (import-linter follows every ``import``
  statement of a module, wherever it stands).
"""

from __future__ import annotations

import ast
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "copytrace"
MAX_MODULE_LINES = 600
MAX_FUNCTION_LINES = 80
MAX_CPP_LINES = 900


def _lines(path: Path) -> int:
    return path.read_text(encoding="utf-8").count("\n")


def test_python_modules_within_size():
    too_long = {
        str(p.relative_to(ROOT)): n
        for p in sorted(PACKAGE.rglob("*.py"))
        if (n := _lines(p)) > MAX_MODULE_LINES
    }
    assert too_long == {}


def long_functions(root: Path) -> dict[str, int]:
    """``{"path:line name": lines}`` of every function under ``root`` over the limit."""
    too_long = {}
    for path in sorted(root.rglob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = node.end_lineno - node.lineno + 1
                if n > MAX_FUNCTION_LINES:
                    too_long[f"{path.relative_to(root)}:{node.lineno} {node.name}"] = n
    return too_long


def test_functions_within_size():
    assert long_functions(PACKAGE) == {}


def test_cpp_units_within_size():
    units = sorted(PACKAGE.rglob("*.cpp")) + sorted(PACKAGE.rglob("*.h"))
    assert units, "the C++ observer's sources were not found"
    too_long = {str(p.relative_to(ROOT)): n for p in units if (n := _lines(p)) > MAX_CPP_LINES}
    assert too_long == {}


def test_size_check_sees_a_long_function(tmp_path):
    # The check above must be able to fail: a def line and 80 body lines make 81 lines.
    body = "\n".join(f"        x{i} = {i}" for i in range(80))
    (tmp_path / "m.py").write_text(f"class C:\n    def f(self):\n{body}\n    def g(self):\n        pass\n")
    assert long_functions(tmp_path) == {"m.py:2 f": 81}


def test_layer_contract_holds():
    exe = Path(sys.executable).with_name("lint-imports")
    exe = str(exe) if exe.exists() else shutil.which("lint-imports") or ""
    if not exe:
        pytest.skip("import-linter is not installed (pip install -e '.[test]')")
    proc = subprocess.run(
        [exe, str(ROOT / "pyproject.toml")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    assert "0 broken" in proc.stdout, proc.stdout[-4000:]
