"""An exception raised through copytrace's patches (``copy.deepcopy`` of an object that
refuses it, ``copy.copy``, ``nn.Parameter.__deepcopy__``) reaches the program with the
traceback it has untraced: the same frames, none of copytrace's (``tracer/_patches.py``,
``tracer/_recorder.py``)."""

from __future__ import annotations

import copy
import os
import subprocess
import sys
import traceback

import pytest
import torch

import copytrace


class Refuses:
    """An object that refuses to be copied, as a lock or an open handle would."""

    def __deepcopy__(self, memo):
        raise TypeError("cannot deepcopy a Refuses")

    def __copy__(self):
        raise TypeError("cannot copy a Refuses")


class Holder:
    """Tensors beside an object that refuses deepcopy (a group over tensor copies that fails)."""

    def __init__(self):
        self.t = torch.ones(3)
        self.r = Refuses()


class Nested:
    """A ``__deepcopy__`` of the program's own that calls ``copy.deepcopy`` (the patch again)."""

    def __init__(self):
        self.h = Holder()

    def __deepcopy__(self, memo):
        new = Nested.__new__(Nested)
        new.h = copy.deepcopy(self.h, memo)
        return new


class WithParam(torch.nn.Module):
    """Parameters (``nn.Parameter.__deepcopy__``, patched) and an attribute that refuses."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(2, 2)
        self.r = Refuses()


CASES = {
    "deepcopy": lambda: copy.deepcopy(Holder()),
    "nested": lambda: copy.deepcopy(Nested()),
    "module": lambda: copy.deepcopy(WithParam()),
    "copy": lambda: copy.copy(Refuses()),
}


def _frames(case: str) -> list[tuple[str, str, int | None, str | None]]:
    """The frames of the traceback the program catches: file, function, line, source."""
    try:
        CASES[case]()
    except TypeError as err:
        frames = traceback.extract_tb(err.__traceback__)
        return [(f.filename, f.name, f.lineno, f.line) for f in frames]
    raise AssertionError("no TypeError")


@pytest.mark.parametrize("level", ["lean", "full", "api"])
def test_a_refused_copy_shows_the_untraced_frames(level):
    untraced = {case: _frames(case) for case in CASES}
    with copytrace.trace(write=False, level=level) as t:
        traced = {case: _frames(case) for case in CASES}
    for case in CASES:
        assert traced[case] == untraced[case], case
        # the refusing object's own frame is the last: the copy did reach it
        assert untraced[case][-1][1] == ("__copy__" if case == "copy" else "__deepcopy__")
        assert not any("copytrace" in f[0] for f in traced[case])
    # still recorded: the outermost deepcopy of each refused object, as a failed group
    failed = [e for e in t.events if e.op == "deepcopy" and e.group]
    assert [e.error for e in failed] == ["TypeError"] * 3  # deepcopy, nested, module
    assert t.stats["errors"] == 0


# An uncaught refusal: Python prints the traceback on stderr and the process exits 1.
PROGRAM = """
import copy, torch
class Refuses:
    def __deepcopy__(self, memo):
        raise TypeError("cannot deepcopy a Refuses")
state = {"w": torch.ones(2), "lock": Refuses()}
copy.deepcopy(state)
"""


def test_an_uncaught_refusal_prints_the_untraced_traceback(tmp_path):
    prog = tmp_path / "prog.py"
    prog.write_text(PROGRAM)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("COPYTRACE", "OTEL_"))}
    runs = [
        subprocess.run(
            [sys.executable, str(prog)], capture_output=True, text=True, timeout=120, cwd=tmp_path,
            env={**env, **extra},
        )  # fmt: skip
        for extra in ({}, {"COPYTRACE": "1", "COPYTRACE_REPORT": "0"})
    ]
    blocks = []
    for run in runs:
        assert run.returncode == 1
        lines = run.stderr.splitlines()
        start = lines.index("Traceback (most recent call last):")
        end = lines.index("TypeError: cannot deepcopy a Refuses")
        blocks.append(lines[start : end + 1])
    assert blocks[1] == blocks[0]
    assert sum(line.startswith("  File ") for line in blocks[0]) >= 3  # prog, copy.py, __deepcopy__


class FixedTraceback(TypeError):
    """A program's error whose ``__traceback__`` reads as usual but cannot be set (a
    property with no setter shadows ``BaseException.__traceback__``)."""

    __traceback__ = property(BaseException.__traceback__.__get__)  # type: ignore[assignment]


class RefusesFixed:
    def __deepcopy__(self, memo):
        raise FixedTraceback("cannot deepcopy a RefusesFixed")


class LoadsFixed(torch.nn.Module):
    def _load_from_state_dict(self, *args):
        raise FixedTraceback("cannot load a LoadsFixed")


FIXED_CASES = {
    "deepcopy": lambda: copy.deepcopy(RefusesFixed()),  # tracer/_patches.py
    "load_state_dict": lambda: LoadsFixed().load_state_dict({}),  # tracer/_handover.py
}


@pytest.mark.parametrize("case", list(FIXED_CASES))
def test_a_traceback_that_cannot_be_relinked_is_counted_and_left_as_it_is(case):
    """The program still catches its own error, unchanged; copytrace's frames stay in its
    traceback (the new head could not be set, so no ``tb_next`` was touched), and the
    failure is counted as one internal error, never raised. Near miss: the same refusal as a
    plain ``TypeError`` is relinked and counts nothing."""
    with copytrace.trace(write=False) as t:
        with pytest.raises(FixedTraceback, match="cannot") as caught:
            FIXED_CASES[case]()
    files = [f.filename for f in traceback.extract_tb(caught.value.__traceback__)]
    assert any(os.sep + "copytrace" + os.sep in name for name in files)
    assert t.stats["errors"] == 1
    assert "AttributeError" in t.first_error and "__traceback__" in t.first_error

    with copytrace.trace(write=False) as t:
        with pytest.raises(TypeError, match="cannot") as caught:
            copy.deepcopy(Refuses())
    files = [f.filename for f in traceback.extract_tb(caught.value.__traceback__)]
    assert not any(os.sep + "copytrace" + os.sep in name for name in files)
    assert t.stats["errors"] == 0
