"""Hazard analysis time and peak memory on generated traces, against the per-event rules.

Usage::

    python benchmarks/hazards.py                        # 100k and 1M events
    python benchmarks/hazards.py --events 100000 --reference
    python benchmarks/hazards.py --keep /tmp/ct-hazards   # keep (and reuse) the traces

For each size it writes a training-like trace with ``benchmarks/report_size.py``'s generator
(100 events per step), builds its event table once, then times in fresh processes
``copytrace.analysis.analyze`` over the table (the columnar rules) and, with
``--reference``, the per-event rules of ``tests/_reference_hazards.py`` (one Python object
per event, as the analyser ran before), with each process's peak memory. Not a test: it only
prints numbers.
"""

from __future__ import annotations

import argparse
import json
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _measure(kind: str, path: str) -> dict:
    """In this process: analyse ``path`` (``new`` or ``reference``); time (s), peak (MiB)."""
    from copytrace.tracefile import event_table

    table = event_table(path)
    if kind == "reference":
        sys.path.insert(0, str(ROOT / "tests"))
        from _reference_hazards import analyze_reference as run
    else:
        from copytrace.analysis import analyze as run
    t0 = time.perf_counter()
    findings = run(table)
    seconds = time.perf_counter() - t0
    return {"s": seconds, "peak": _peak_mib(), "findings": len(findings)}


def _peak_mib() -> float:
    """This process's peak resident memory (MiB): ``VmHWM``, which starts afresh at exec
    (``ru_maxrss`` would count the parent's pages at fork)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _child(kind: str, path: Path) -> dict:
    cmd = [sys.executable, __file__, "--measure", kind, str(path)]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True, cwd=ROOT)
    return json.loads(out.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--events", type=int, nargs="+", default=[100_000, 1_000_000])
    parser.add_argument("--reference", action="store_true", help="also time the per-event rules")
    parser.add_argument("--keep", type=Path, default=None, help="keep (and reuse) traces here")
    parser.add_argument("--measure", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.measure:
        print(json.dumps(_measure(*args.measure)))
        return 0
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from report_size import generate_trace

    from copytrace.tracefile import event_table

    work = args.keep or Path(tempfile.mkdtemp(prefix="ct-hazards-"))
    print("| events (steps) | columnar rules | peak memory | per-event rules | peak memory |")
    print("|---|---|---|---|---|")
    try:
        for n in args.events:
            folder = work / f"n{n}"
            if not any(folder.glob("*.otlp.jsonl*")):
                folder.mkdir(parents=True, exist_ok=True)
                generate_trace(folder / "copytrace-4242.otlp.jsonl", n)
            event_table(folder)  # build the table once (cached beside the trace)
            new = _child("new", folder)
            ref = _child("reference", folder) if args.reference else None
            old = f"{ref['s']:.1f} s | {ref['peak']:.0f} MiB" if ref else "- | -"
            print(f"| {n:,} ({n // 100:,}) | {new['s']:.2f} s | {new['peak']:.0f} MiB | {old} |")
    finally:
        if args.keep is None:
            shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
