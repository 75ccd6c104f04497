"""What tracing adds to a ``torch.as_tensor`` call that makes no copy event.

``torch.as_tensor`` is hot-patched while tracing (level lean; copytrace's function mode at
level full): each call goes through the API level's C handler, which asks the recorder
whether this call reads tensors value by value (``as_tensor([t0, t1])``, a copy event). Of a
numpy array or of a tensor it makes no event of copytrace's own (a conversion it makes is
an aten op, recorded as such). This benchmark times, in one process, ``calls`` calls of

    numpy     ``torch.as_tensor(a)``, ``a`` a float32 numpy array of 16 (shares its memory)
    tensor    ``torch.as_tensor(t)``, ``t`` a float32 tensor of 16 (returns ``t``)

untraced and traced (``copytrace.trace(write=False)``, the default level), and prints the
time per call and what tracing adds. The default counts CPU time (``time.process_time_ns``;
give the load average beside it); ``--instructions`` counts instructions under valgrind's
callgrind (``instructions.py``'s client requests around each part), which the load does not
change.

    python benchmarks/as_tensor.py
    python benchmarks/as_tensor.py --instructions --calls 20000
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
CASES = ("numpy", "tensor")


def _child(calls: int, rounds: int, lib: str | None) -> None:
    import contextlib

    import numpy as np
    import torch
    from instructions import Counter

    import copytrace

    torch.set_num_threads(1)
    counter = Counter(lib)
    data = {"numpy": np.ones(16, dtype=np.float32), "tensor": torch.ones(16)}
    as_tensor = torch.as_tensor
    for rnd in range(rounds):
        for traced in (False, True):
            ctx = copytrace.trace(write=False) if traced else contextlib.nullcontext()
            with ctx:
                call = torch.as_tensor  # the patched function while tracing
                for case in CASES:
                    x = data[case]
                    for _ in range(100):  # warm-up
                        call(x)
                    counter.settle()
                    counter.begin()
                    for _ in range(calls):
                        call(x)
                    counter.end(f"{case}_{'traced' if traced else 'plain'}_{rnd}", calls)
    assert torch.as_tensor is as_tensor  # put back after tracing


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=200_000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--instructions", action="store_true",
                        help="count instructions under callgrind instead of CPU time")  # fmt: skip
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--lib", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if min(args.calls, args.rounds) < 1:
        parser.error("--calls and --rounds must be at least 1")
    if args.child:
        _child(args.calls, args.rounds, args.lib)
        return 0
    if args.instructions and shutil.which("valgrind") is None:
        print("as_tensor.py: valgrind is not installed", file=sys.stderr)
        return 2
    import instructions

    child = [sys.executable, str(Path(__file__).resolve()), "--child",
             "--calls", str(args.calls), "--rounds", str(args.rounds)]  # fmt: skip
    with tempfile.TemporaryDirectory(prefix="copytrace-as-tensor-") as tmp:
        parts, _ = instructions.run_parts(
            child, instructions._env(), args.instructions, Path(tmp), "as_tensor.py"
        )
    unit = "instructions" if args.instructions else "CPU ns"
    print(f"{unit} per torch.as_tensor call; load average {os.getloadavg()[0]:.1f}")
    for case in CASES:
        for rnd in range(args.rounds):
            plain, traced = parts[f"{case}_plain_{rnd}"], parts[f"{case}_traced_{rnd}"]
            print(f"{case} round {rnd}: untraced {plain:,.0f}, traced {traced:,.0f}: "
                  f"{traced - plain:+,.0f} ({(traced - plain) / plain:+.0%})")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
