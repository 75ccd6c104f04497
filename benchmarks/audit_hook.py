"""What the ``os.exec`` audit hook costs a traced program, per audit event and per copy.

Under ``COPYTRACE=1`` copytrace adds an audit hook (PEP 578) at the first trace start
(``launch/process.py`` ``_register_exec_hook``) that acts on the ``os.exec`` event only. A
hook cannot be removed, and CPython calls every hook on every audit event for the rest of the
interpreter's life: the Python fallback raises about 28 of them per copy
(``object.__getattr__``, ``builtins.id``, ``sys._getframe``). This benchmark runs, in one
process, before and after the hook is added:

    frame       ``sys._getframe()`` in a loop: one audit event a call
    traced      99 copy events a step (33 x clone, detach, .to(float64), as ``per_event.py``)
                traced (on the Python fallback: ``COPYTRACE_OBSERVER=python``)

and prints the cost per audit event and per traced copy beyond the run without the hook, and
the audit events per copy (counted by a second hook added last). ``--observer native`` loads
the C++ observer first: the hook is then its C hook (``_native/audit.cpp``), which calls
Python at ``os.exec`` only, and the copies are traced on the observer's path (which raises no
audit event per copy); ``python`` (the default) keeps the Python hook and the fallback. The
default counts CPU time (``time.process_time_ns``; give the load average beside it);
``--instructions`` counts instructions under valgrind's callgrind instead
(``instructions.py``'s client requests around each part), which the load does not change.

    python benchmarks/audit_hook.py
    python benchmarks/audit_hook.py --instructions --calls 20000 --steps 20
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent


def _frames(calls: int) -> None:
    getframe = sys._getframe
    for _ in range(calls):
        getframe()


def _child(calls: int, steps: int, rounds: int, lib: str | None) -> None:
    """The parts, without then with copytrace's hook; then the audit events per copy."""
    import torch
    from instructions import Counter
    from per_event import _loop  # the same 99 copy events a step

    import copytrace
    from copytrace.launch import process
    from copytrace.tracer import _native

    _native.load()  # None under COPYTRACE_OBSERVER=python: the Python hook

    torch.set_num_threads(1)
    counter = Counter(lib)
    x, y = torch.randn(16, requires_grad=True), torch.randn(16)

    def measure(tag: str, rnd: int) -> None:
        _frames(1000)
        counter.settle()
        counter.begin()
        _frames(calls)
        counter.end(f"frame_{tag}_{rnd}", calls)
        with copytrace.trace(write=False):
            _loop(x, y, 2)  # warm-up: call-site caches, first events
            counter.settle()
            counter.begin()
            _loop(x, y, steps)
            counter.end(f"traced_{tag}_{rnd}", steps * 99)

    for rnd in range(rounds):
        measure("nohook", rnd)
    process._register_exec_hook()
    for rnd in range(rounds):
        measure("hook", rnd)
    seen = [0]

    def count(event: str, args: tuple) -> None:
        seen[0] += 1

    sys.addaudithook(count)
    with copytrace.trace(write=False):
        _loop(x, y, 2)
        seen[0] = 0
        _loop(x, y, steps)
        events = seen[0]
    print(json.dumps({"audit_events_per_copy": events / (steps * 99)}), flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=200_000, help="sys._getframe() calls")
    parser.add_argument("--steps", type=int, default=200, help="steps of 99 copy events")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument(
        "--observer", choices=("python", "native"), default="python",
        help="the Python fallback and hook, or the C++ observer and C hook",
    )  # fmt: skip
    parser.add_argument("--instructions", action="store_true",
                        help="count instructions under callgrind instead of CPU time")  # fmt: skip
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--lib", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if min(args.calls, args.steps, args.rounds) < 1:
        parser.error("--calls, --steps and --rounds must be at least 1")
    if args.child:
        _child(args.calls, args.steps, args.rounds, args.lib)
        return 0
    if args.instructions and shutil.which("valgrind") is None:
        print("audit_hook.py: valgrind is not installed", file=sys.stderr)
        return 2
    import instructions

    env = instructions._env()
    env["COPYTRACE_OBSERVER"] = args.observer
    child = [sys.executable, str(Path(__file__).resolve()), "--child", "--calls",
             str(args.calls), "--steps", str(args.steps), "--rounds", str(args.rounds)]  # fmt: skip
    with tempfile.TemporaryDirectory(prefix="copytrace-audit-") as tmp:
        parts, other = instructions.run_parts(
            child, env, args.instructions, Path(tmp), "audit_hook.py"
        )
    rows = [json.loads(line) for line in other if line.startswith("{")]
    per_copy = next((r["audit_events_per_copy"] for r in rows if "audit_events_per_copy" in r), 0.0)
    unit = "instructions" if args.instructions else "CPU ns"
    path = "the Python fallback and hook" if args.observer == "python" else "the C hook"
    print(f"{unit}; {path}; load average {os.getloadavg()[0]:.1f}")
    print(f"audit events per copy event: {per_copy:.1f}")
    for part, what in (("frame", "audit event"), ("traced", "traced copy event")):
        for rnd in range(args.rounds):
            without, with_ = parts[f"{part}_nohook_{rnd}"], parts[f"{part}_hook_{rnd}"]
            print(f"{part} round {rnd}: per {what} {without:,.0f} without the hook, "
                  f"{with_:,.0f} with it: {with_ - without:+,.0f} "
                  f"({(with_ - without) / without:+.1%})")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
