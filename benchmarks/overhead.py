"""Overhead of copytrace next to the floor of its design and torch.profiler.

Runs real CPU training steps for five workloads and, for each, times the variants
interleaved (plain, the floor, torch.profiler twice, copytrace) so that noise on a shared
machine hits all of them alike. Prints the median step time of the plain run and each
variant's median ratio to it.

    python benchmarks/overhead.py               # all workloads
    python benchmarks/overhead.py --rounds 5 --workloads W1 W2
    python benchmarks/overhead.py --workloads W5 --variants plain copytrace   # compiled step
    python benchmarks/overhead.py --workloads W1 W5 --variants plain ct_armed ct_step copytrace
        # production: armed and idle (goal <= 1.01x), t.step() as the README traces
    python benchmarks/overhead.py --instructions --workloads W1 W5
        # the same variants counted in instructions under valgrind (benchmarks/instructions.py):
        # load does not change them, where the times above move by more than 1%

W5 is a ``torch.compile``d model (inductor; ``--compile-backend aot_eager`` for a quicker
compile): under copytrace its compiled region runs compiled, not traced op by op, so its cost
is the eager code around the region plus one enter/exit per compiled call. (Under ``floor``
and the profilers with a dispatch mode, dynamo runs the region eagerly.)

Variants:
    floor      an empty TorchFunctionMode + TorchDispatchMode (the Python fallback's floor)
    tfm_floor  an empty Python TorchFunctionMode alone (the floor of any Python API-level mode)
    prof_cpu   torch.profiler with CPU activity
    prof_full  torch.profiler with profile_memory, record_shapes, with_stack
    copytrace  copytrace.trace() with default settings (no file written): level lean, no Python
               mode at all (torch's copying API hot-patched in C, the C++ observer for the
               aten level)
    ct_full    copytrace level="full": copytrace's function mode (its handler in C) on the
               stack for the API level, the C++ observer for the aten level
    ct_python  copytrace with observer="python": the Python modes (the fallback)
    ct_api     copytrace level="api": the function mode only (no dispatch mode)
    ct_idle    copytrace with a schedule, measured over its inactive steps
    ct_step    copytrace as the README tells users to trace: ``t.step()`` after each step
               (an explicit step boundary, timed inside the step)
    ct_armed   copytrace armed and idle (``trigger="signal"``, no signal sent): what a
               production job pays until ``copytrace trigger``
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import statistics
import sys
import time

import torch
import torch.nn as nn
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

import copytrace


class _EmptyFunction(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


class _EmptyDispatch(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def floor():
    with _EmptyFunction(), _EmptyDispatch():
        yield


def tfm_floor():
    return _EmptyFunction()


def prof_cpu():
    from torch.profiler import ProfilerActivity, profile

    return profile(activities=[ProfilerActivity.CPU])


def prof_full():
    from torch.profiler import ProfilerActivity, profile

    return profile(
        activities=[ProfilerActivity.CPU], profile_memory=True, record_shapes=True, with_stack=True
    )


def traced():
    return copytrace.trace(write=False)


def traced_python():
    return copytrace.trace(write=False, observer="python")


def traced_api():
    return copytrace.trace(write=False, level="api")


def traced_full():
    return copytrace.trace(write=False, level="full")


def traced_idle():
    # a schedule whose active steps never come: every measured step is an inactive one
    return copytrace.trace(write=False, schedule=copytrace.Schedule(skip_first=10**9))


def traced_step():
    return copytrace.trace(write=False)


traced_step.marks_steps = True  # type: ignore[attr-defined]


def traced_armed():
    return copytrace.trace(write=False, trigger="signal")


VARIANTS = {
    "plain": contextlib.nullcontext,
    "floor": floor,
    "tfm_floor": tfm_floor,
    "prof_cpu": prof_cpu,
    "prof_full": prof_full,
    "copytrace": traced,
    "ct_python": traced_python,
    "ct_api": traced_api,
    "ct_full": traced_full,
    "ct_idle": traced_idle,
    "ct_step": traced_step,
    "ct_armed": traced_armed,
}


def mlp(width: int, batch: int):
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(4):
        layers += [nn.Linear(width, width), nn.ReLU()]
    model = nn.Sequential(*layers)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x = torch.randn(batch, width)

    def step():
        loss = model(x).pow(2).mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        return loss.detach()

    return step


def transformer():
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(d_model=64, nhead=4, dim_feedforward=256, batch_first=True)
    model = nn.Sequential(
        nn.Embedding(100, 64), nn.TransformerEncoder(layer, 2), nn.Linear(64, 100)
    )
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = torch.randint(0, 100, (16, 64))
    y = torch.randint(0, 100, (16, 64))

    def step():
        logits = model(x.to("cpu"))
        loss = nn.functional.cross_entropy(logits.view(-1, 100), y.view(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        return loss.item()

    return step


def copy_heavy():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(128, 128), nn.ReLU(), nn.Linear(128, 10))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x = torch.randn(64, 128)
    history = []

    def step():
        loss = model(x.to("cpu").contiguous()).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        ema = copy.deepcopy(model)  # the costly way to refresh an EMA copy
        snap = {k: v.clone() for k, v in model.state_dict().items()}
        history.append(loss.detach().clone())
        del history[:-4]
        return ema, snap

    return step


def compiled_mlp(backend: str):
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(4):
        layers += [nn.Linear(256, 256), nn.GELU()]
    model = torch.compile(nn.Sequential(*layers), backend=backend)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x = torch.randn(64, 256, dtype=torch.float64)

    def step():
        loss = model(x.float()).pow(2).mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        return loss.detach()

    step()  # compile outside any variant (a dispatch mode would make dynamo skip the frame)
    return step


_COMPILE_BACKEND = ["inductor"]

WORKLOADS = {
    "W1": ("4xLinear(64) MLP, batch 32", lambda: mlp(64, 32), 200),
    "W2": ("4xLinear(512) MLP, batch 128", lambda: mlp(512, 128), 20),
    "W3": ("2-layer transformer LM, 16x64 tokens", transformer, 10),
    "W4": ("copy-heavy loop: deepcopy EMA, clones", copy_heavy, 50),
    "W5": ("torch.compile'd 4xLinear(256)+GELU MLP, batch 64",
           lambda: compiled_mlp(_COMPILE_BACKEND[0]), 50),
}  # fmt: skip


_CLOCK = [time.perf_counter]


def time_variant(step, make_ctx, steps: int) -> float:
    """Median seconds per step over ``steps`` steps inside one context."""
    clock = _CLOCK[0]
    times = []
    marks = getattr(make_ctx, "marks_steps", False)
    with make_ctx() as ctx:
        step()  # warm-up inside the context
        for _ in range(steps):
            t0 = clock()
            step()
            if marks:
                ctx.step()
            times.append(clock() - t0)
    return statistics.median(times)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5, help="interleaved rounds per workload")
    parser.add_argument("--workloads", nargs="*", default=list(WORKLOADS), choices=list(WORKLOADS))
    parser.add_argument("--variants", nargs="*", default=list(VARIANTS), choices=list(VARIANTS))
    parser.add_argument("--compile-backend", default="inductor", help="torch.compile backend of W5")
    parser.add_argument(
        "--cpu-time", action="store_true",
        help="time steps in this process's CPU time (time.process_time) instead of wall time: "
        "steadier on a machine shared with other busy processes",
    )  # fmt: skip
    parser.add_argument("--threads", type=int, default=0, help="torch.set_num_threads (0: keep)")
    parser.add_argument(
        "--instructions", action="store_true",
        help="count instructions per step under valgrind instead of timing (instructions.py; "
        "W1 W5 and plain ct_armed ct_step copytrace unless --workloads / --variants given)",
    )  # fmt: skip
    args, rest = parser.parse_known_args(argv)
    if args.instructions:
        import instructions

        given = argv if argv is not None else sys.argv[1:]
        fwd = [a for a in given if a != "--instructions"]
        if "--workloads" not in given:
            fwd += ["--workloads", "W1", "W5"]
        if "--variants" not in given:
            fwd += ["--variants", *instructions.DEFAULT_VARIANTS]
        return instructions.main([a for a in fwd if a not in ("--cpu-time",)])
    if rest:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    if args.cpu_time:
        _CLOCK[0] = time.process_time
    if args.threads:
        torch.set_num_threads(args.threads)
    _COMPILE_BACKEND[0] = args.compile_backend

    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, rounds={args.rounds}")
    header = f"{'workload':4s} {'plain ms':>9s} " + " ".join(f"{v:>10s}" for v in args.variants)
    print(header)
    for name in args.workloads:
        desc, make, steps = WORKLOADS[name]
        step = make()
        samples: dict[str, list[float]] = {v: [] for v in args.variants}
        for r in range(args.rounds):
            # rotate the order each round so that no variant always runs first
            order = (
                args.variants[r % len(args.variants) :] + args.variants[: r % len(args.variants)]
            )
            for variant in order:
                samples[variant].append(time_variant(step, VARIANTS[variant], steps))
        plain = statistics.median(samples["plain"]) if "plain" in samples else float("nan")
        ratios = [statistics.median(samples[v]) / plain for v in args.variants]
        print(
            f"{name:4s} {plain * 1e3:9.3f} " + " ".join(f"{r:9.2f}x" for r in ratios) + f"  {desc}"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
