"""Per-event cost of a copy-heavy program: copytrace (both paths) next to torch.profiler.

The program makes 99 copy or alias events per step (33 x clone, detach, .to(float64) of small
tensors) and nothing else, so the recording cost per event dominates. Each variant runs in its
own subprocess (import and start-up excluded: the timed region is the loop):

    plain       the loop untraced
    copytrace   COPYTRACE=1 at the default level, lean (the C++ observer and torch's copying
                API hot-patched in C, no function mode), trace file written (gzip OTLP/JSON
                and its columnar sidecar)
    ct_full     the same at COPYTRACE_LEVEL=full (copytrace's function mode on the stack)
    ct_nosidecar  the same without the columnar sidecar (COPYTRACE_SIDECAR=0)
    ct_python   COPYTRACE=1 COPYTRACE_OBSERVER=python, the Python fallback path
    profiler    torch.profiler (record_shapes=True, with_stack=True), then listing its events
    plain_library, ct_library  the loop untraced / traced as ``copytrace``, its copies made
                inside a library function (code under a ``site-packages`` folder): each
                event then also records the library's call site

and prints seconds for the loop, (variant - plain) / events in microseconds per event (wall
time, and the loop thread's CPU time, which a loaded machine changes less), the seconds
from the loop's end to the process's exit (copytrace writes the trace file there,
torch.profiler lists its events), that exit beyond the plain run's per 100k events, the
exit's CPU time (the whole process's, all threads, from the loop's end to its exit) beyond
the plain run's per 100k events, the end-to-end cost per event: (loop + exit) - plain's
(loop + exit), over the events, and the whole process's CPU time (user + system, all
threads) beyond the plain run's per event (it includes copytrace's start-up). The CPU
columns change less than the wall times on a loaded machine; on a quiet one the exit's wall
time can be below its CPU time (the trace file's text and gzip run on a second core). The
program has no step boundary, so copytrace encodes everything at exit (the worst case for
the exit; a training loop's steps flush on the export thread as it runs).

    python benchmarks/per_event.py --steps 2000
    python benchmarks/per_event.py --instructions --steps 20   # callgrind, not timed

``--instructions`` runs the same loop (``copytrace.trace(write=False)``, level lean, and
untraced) in one process under valgrind's callgrind, with ``instructions.py``'s client
requests around the loop alone, and prints the instructions per event beyond the untraced
loop's, per round: a count load does not change (rounds agree within a few hundred
instructions), where the timed table moves by 10-20% between runs.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent

PROGRAM = r"""
import json, sys, time, torch
steps, variant = int(sys.argv[1]), sys.argv[2]
x = torch.randn(16, requires_grad=True)
y = torch.randn(16)

def loop():
    for _ in range(steps):
        for _ in range(33):
            a = x.clone(); b = y.detach(); c = y.to(torch.float64)

if variant.endswith("_library"):  # the same copies, made by a library's function
    ns = {"torch": torch, "x": x, "y": y}
    src = "def body():\n    return x.clone(), y.detach(), y.to(torch.float64)\n"
    exec(compile(src, "/opt/bench/site-packages/benchlib/ops.py", "exec"), ns)
    body = ns["body"]

    def loop():
        for _ in range(steps):
            for _ in range(33):
                body()

t0, c0 = time.perf_counter(), time.thread_time()
if variant == "profiler":
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True, with_stack=True) as p:
        loop()
    run, cpu = time.perf_counter() - t0, time.thread_time() - c0
    n = len(p.events())
    listed = time.perf_counter() - t0 - run
else:
    loop()
    run, cpu, listed = time.perf_counter() - t0, time.thread_time() - c0, 0.0
print(json.dumps({"run": run, "cpu": cpu, "listed": listed, "loop_end": time.time(),
                  "loop_end_cpu": time.process_time()}))
"""


def _run(variant: str, steps: int, out: str) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("COPYTRACE")}
    env["OMP_NUM_THREADS"] = "1"
    if variant in ("copytrace", "ct_full", "ct_python", "ct_nosidecar", "ct_library"):
        env.update(COPYTRACE="1", COPYTRACE_REPORT="0", COPYTRACE_OUTPUT=out)
        env["COPYTRACE_LEVEL"] = "full" if variant == "ct_full" else "lean"
        if variant == "ct_nosidecar":
            env["COPYTRACE_SIDECAR"] = "0"
        if variant == "ct_python":
            env["COPYTRACE_OBSERVER"] = "python"
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    proc = subprocess.run(
        [sys.executable, "-c", PROGRAM, str(steps), variant],
        capture_output=True, text=True, env=env, check=True,
    )  # fmt: skip
    exited = time.time()
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    result["proc_cpu"] = (after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime)
    result["exit"] = exited - result.pop("loop_end")
    result["exit_cpu"] = result["proc_cpu"] - result.pop("loop_end_cpu")
    return result


def _loop(x, y, steps: int) -> None:
    import torch

    for _ in range(steps):
        for _ in range(33):
            # kept until the next iteration's, as PROGRAM's loop keeps them
            a = x.clone()  # noqa: F841
            b = y.detach()  # noqa: F841
            c = y.to(torch.float64)  # noqa: F841


def _child(steps: int, rounds: int, lib: str) -> None:
    """Under valgrind: the loop untraced and traced, ``rounds`` times, each counted alone."""
    import torch
    from instructions import Counter

    import copytrace

    torch.set_num_threads(1)
    counter = Counter(lib)
    x, y = torch.randn(16, requires_grad=True), torch.randn(16)
    for rnd in range(rounds):
        for name in ("plain", "traced"):
            ctx = copytrace.trace(write=False) if name == "traced" else contextlib.nullcontext()
            with ctx:
                _loop(x, y, 2)  # warm-up: call-site caches, first events
                counter.settle()
                counter.begin()
                _loop(x, y, steps)
                counter.end(f"{name}_{rnd}", steps * 99)


def _instructions(steps: int, rounds: int) -> int:
    """Instructions per event beyond the untraced loop, from one callgrind run."""
    import instructions

    if shutil.which("valgrind") is None:
        print("per_event.py: valgrind is not installed", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory(prefix="copytrace-ir-") as tmp:
        lib = instructions._build_marker(Path(tmp))
        out = Path(tmp) / "callgrind.out"
        cmd = ["valgrind", "--tool=callgrind", "--instr-atstart=no",
               f"--callgrind-out-file={out}", sys.executable, str(Path(__file__).resolve()),
               "--child", "--steps", str(steps), "--rounds", str(rounds), "--lib", str(lib)]  # fmt: skip
        proc = subprocess.run(cmd, env=instructions._env(), capture_output=True, text=True)
        if proc.returncode != 0:
            sys.stderr.write(proc.stderr[-4000:])
            print(f"per_event.py: the run under valgrind failed ({proc.returncode})",
                  file=sys.stderr)  # fmt: skip
            return 1
        parts = {k: ir / n for k, (ir, n) in instructions.read_dumps(out).items() if n}
    print(f"{steps * 99} events a round ({steps} steps x 99), callgrind instructions per event")
    for rnd in range(rounds):
        plain, traced = parts[f"plain_{rnd}"], parts[f"traced_{rnd}"]
        print(f"round {rnd}: plain {plain:,.0f}, traced {traced:,.0f}, "
              f"beyond plain {traced - plain:,.0f}")  # fmt: skip
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=2000, help="steps of 99 events each")
    parser.add_argument(
        "--variants", nargs="*", default=["plain", "copytrace", "ct_full", "ct_python", "profiler"]
    )
    parser.add_argument("--instructions", action="store_true",
                        help="count instructions under callgrind instead of timing")  # fmt: skip
    parser.add_argument("--rounds", type=int, default=2, help="rounds of --instructions")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--lib", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.steps < 1 or args.rounds < 1:
        parser.error("--steps and --rounds must be at least 1")
    if args.child:
        _child(args.steps, args.rounds, args.lib)
        return 0
    if args.instructions:
        return _instructions(args.steps, args.rounds)
    events = args.steps * 99
    with tempfile.TemporaryDirectory() as out:
        results = {v: _run(v, args.steps, out) for v in args.variants}
    print(f"{events} events ({args.steps} steps x 99)")
    print(_table(results, events))
    return 0


def _table(results: dict[str, dict], events: int) -> str:
    """One row per variant: loop, listing, per-event loop cost (wall, CPU), exit, exit per
    100k events and end-to-end cost per event, both beyond the plain run's."""
    plain = results.get("plain", {"run": 0.0, "cpu": 0.0, "exit": 0.0, "listed": 0.0,
                                  "proc_cpu": 0.0, "exit_cpu": 0.0})  # fmt: skip
    head = ("variant", "loop s", "listing s", "us/event", "cpu us/event", "exit s",
            "exit s/100k", "exit cpu s/100k", "end-to-end us/event", "process cpu us/event")  # fmt: skip
    widths = (12, 7, 10, 9, 13, 7, 12, 16, 20, 21)
    lines = [" ".join(f"{h:>{w}s}" if i else f"{h:{w}s}" for i, (h, w) in
                      enumerate(zip(head, widths, strict=True)))]  # fmt: skip
    for v, r in results.items():
        base = results.get("plain_library", plain) if v.endswith("_library") else plain
        per = (r["run"] - base["run"]) / events * 1e6
        cpu = (r["cpu"] - base["cpu"]) / events * 1e6
        exit_net = r["exit"] + r["listed"] - base["exit"]
        total = (r["run"] - base["run"] + exit_net) / events * 1e6
        proc = (r["proc_cpu"] - base["proc_cpu"]) / events * 1e6
        exit_cpu = (r["exit_cpu"] - base["exit_cpu"]) / events * 1e5
        cells = (f"{r['run']:7.2f}", f"{r['listed']:10.2f}", f"{per:9.1f}", f"{cpu:13.1f}",
                 f"{r['exit']:7.2f}", f"{exit_net / events * 1e5:12.2f}", f"{exit_cpu:16.2f}",
                 f"{total:20.1f}", f"{proc:21.1f}")  # fmt: skip
        lines.append(f"{v:12s} " + " ".join(cells))
    return "\n".join(lines)


if __name__ == "__main__":
    sys.path.insert(0, str(HERE))
    raise SystemExit(main())
