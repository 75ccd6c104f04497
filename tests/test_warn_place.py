"""A warning torch raises in C++ names the program's line on the Python fallback.

torch emits a C++ warning (``TORCH_WARN``) with stacklevel 1 when the call returns to Python
(``PyWarningHandler``, ``torch/csrc/Exceptions.cpp``): the frame that called the C function.
On the fallback copytrace's function mode makes that call; ``tracer/_warnplace.py`` makes it
from a trampoline that carries the program frame's file, line and globals.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import torch

from copytrace.tracer import _warnplace
from copytrace.tracer._warnplace import call_placed

_DOF = "degrees of freedom is <= 0"  # torch's TORCH_WARN in var/std of one element


def test_call_placed_names_the_callers_line() -> None:
    """Called from here, a C++ warning names this file and line (a plain call from
    ``call_placed``'s own frame would name ``_warnplace.py``), and lands in this module's
    ``__warningregistry__``."""
    one = torch.ones(1)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        line = sys._getframe().f_lineno + 1
        out = call_placed(torch.var, (one,), {"dim": 0})
    assert torch.isnan(out) and out.shape == ()  # what torch.var returns: NaN of one element
    dof = [w for w in seen if _DOF in str(w.message)]
    assert [(w.filename, w.lineno) for w in dof] == [(__file__, line)]
    assert call_placed(len, ([1, 2],), {}) == 2
    assert len(_warnplace._CODES) >= 1 and all(isinstance(k[0], str) for k in _warnplace._CODES)


def test_call_placed_calls_python_functions_directly() -> None:
    """A Python callable runs in its own frame: a ``stacklevel=2`` warning inside it names
    its caller, ``call_placed`` (the fallback's warnings shim counts past copytrace's frames
    there); the function's result and exception pass through."""

    def warns(x: int) -> int:
        warnings.warn("from python", stacklevel=2)
        return x + 1

    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        assert call_placed(warns, (1,), {}) == 2
    assert [os.path.basename(w.filename) for w in seen] == ["_warnplace.py"]
    try:
        call_placed(int, ("x",), {})
    except ValueError as err:
        assert "invalid literal" in str(err)
    else:
        raise AssertionError("int('x') did not raise")


_PROGRAM = textwrap.dedent(
    """
    import warnings, torch

    one = torch.ones(1)
    for _ in range(3):
        torch.var(one)  # shown once: the "default" action, once per location
    for _ in range(2):
        one.std()  # another location: shown once more
    torch.tensor(one)  # torch's "To copy construct"
    warnings.warn("own warning")  # the program's own, unchanged
    """
)


def _places(tmp_path: Path, env_extra: dict[str, str]) -> list[str]:
    """The ``file:line: category: message start`` of each warning the program showed."""
    prog = tmp_path / "dof.py"
    prog.write_text(_PROGRAM)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("COPYTRACE", "PYTHONWARN"))}
    env.update(COPYTRACE_OUTPUT=str(tmp_path / "out"), **env_extra)
    res = subprocess.run(
        [sys.executable, str(prog)], env=env, capture_output=True, text=True, timeout=240
    )
    assert res.returncode == 0, res.stderr[-3000:]
    return [
        ln.replace(str(prog), "dof.py")[:60] for ln in res.stderr.splitlines() if "Warning: " in ln
    ]


def test_python_fallback_places_and_repeats_cpp_warnings_as_untraced(tmp_path: Path) -> None:
    """The fallback against untraced: the same warnings, from the same lines, shown the same
    number of times (the per-location registry is the program's module's)."""
    plain = _places(tmp_path, {})
    # var once, std once, "To copy construct" once, the program's own once
    assert [p.split(": ")[0] for p in plain] == ["dof.py:6", "dof.py:8", "dof.py:9", "dof.py:10"]
    for level in ("lean", "full"):
        env = {"COPYTRACE": "1", "COPYTRACE_OBSERVER": "python", "COPYTRACE_LEVEL": level}
        assert _places(tmp_path, env) == plain, level
