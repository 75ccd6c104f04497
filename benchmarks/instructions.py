"""Overhead in instructions: what a step costs, counted by valgrind, not timed.

Wall and CPU time on a shared machine move by more than the 1% that separates an armed
process from a plain one. Instructions retired do not depend on the load: this benchmark
runs the workloads of ``overhead.py`` under ``valgrind --tool=callgrind`` (one thread:
``OMP_NUM_THREADS=1``, ``torch.set_num_threads(1)``) and counts the instructions (callgrind's
``Ir``) of the measured steps alone. A small C helper, compiled here with ``cc`` against
valgrind's ``callgrind.h``, gives Python callgrind's client requests: each measured part
starts the instrumentation and zeroes the counts before its first step, and dumps them and
stops the instrumentation after its last, so start-up, compiling, warm-up and entering or
leaving the context are not counted (and run at valgrind's uninstrumented speed).

    python benchmarks/instructions.py                       # W1 and W5: plain, armed, ...
    python benchmarks/overhead.py --instructions --workloads W1    # the same, from overhead.py
    python benchmarks/instructions.py --workloads W1 --steps 20 --rounds 2 --boundary 0
    python benchmarks/instructions.py --keep DIR && callgrind_annotate DIR/callgrind.out.2

Prints, per workload, the plain step's instructions and each variant's ratio to it (the
variants of ``overhead.py``), with the spread of the rounds; then what one step boundary
with nothing due to flush costs (``Trace.step()``, and the automatic boundary at
``optimizer.step()``), in instructions and in ns. The ns are the instructions divided by
an instructions-per-ns figure measured on this machine: the plain W1 step's instructions
over its CPU time in a run without valgrind (best of the rounds); the ns measured directly
in that run are printed beside them.

Needs valgrind (with its headers, ``callgrind.h``) and a C compiler. Under valgrind the
process runs some 5-50 times slower: the default size takes minutes.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent

_MARK_C = r"""
#include <valgrind/callgrind.h>
void ct_start(void) { CALLGRIND_START_INSTRUMENTATION; }
void ct_stop(void) { CALLGRIND_STOP_INSTRUMENTATION; }
void ct_zero(void) { CALLGRIND_ZERO_STATS; }
void ct_dump(const char* name) { CALLGRIND_DUMP_STATS_AT(name); }
int ct_on_valgrind(void) { return RUNNING_ON_VALGRIND; }
"""

DEFAULT_VARIANTS = ["plain", "ct_armed", "ct_step", "copytrace"]


# -- in the measured process -----------------------------------------------------------------
class Counter:
    """Measures parts of the process: under valgrind by callgrind's client requests (the
    counts are read from the dump files afterwards), else by CPU time (ns, printed as JSON
    lines on stdout)."""

    def __init__(self, lib: str | None) -> None:
        self.lib = ctypes.CDLL(lib) if lib else None
        self._t0 = 0

    def begin(self) -> None:
        if self.lib is None:
            self._t0 = time.process_time_ns()
            return
        self.lib.ct_start()  # instrumented only while measured: compiling W5 is not
        self.lib.ct_zero()

    def settle(self) -> None:
        """An empty part, not reported: the first part after a stretch of uninstrumented
        work (building a model, compiling W5) can come out wrong, even below zero."""
        if self.lib is not None:
            self.begin()
            self.end("settle", 0)

    def end(self, name: str, count: int) -> None:
        if self.lib is None:
            ns = time.process_time_ns() - self._t0
            print(json.dumps({"part": name, "count": count, "ns": ns}), flush=True)
            return
        self.lib.ct_dump(f"{name}|{count}".encode())
        self.lib.ct_stop()


def _measure_steps(counter: Counter, step, make_ctx, steps: int, name: str) -> None:
    """One part: ``steps`` steps inside one context, after a warm-up step in it."""
    marks = getattr(make_ctx, "marks_steps", False)
    with make_ctx() as ctx:
        step()
        if marks:
            ctx.step()
        counter.begin()
        for _ in range(steps):
            step()
            if marks:
                ctx.step()
        counter.end(name, steps)


def _measure_boundaries(counter: Counter, calls: int, rnd: int) -> None:
    """Step boundaries with nothing due to flush (no records, no flush for 10^9 s), each
    part ``calls`` calls; the ``*_empty`` parts are the same loops with nothing to mark."""
    import torch

    import copytrace

    def noop() -> None:
        return None

    p = torch.nn.Parameter(torch.zeros(1))  # no grad: SGD.step() updates nothing
    opt = torch.optim.SGD([p], lr=0.1)
    quiet = {"write": False, "flush_events": 10**9, "flush_seconds": 1e9}
    sessions = {
        "armed": lambda: copytrace.trace(trigger="signal", **quiet),
        "tracing": lambda: copytrace.trace(**quiet),
    }
    parts = [("t.step_empty", contextlib.nullcontext, "noop")]
    parts += [(f"t.step {k}", make, "step") for k, make in sessions.items()]
    parts += [("opt.step plain", contextlib.nullcontext, "opt")]
    parts += [(f"opt.step {k}", make, "opt") for k, make in sessions.items()]
    for name, make, what in parts:
        with make() as t:
            call = {"noop": noop, "step": getattr(t, "step", None), "opt": opt.step}[what]
            call()
            call()
            counter.begin()
            for _ in range(calls):
                call()
            counter.end(f"boundary {name} {rnd}", calls)


def child(args: argparse.Namespace) -> int:
    """The measured process (under valgrind, or not for the CPU-time run)."""
    import overhead
    import torch

    torch.set_num_threads(1)
    overhead._COMPILE_BACKEND[0] = args.compile_backend
    counter = Counter(args.lib)
    for wname in args.workloads:
        step = overhead.WORKLOADS[wname][1]()
        counter.settle()
        for r in range(args.rounds):
            k = r % len(args.variants)
            for variant in args.variants[k:] + args.variants[:k]:
                _measure_steps(
                    counter, step, overhead.VARIANTS[variant], args.steps, f"{wname} {variant} {r}"
                )
    counter.settle()
    for r in range(args.rounds if args.boundary else 0):
        _measure_boundaries(counter, args.boundary, r)
    return 0


# -- the driver -----------------------------------------------------------------------------------
def _build_marker(tmp: Path) -> Path:
    src, lib = tmp / "ctmark.c", tmp / "libctmark.so"
    src.write_text(_MARK_C)
    cc = os.environ.get("CC", "cc")
    proc = subprocess.run(
        [cc, "-O2", "-shared", "-fPIC", "-o", str(lib), str(src)], capture_output=True, text=True
    )
    if proc.returncode != 0:
        raise SystemExit(
            f"instructions.py: cannot build the callgrind helper with {cc} (valgrind's "
            f"callgrind.h needed): {proc.stderr.strip().splitlines()[-1:]}"
        )
    return lib


def _child_argv(args: argparse.Namespace, lib: Path | None) -> list[str]:
    argv = [sys.executable, str(Path(__file__).resolve()), "--child"]
    argv += ["--workloads", *args.workloads, "--variants", *args.variants]
    argv += ["--steps", str(args.steps), "--rounds", str(args.rounds)]
    argv += ["--boundary", str(args.boundary), "--compile-backend", args.compile_backend]
    if lib is not None:
        argv += ["--lib", str(lib)]
    return argv


def _env() -> dict[str, str]:
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", PYTHONHASHSEED="0")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(HERE), env.get("PYTHONPATH")]))
    return env


_DESC = "desc: Trigger: Client Request: "


def read_dumps(out: Path) -> dict[str, tuple[int, int]]:
    """``{part name: (Ir, count)}`` from callgrind's dump files (``desc: Trigger: Client
    Request: NAME|COUNT`` and ``summary: IR`` or ``totals: IR`` lines)."""
    parts: dict[str, tuple[int, int]] = {}
    for path in sorted(out.parent.glob(out.name + ".*")):
        name = ir = None
        for line in path.read_text(errors="replace").splitlines():
            if line.startswith(_DESC):
                name = line[len(_DESC) :]
            elif line.startswith(("summary:", "totals:")) and ir is None:
                ir = int(line.split()[1])
        if name and "|" in name and ir is not None:
            label, count = name.rsplit("|", 1)
            parts[label] = (ir, int(count))
    return parts


def run_parts(
    argv: list[str], env: dict[str, str], counted: bool, tmp: Path, who: str
) -> tuple[dict[str, float], list[str]]:
    """Run a child that measures parts with :class:`Counter` (``argv`` without ``--lib``):
    timed (``{part: CPU ns per count}``), or under callgrind when ``counted`` (``{part:
    instructions per count}``, the marker library built in ``tmp`` and passed as ``--lib``).
    Returns the parts and the child's other stdout lines. Settling parts (count 0) are left
    out. Raises SystemExit, naming ``who``, with the tail of the child's stderr if it fails."""
    if counted:
        lib = _build_marker(tmp)
        out = tmp / "callgrind.out"
        argv = ["valgrind", "--tool=callgrind", "--instr-atstart=no",
                f"--callgrind-out-file={out}", *argv, "--lib", str(lib)]  # fmt: skip
    proc = subprocess.run(argv, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"{who}: the child failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
    parts: dict[str, float] = {}
    other = []
    for line in proc.stdout.splitlines():
        row = json.loads(line) if line.startswith('{"part"') else None
        if row is None:
            other.append(line)
        elif row["count"]:
            parts[row["part"]] = row["ns"] / row["count"]
    if counted:
        parts = {k: ir / n for k, (ir, n) in read_dumps(out).items() if n}
    return parts, other


def run_valgrind(args: argparse.Namespace, tmp: Path) -> dict[str, float]:
    """Instructions per step (or per call) of each part, from one valgrind run."""
    lib = _build_marker(tmp)
    out = tmp / "callgrind.out"
    cmd = ["valgrind", "--tool=callgrind", "--instr-atstart=no", f"--callgrind-out-file={out}"]
    proc = subprocess.run(cmd + _child_argv(args, lib), env=_env(), capture_output=True, text=True)
    if proc.returncode != 0:
        sys.stderr.write(proc.stdout[-4000:] + proc.stderr[-4000:])
        raise SystemExit(f"instructions.py: the run under valgrind failed ({proc.returncode})")
    return {k: ir / n for k, (ir, n) in read_dumps(out).items() if n}


def run_native(args: argparse.Namespace) -> dict[str, float]:
    """CPU ns per step (or per call) of each part, from one run without valgrind."""
    proc = subprocess.run(_child_argv(args, None), env=_env(), capture_output=True, text=True)
    if proc.returncode != 0:
        sys.stderr.write(proc.stderr[-4000:])
        raise SystemExit(f"instructions.py: the run without valgrind failed ({proc.returncode})")
    rows = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    return {r["part"]: r["ns"] / r["count"] for r in rows}


def _rounds(parts: dict[str, float], prefix: str) -> list[float]:
    return [v for k, v in parts.items() if k.rsplit(" ", 1)[0] == prefix]


def spread(values: list[float]) -> float:
    """(max - min) / median of the rounds, as a fraction."""
    return (max(values) - min(values)) / statistics.median(values) if values else float("nan")


def print_steps(args: argparse.Namespace, counts: dict[str, float]) -> None:
    """Per workload: the plain step's Ir and each variant's ratio to it; under it, each
    variant's spread over the rounds."""
    print(f"instructions per step (callgrind Ir, 1 thread), {args.steps} steps x {args.rounds} "
          "rounds, median; ratio to plain; spread = (max - min) / median of the rounds")  # fmt: skip
    print(f"{'workload':8s} {'plain Ir':>12s} " + " ".join(f"{v:>10s}" for v in args.variants)
          + "   armed - plain")  # fmt: skip
    for w in args.workloads:
        med = {v: statistics.median(_rounds(counts, f"{w} {v}")) for v in args.variants}
        plain = med["plain"]
        extra = f"{med['ct_armed'] - plain:+,.0f} Ir" if "ct_armed" in med else ""
        ratios = " ".join(f"{med[v] / plain:9.4f}x" for v in args.variants)
        print(f"{w:8s} {plain:12,.0f} {ratios}   {extra}")
        spreads = " ".join(
            f"{spread(_rounds(counts, f'{w} {v}')) * 100:9.2f}%" for v in args.variants
        )
        print(f"{'  spread':8s} {'':12s} {spreads}")


def print_boundaries(counts: dict[str, float], native: dict[str, float] | None) -> None:
    """Each boundary less its empty loop (the same calls with nothing to mark)."""
    ipns = float("nan")
    if native:
        w1 = min(_rounds(native, "W1 plain"), default=float("nan"))
        ir = statistics.median(_rounds(counts, "W1 plain")) if "W1 plain 0" in counts else 0
        ipns = ir / w1 if ir else float("nan")
    print(f"\nstep boundary, nothing due to flush (goal <= 5 us); {ipns:.2f} Ir/ns "
          "(the plain W1 step's Ir over its best CPU time without valgrind)")  # fmt: skip
    print(f"{'boundary':30s} {'Ir/call':>9s} {'ns (Ir)':>9s} {'ns (CPU)':>9s}  spread")
    rows = [("Trace.step(), armed", "t.step armed", "t.step_empty"),
            ("Trace.step(), tracing", "t.step tracing", "t.step_empty"),
            ("optimizer.step(), armed", "opt.step armed", "opt.step plain"),
            ("optimizer.step(), tracing", "opt.step tracing", "opt.step plain")]  # fmt: skip
    for label, part, base in rows:
        vals = _rounds(counts, f"boundary {part}")
        if not vals:
            continue
        ir = statistics.median(vals) - statistics.median(_rounds(counts, f"boundary {base}"))
        cpu = float("nan")
        if native:
            nat = min(_rounds(native, f"boundary {part}"))
            cpu = nat - min(_rounds(native, f"boundary {base}"))
        print(f"{label:30s} {ir:9,.0f} {ir / ipns:9,.0f} {cpu:9,.0f}  {spread(vals) * 100:.3f}%")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workloads", nargs="*", default=["W1", "W5"])
    parser.add_argument("--variants", nargs="*", default=DEFAULT_VARIANTS)
    parser.add_argument("--steps", type=int, default=50, help="measured steps per part")
    parser.add_argument("--rounds", type=int, default=3, help="parts per variant, interleaved")
    parser.add_argument("--boundary", type=int, default=200,
                        help="calls per step-boundary part (0: no boundary table)")  # fmt: skip
    parser.add_argument("--compile-backend", default="inductor", help="torch.compile backend of W5")
    parser.add_argument("--no-native", action="store_true",
                        help="skip the run without valgrind (no ns figures)")  # fmt: skip
    parser.add_argument("--keep", metavar="DIR",
                        help="keep callgrind's dump files here (callgrind.out.N, one per part: "
                        "callgrind_annotate reads them)")  # fmt: skip
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--lib", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        return child(args)
    import overhead

    bad = [w for w in args.workloads if w not in overhead.WORKLOADS]
    bad += [v for v in args.variants if v not in overhead.VARIANTS]
    if bad or "plain" not in args.variants:
        parser.error(f"unknown workload or variant {bad}, or no 'plain' among the variants")
    if shutil.which("valgrind") is None:
        print("instructions.py: valgrind is not installed", file=sys.stderr)
        return 2
    print(f"load average {os.getloadavg()[0]:.1f} (instruction counts do not depend on it)")
    if args.keep:
        Path(args.keep).mkdir(parents=True, exist_ok=True)
        counts = run_valgrind(args, Path(args.keep))
    else:
        with tempfile.TemporaryDirectory(prefix="copytrace-ir-") as tmp:
            counts = run_valgrind(args, Path(tmp))
    native = None if args.no_native else run_native(args)
    print_steps(args, counts)
    if args.boundary:
        print_boundaries(counts, native)
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(HERE))
    raise SystemExit(main())
