"""torch._dynamo is imported by the program, not by tracing (copytrace/tracer/_dynamo_import.py):
a program that never compiles does not pay for it, and one that imports it while traced gets
the dynamo it would get untraced, with its compiled calls recorded as before."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

from copytrace.tracer import _dynamo_import


def _run(tmp_path: Path, source: str, *args: str) -> list[Any]:
    """Run ``source`` in a fresh interpreter (torch._dynamo not yet imported); the JSON values
    it prints, one a line."""
    script = tmp_path / "prog.py"
    script.write_text(textwrap.dedent(source))
    proc = subprocess.run([sys.executable, str(script), *args], capture_output=True, text=True,
                          timeout=600, cwd=tmp_path)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    return [json.loads(line) for line in proc.stdout.splitlines()]


_NO_COMPILE = """
    import json, sys
    import torch, copytrace
    before = list(sys.meta_path)
    print(json.dumps("torch._dynamo" in sys.modules))
    with copytrace.trace(write=False, level=sys.argv[1]) as t:
        y = torch.ones(3, requires_grad=True).clone()
        z = y.detach()
        during = [type(f).__module__ for f in sys.meta_path]
    print(json.dumps("torch._dynamo" in sys.modules))
    print(json.dumps(during[0]))
    print(json.dumps(all(a is b for a, b in zip(sys.meta_path, before, strict=True))))
    print(json.dumps([e.op for e in t.events]))
"""


@pytest.mark.parametrize("level", ["lean", "full"])
def test_a_trace_of_a_program_that_never_compiles_leaves_dynamo_unimported(tmp_path, level):
    before, after, first_finder, same_path, ops = _run(tmp_path, _NO_COMPILE, level)
    assert before is False  # `import torch` alone does not import it (read here, not pinned)
    assert after is False
    assert first_finder == "copytrace.tracer._dynamo_import"  # waiting while the trace ran
    assert same_path is True  # and gone, the program's sys.meta_path as it was
    assert ops == ["clone", "detach"]


_COMPILE_INSIDE = """
    import json, sys, threading
    import numpy as np, torch, copytrace
    ones = np.ones(4, dtype=np.float32)

    def make():
        @torch.compile(backend="eager")
        def f(x):
            return x * 2 + torch.from_numpy(ones)
        return f

    traced = sys.argv[1] != "untraced"
    if traced:
        t = copytrace.trace(write=False, level=sys.argv[2])
        t.start()
        a = torch.ones(2).clone()
    if sys.argv[1] == "thread":  # the program imports dynamo on a thread of its own
        th = threading.Thread(target=lambda: __import__("torch._dynamo"))
        th.start(); th.join()
    f = make()  # torch.compile imports torch._dynamo (while traced: copytrace waits for it)
    f(torch.ones(4)); f(torch.ones(4))
    if traced:
        b = a.detach()
        t.stop()
        print(json.dumps([e.op for e in t.events]))
        print(json.dumps(t.session._engagement.compiled.run_attributes()))
    from torch._dynamo.utils import counters
    g = make()  # compiled after the trace: torch.from_numpy is torch's own to dynamo
    g(torch.ones(4))
    print(json.dumps([sum(counters["graph_break"].values()), dict(counters["stats"]),
                      dict(counters["frames"])]))
"""


def test_dynamo_imported_while_traced_compiles_as_untraced_and_its_calls_are_recorded(tmp_path):
    # The import ran with copytrace's patches (torch.from_numpy's among them) out of the way:
    # dynamo keeps some torch functions it sees when imported, and one that kept the patch
    # graph-broke on torch.from_numpy. Its own import recorded nothing: the events are the
    # program's clone and detach alone.
    (untraced,) = _run(tmp_path, _COMPILE_INSIDE, "untraced")
    assert untraced[0] == 0  # no graph break untraced (read from torch, not pinned)
    # on another thread: the hooks are engaged at the traced thread's first compiled call
    for how, level in (("main", "lean"), ("thread", "full")):
        ops, attrs, counts = _run(tmp_path, _COMPILE_INSIDE, how, level)
        assert counts == untraced, how
        assert ops == ["clone", "detach"], how
        assert attrs["copytrace.compiled_calls"] == 2, how  # f's two calls, on the traced thread


# --- the finder itself, on a package of the test's own ------------------------------------------
@pytest.fixture
def fake_dynamo(tmp_path, monkeypatch):
    """A package ``ct_fake_dynamo`` that records, when imported, what a waiter's aside set;
    ``_dynamo_import`` waits for it instead of torch._dynamo."""
    pkg = tmp_path / "ct_fake_dynamo"
    pkg.mkdir()
    (pkg / "__init__.py").write_text(
        "import os\nfrom ct_fake_state import seen\nseen.append(('ran', os.environ.get('CT_ASIDE')))\n"
        "if os.environ.get('CT_FAIL'):\n    raise ImportError('broken')\n"
    )
    (tmp_path / "ct_fake_state.py").write_text("seen = []\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(_dynamo_import, "_NAME", "ct_fake_dynamo")
    yield pkg
    for name in ("ct_fake_dynamo", "ct_fake_state"):
        sys.modules.pop(name, None)
    _dynamo_import._WAITERS.clear()
    _dynamo_import._FINDER.remove()


def test_waiters_see_the_import_with_their_aside_then_ready_once(fake_dynamo, monkeypatch):
    import os

    events: list[str] = []

    def aside():
        monkeypatch.setenv("CT_ASIDE", "1")
        events.append("aside")
        return lambda: (events.append("back"), monkeypatch.delenv("CT_ASIDE"))

    w = _dynamo_import.wait(lambda: events.append("ready"), aside)
    assert w is not None and sys.meta_path[0] is _dynamo_import._FINDER
    import ct_fake_dynamo  # noqa: F401
    import ct_fake_state

    assert ct_fake_state.seen == [("ran", "1")]  # the module's code ran inside the aside
    assert events == ["aside", "back", "ready"]
    assert "CT_ASIDE" not in os.environ
    assert _dynamo_import._FINDER not in sys.meta_path and _dynamo_import.waiting() == 0
    # the module's loader is its class's, as untraced (the wrapper was an instance attribute)
    loader = sys.modules["ct_fake_dynamo"].__loader__
    assert "exec_module" not in vars(loader)
    # imported now: a new waiter is ready at once, and nothing waits
    assert _dynamo_import.wait(lambda: events.append("now")) is None
    assert events[-1] == "now"


def test_a_failed_import_goes_to_the_program_and_the_waiter_waits_on(fake_dynamo, monkeypatch):
    events: list[str] = []
    _dynamo_import.wait(lambda: events.append("ready"), lambda: lambda: events.append("back"))
    monkeypatch.setenv("CT_FAIL", "1")
    with pytest.raises(ImportError, match="broken"):
        import ct_fake_dynamo  # noqa: F401
    assert events == ["back"]  # put back, not ready
    assert sys.meta_path[0] is _dynamo_import._FINDER and _dynamo_import.waiting() == 1
    monkeypatch.delenv("CT_FAIL")
    import ct_fake_dynamo  # noqa: F401, F811

    assert events == ["back", "back", "ready"]


def test_a_cancelled_waiter_takes_the_finder_away(fake_dynamo):
    w = _dynamo_import.wait(lambda: None)
    assert _dynamo_import._FINDER in sys.meta_path
    _dynamo_import.cancel(w)
    assert _dynamo_import._FINDER not in sys.meta_path and _dynamo_import.waiting() == 0


def test_under_copytrace_1_a_program_that_never_compiles_does_not_import_dynamo(tmp_path):
    # The launch traces from `import torch` to exit; its audit hook's skip waits for dynamo too.
    import os

    env = {k: v for k, v in os.environ.items() if not k.startswith("COPYTRACE")}
    env.update(COPYTRACE="1", COPYTRACE_REPORT="0", COPYTRACE_OUTPUT=str(tmp_path / "out"))
    code = ("import sys, torch; torch.ones(2).clone(); "
            "print('torch._dynamo' in sys.modules, type(sys.meta_path[0]).__module__)")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env=env, timeout=600)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["False", "copytrace.tracer._dynamo_import"]
    assert list((tmp_path / "out").glob("*.otlp.jsonl*"))  # traced all the same
