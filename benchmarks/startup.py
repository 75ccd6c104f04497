"""Start-up cost of the ``COPYTRACE`` hook (``copytrace_hook.pth``), unset and set.

Each case starts a fresh interpreter of this environment (where the hook is installed)
several times and reports the median wall time:

* ``python -c pass``: the hook unset, then ``COPYTRACE=1`` (the hook imports
  ``copytrace.launch.hook``; tracing waits for ``import torch``, so a program that never
  imports torch pays only that import);
* ``python -c "import torch"``: unset, then ``COPYTRACE=1`` (tracing starts right after
  torch is imported and the trace is written at exit; no report);
* the ``.pth`` line itself with the variable unset, timed in-process (what every Python
  start in this environment pays for copytrace).

Usage: ``python benchmarks/startup.py [--runs N] [--torch-runs N] [--json]``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import timeit
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("COPYTRACE", "OTEL_"))}
    env.update(extra)
    return env


def _time(argv: list[str], env: dict[str, str], runs: int, cwd: str) -> list[float]:
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        proc = subprocess.run(argv, env=env, cwd=cwd, capture_output=True, text=True)
        times.append(time.perf_counter() - t0)
        if proc.returncode != 0:
            raise SystemExit(f"{argv} failed ({proc.returncode}): {proc.stderr[-2000:]}")
    return times


def _hook_line() -> str:
    import site

    for d in [*site.getsitepackages(), site.getusersitepackages()]:
        p = Path(d) / "copytrace_hook.pth"
        if p.is_file():
            return p.read_text().strip()
    return (ROOT / "copytrace_hook.pth").read_text().strip()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=21, help="runs of python -c pass per case")
    parser.add_argument("--torch-runs", type=int, default=7, help="runs of import torch per case")
    parser.add_argument("--json", action="store_true", help="print JSON")
    args = parser.parse_args(argv)

    py = sys.executable
    results: dict[str, float] = {}
    with tempfile.TemporaryDirectory() as tmp:
        set_env = _env(COPYTRACE="1", COPYTRACE_OUTPUT=str(Path(tmp) / "out"), COPYTRACE_REPORT="0")
        # Warm the page cache and .pyc files first.
        _time([py, "-c", "import torch"], _env(), 1, tmp)
        _time([py, "-c", "import torch"], set_env, 1, tmp)
        cases = [
            ("python -c pass, COPYTRACE unset", [py, "-c", "pass"], _env(), args.runs),
            ("python -c pass, COPYTRACE=1", [py, "-c", "pass"], set_env, args.runs),
            ("import torch, COPYTRACE unset", [py, "-c", "import torch"], _env(), args.torch_runs),
            ("import torch, COPYTRACE=1", [py, "-c", "import torch"], set_env, args.torch_runs),
        ]
        # Interleave the runs so that load on the machine affects each case alike.
        samples: dict[str, list[float]] = {name: [] for name, *_ in cases}
        for i in range(max(args.runs, args.torch_runs)):
            for name, cmd, env, runs in cases:
                if i < runs:
                    samples[name] += _time(cmd, env, 1, tmp)
        for name, *_ in cases:
            results[name + " (median s)"] = statistics.median(samples[name])
        line = _hook_line()
        saved = os.environ.pop("COPYTRACE", None)
        try:
            n = 200_000
            per = timeit.timeit(lambda: exec(line, {}), number=n) / n  # noqa: S102
        finally:
            if saved is not None:
                os.environ["COPYTRACE"] = saved
        results[".pth line, COPYTRACE unset (us)"] = per * 1e6
        probe = "import sys; print(sorted(m for m in sys.modules if m.startswith(('torch', 'copytrace'))))"
        out = subprocess.run([py, "-c", probe], env=_env(), capture_output=True, text=True).stdout
        results["modules imported by the hook when unset"] = out.strip()  # type: ignore[assignment]
    if args.json:
        print(json.dumps(results, indent=2))
    else:
        for k, v in results.items():
            print(f"{k:48s} {v:.4f}" if isinstance(v, float) else f"{k:48s} {v}")
        a, b = (
            results["python -c pass, COPYTRACE unset (median s)"],
            results["python -c pass, COPYTRACE=1 (median s)"],
        )
        c, d = (
            results["import torch, COPYTRACE unset (median s)"],
            results["import torch, COPYTRACE=1 (median s)"],
        )
        print(f"hook set, no torch: +{(b - a) * 1e3:.1f} ms; with torch: +{(d - c) * 1e3:.0f} ms")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
