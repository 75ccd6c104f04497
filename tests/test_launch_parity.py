"""The same programs through ``copytrace run``, ``COPYTRACE=1`` and the context manager give
the same events and the same findings (and the same recorded exit).

The context-manager form is the program itself, indented under
``with copytrace.trace(...):`` on its first line (a comment line in the program), so that its
line numbers and its module globals are those of the other two ways in: the globals stay
alive until tracing stops in all three.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from copytrace.analysis import analyze
from copytrace.dashboards import load_trace

# One program with a hazard of each kind whose facts depend on what is alive when tracing
# stops: a running total of logged copies (no step marks, kept in a global), an optimizer
# state handover, a lost write into a gather, and written vs unwritten clones.
_PROGRAM = """\
# (the context-manager form replaces this line)
import torch
import torch.nn as nn

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
x = torch.randn(4, 8)
opt_a = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
model(x).sum().backward()
opt_a.step()
opt_b = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
opt_b.load_state_dict(opt_a.state_dict())
opt_a.step()
with torch.no_grad():
    model[0].weight[torch.tensor([0, 3])].zero_()
a = x.clone()
a.mul_(2)
b = x.clone()
c = x.clone()
total = torch.zeros(())
for _ in range(3):
    total = total + model(x).pow(2).mean().clone()
"""


def _write_programs(tmp: Path, tail: str) -> tuple[Path, Path]:
    text = _PROGRAM + tail
    plain = tmp / "prog.py"
    plain.write_text(text)
    lines = text.splitlines()
    head = 'with __import__("copytrace").trace(__import__("os").environ["OUT"]):'
    body = [head] + ["    " + line if line else "" for line in lines[1:]]
    wrapped = tmp / "prog_cm.py"
    wrapped.write_text("\n".join(body) + "\n")
    return plain, wrapped


def _run(args: list[str], out: Path, **env: str) -> subprocess.CompletedProcess:
    full = {**os.environ, "OUT": str(out), "COPYTRACE_REPORT": "0", **env}
    full.pop("COPYTRACE", None) if "COPYTRACE" not in env else None
    return subprocess.run(args, env=full, capture_output=True, text=True, timeout=300)


def _facts(out: Path, script_names: tuple[str, ...]) -> tuple[list, list, Any]:
    """(events, findings, copytrace.exit) with file names reduced to the base name."""

    def name(path: Any) -> Any:
        if isinstance(path, str):
            for script in script_names:
                path = path.replace(str(out.parent / script), "prog.py")
        return path

    trace = load_trace(out)
    (run,) = trace.runs
    keys = ("op", "bytes_allocated", "alias", "noop", "snapshot", "stale", "retained_bytes",
            "inplace_writes", "step")  # fmt: skip
    events = [
        tuple(e.attrs.get("copytrace." + k) for k in keys)
        + (e.attrs.get("code.line.number"), name(e.attrs.get("copytrace.write_site")))
        for e in run.events
    ]
    findings = [(f.code, f.bytes, [name(s) for s in f.call_sites], f.steps) for f in analyze(trace)]
    return events, findings, run.attrs.get("copytrace.exit")


def test_three_ways_in_give_the_same_events_and_findings(tmp_path: Path) -> None:
    # the program ends by raising: its globals then live on only in the traceback
    status = 1
    plain, wrapped = _write_programs(tmp_path, "raise ValueError('end')\n")
    names = (plain.name, wrapped.name)
    outs = {way: tmp_path / way for way in ("run", "env", "cm")}
    results = {
        "run": _run([sys.executable, "-m", "copytrace", "run", "-o", str(outs["run"]),
                     "--no-report", str(plain)], outs["run"]),
        "env": _run([sys.executable, str(plain)], outs["env"], COPYTRACE="1",
                    COPYTRACE_OUTPUT=str(outs["env"])),
        "cm": _run([sys.executable, str(wrapped)], outs["cm"]),
    }  # fmt: skip
    for way, proc in results.items():
        assert proc.returncode == status, (way, proc.stderr)
    facts = {way: _facts(out, names) for way, out in outs.items()}
    events, findings, _ = facts["env"]
    codes = sorted(f[0] for f in findings)
    # the running total (3 graphs kept through `total`), the handover, the lost write, and
    # the two unwritten clones b, c
    assert codes == sorted(
        ["graph-retaining-copy", "aliasing-snapshot", "lost-inplace-write", "redundant-copy"]
    ), findings
    for way in ("run", "cm"):
        assert facts[way][0] == events, way
        assert facts[way][1] == findings, way
    # the exception the program ended with is recorded by every way in
    assert {way: f[2] for way, f in facts.items()} == dict.fromkeys(outs, "ValueError")
