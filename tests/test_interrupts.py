"""Ctrl-C under ``COPYTRACE=1``: a KeyboardInterrupt the program gets while copytrace's own code
runs for it (Python runs signal handlers between any two bytecodes of the main thread, copytrace's
included) is the program's: it ends the program as untraced, and the trace and report are still
written at exit (``docs/observer-effects.md``, the row of the C++ observer's callbacks)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

_PROGRAM = textwrap.dedent(
    """
    import os, signal, sys
    import torch

    traced = sys.argv[1] == "traced"
    model = torch.nn.Linear(4, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    step = [0]

    def interrupt():
        if step[0] == 2:  # Ctrl-C at the third step's optimizer step
            os.kill(os.getpid(), signal.SIGINT)

    if traced:  # the signal comes while copytrace's step callback runs (its step boundary)
        from copytrace.tracer.session import Session

        boundary = Session._boundary

        def in_copytrace(self, *args, **kwargs):
            interrupt()  # the default handler raises KeyboardInterrupt here, in copytrace
            return boundary(self, *args, **kwargs)

        Session._boundary = in_copytrace
    else:  # untraced: at the same point of the step, in a hook of the program
        opt.register_step_post_hook(lambda *a: interrupt())

    for step[0] in range(5):
        model(torch.ones(2, 4).clone()).sum().backward()
        opt.step()
        opt.zero_grad()
        print("step", step[0], flush=True)
    print("finished", flush=True)
    """
)


def _run(script, how, out, observer):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("COPYTRACE", "OTEL_"))}
    if how == "traced":
        env.update(COPYTRACE="1", COPYTRACE_OUTPUT=str(out), COPYTRACE_OBSERVER=observer)
    return subprocess.run(
        [sys.executable, str(script), how], env=env, capture_output=True, text=True, timeout=600
    )


@pytest.mark.parametrize("observer", ["auto", "python"])
def test_ctrl_c_inside_copytraces_step_callback_ends_the_program_and_writes_the_report(
    observer, tmp_path
):
    script = tmp_path / "interrupted.py"
    script.write_text(_PROGRAM)
    out = tmp_path / "out"
    plain = _run(script, "untraced", out, observer)
    traced = _run(script, "traced", out, observer)
    # Python ends an unhandled KeyboardInterrupt by killing itself with SIGINT: -2 here.
    assert plain.returncode == -2, plain.stderr
    assert traced.returncode == -2, traced.stderr
    # Steps 0 and 1 ran; the interrupt ended step 2 before its print, as untraced (before,
    # copytrace's C++ step callback counted it as its own error and the loop went on to
    # "finished" with status 0).
    assert plain.stdout.splitlines() == ["step 0", "step 1"]
    assert traced.stdout.splitlines() == ["step 0", "step 1"]
    lines = traced.stderr.splitlines()
    start = lines.index("Traceback (most recent call last):")
    end = lines.index("KeyboardInterrupt")
    frames = [ln.strip() for ln in lines[start:end] if ln.startswith("  File ")]
    assert frames[0].startswith(f'File "{script}"')
    ours = [f for f in frames if "/copytrace/" in f]
    if observer == "auto":  # given back by the C++ callback, raised again where the program
        assert ours == []  # runs: no copytrace frame in the program's traceback
    else:  # on the fallback copytrace's step callback is Python called from its function
        # mode, a Python frame under the program's torch call: the interrupt passes up
        # through them, as any exception raised in a mode does, and the last frame is where
        # the handler ran
        assert any("copytrace/tracer/_modes.py" in f for f in ours), ours
        assert frames[-1].endswith("in interrupt"), frames
    assert "Exception ignored" not in traced.stderr
    assert len(list(out.glob("*.otlp.jsonl*"))) == 1
    assert (out / "report.html").is_file()
