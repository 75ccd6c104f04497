"""What naming an event's module and a compiled call's function costs, in instructions.

Events made inside nested module calls (each event's path is read from the module calls on
the stack, ``tracer/_modules.py``) and calls of a ``torch.compile``d function (its source
read at each call, ``compiled.cpp`` ``source_of``), each run plain and traced, counted by
valgrind's callgrind with the client requests of ``instructions.py`` (load does not change
instruction counts). Prints the traced part's instructions beyond the plain one's, per event
and per compiled call.

    python benchmarks/module_paths.py                 # under valgrind
    python benchmarks/module_paths.py --cpu           # CPU time instead (no valgrind)
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import instructions  # noqa: E402  (benchmarks/instructions.py: Counter, the callgrind helper)


def _model(depth: int):
    import torch
    from torch import nn

    class Leaf(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(8, 8)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.lin(x).clone()  # the event, `depth` module calls deep

    class Wrap(nn.Module):
        def __init__(self, inner: nn.Module) -> None:
            super().__init__()
            self.inner = inner

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.inner(x)

    model: nn.Module = nn.Sequential(*[Leaf() for _ in range(4)])
    for _ in range(depth - 2):
        model = Wrap(model)
    return model


def child(args: argparse.Namespace) -> None:
    import torch

    import copytrace

    torch.set_num_threads(1)
    counter = instructions.Counter(args.lib)
    model = _model(args.depth)
    x = torch.ones(2, 8)
    compiled = torch.compile(lambda t: t * 2, backend="eager")
    compiled(x)
    with torch.no_grad():
        for rnd in range(args.rounds):
            for name, traced in (("plain", False), ("traced", True)):
                ctx = copytrace.trace(write=False) if traced else _Nothing()
                with ctx:
                    model(x)
                    compiled(x)
                    counter.settle()
                    counter.begin()
                    for _ in range(args.steps):
                        model(x)
                    counter.end(f"module_{name}_{rnd}", args.steps * 4)  # 4 events a step
                    counter.begin()
                    for _ in range(args.steps):
                        compiled(x)
                    counter.end(f"compiled_{name}_{rnd}", args.steps)


class _Nothing:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--depth", type=int, default=4, help="module calls around each event")
    parser.add_argument("--cpu", action="store_true", help="CPU time, not instructions")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--lib", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.depth < 2:
        parser.error("--depth must be at least 2")
    if args.child:
        child(args)
        return 0
    argv = [sys.executable, str(Path(__file__).resolve()), "--child", "--steps", str(args.steps),
            "--rounds", str(args.rounds), "--depth", str(args.depth)]  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp:
        if args.cpu:
            parts, unit = _run_cpu(argv), "ns of CPU"
        else:
            lib = instructions._build_marker(Path(tmp))
            out = Path(tmp) / "callgrind.out"
            cmd = ["valgrind", "--tool=callgrind", "--instr-atstart=no",
                   f"--callgrind-out-file={out}"]  # fmt: skip
            proc = subprocess.run(cmd + argv + ["--lib", str(lib)], env=instructions._env(),
                                  capture_output=True, text=True)  # fmt: skip
            if proc.returncode != 0:
                sys.stderr.write(proc.stderr[-4000:])
                raise SystemExit(f"module_paths.py: the run failed ({proc.returncode})")
            parts = {k: ir / n for k, (ir, n) in instructions.read_dumps(out).items() if n}
            unit = "instructions"
    for what, per in (("module", "event"), ("compiled", "compiled call")):
        for rnd in range(args.rounds):
            plain, traced = parts[f"{what}_plain_{rnd}"], parts[f"{what}_traced_{rnd}"]
            print(f"{what} round {rnd}: plain {plain:,.0f}, traced {traced:,.0f}, "
                  f"beyond plain {traced - plain:,.0f} {unit} per {per}")  # fmt: skip
    return 0


def _run_cpu(argv: list[str]) -> dict[str, float]:
    import json

    proc = subprocess.run(argv, env=instructions._env(), capture_output=True, text=True)
    if proc.returncode != 0:
        sys.stderr.write(proc.stderr[-4000:])
        raise SystemExit(f"module_paths.py: the run failed ({proc.returncode})")
    rows = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    return {r["part"]: r["ns"] / r["count"] for r in rows}


if __name__ == "__main__":
    raise SystemExit(main())
