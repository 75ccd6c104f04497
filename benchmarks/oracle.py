"""PyTorch's own test databases as the oracle: run every sample untraced and traced, compare.

Runs the samples of ``op_db`` (every op that supports the dtype on the CPU), every module of
``module_db`` and every optimizer of ``optim_db`` untraced (twice: keys on which the two
untraced runs disagree are unstable and left out) and then inside ``copytrace.trace`` at each
level on each observer path, and prints the samples run, the differences by kind, copytrace's
swallowed internal errors, and the first differences described. Value differences that are
torch's reads of uninitialised memory (``tests/oracle/_recheck.py``) and those listed as known
in ``tests/oracle/test_oracle.py`` (``KNOWN``: the Python fallback's dispatch mode) are counted
apart. Exits 1 on any other difference or internal error. The harness is ``tests/oracle`` (see
docs/oracle.md).

    python benchmarks/oracle.py                          # everything, every sample
    python benchmarks/oracle.py --samples 1              # each op's first sample only
    python benchmarks/oracle.py --ops add 'linalg.*' --modules none --optims none
    python benchmarks/oracle.py --levels lean --observer python --limit 50
"""

from __future__ import annotations

import argparse
import fnmatch
import sys
import time
from collections import Counter
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from oracle import _cases, _harness  # noqa: E402
from oracle.test_oracle import is_known  # noqa: E402

_DTYPES = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16}


def _pick(items: list, name, patterns: list[str] | None, limit: int | None) -> list:
    if patterns == ["none"]:
        return []
    if patterns:
        items = [x for x in items if any(fnmatch.fnmatchcase(name(x), p) for p in patterns)]
    return items[:limit] if limit else items


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ops", nargs="*", help="op name patterns (fnmatch); 'none' for no op")
    p.add_argument("--modules", nargs="*", help="module name patterns; 'none' for none")
    p.add_argument("--optims", nargs="*", help="optimizer class name patterns; 'none' for none")
    p.add_argument("--limit", type=int, help="at most this many ops / modules / optimizers each")
    p.add_argument("--samples", type=int, help="samples (inputs) per op, module or optimizer (default: all)")
    p.add_argument("--dtype", choices=sorted(_DTYPES), default="float32", help="the ops' dtype")
    p.add_argument("--levels", nargs="+", choices=["lean", "full", "api"], default=["lean", "full", "api"])
    p.add_argument("--observer", nargs="+", choices=["native", "python"], default=["native", "python"])
    p.add_argument("--show", type=int, default=10, help="differences described (default 10)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    dtype = _DTYPES[args.dtype]
    groups = []
    ops = [op for op in _cases.op_db() if dtype in op.supported_dtypes("cpu")]
    for op in _pick(ops, _cases.op_name, args.ops, args.limit):
        groups.append((f"op {_cases.op_name(op)}", _cases.op_cases(op, dtype, args.samples)))
    for info in _pick(_cases.module_db(), lambda i: i.name, args.modules, args.limit):
        groups.append((f"module {info.name}", _cases.module_cases(info, args.samples)))
    for info in _pick(_cases.optim_db(), lambda i: i.optim_cls.__name__, args.optims, args.limit):
        groups.append((f"optim {info.optim_cls.__name__}", _cases.optim_cases(info, args.samples)))
    report = _harness.Report(_harness.configs(args.levels, args.observer), known=is_known)
    print(f"oracle: {len(groups)} group(s) x configs {[c.name for c in report.configs]}", flush=True)
    t0, c0 = time.perf_counter(), time.process_time()
    for i, (group, build) in enumerate(groups):
        _harness.run_cases(report, group, build)
        if (i + 1) % 50 == 0:
            print(f"  {i + 1}/{len(groups)} groups, {time.perf_counter() - t0:.0f} s", flush=True)
    known = [d for d in report.differences if is_known(d)]
    report.differences = [d for d in report.differences if d not in known]
    _print(report, time.perf_counter() - t0, args.show)
    print(f"known differences:  {len(known)} (KNOWN in tests/oracle/test_oracle.py; not counted above)")
    for kind, n in sorted(Counter(d.kind for d in known).items()):
        print(f"  {kind:<18}{n}")
    by_config = Counter(d.config for d in known)
    print("known by configuration: " + ", ".join(f"{c.name} {by_config[c.name]}" for c in report.configs))
    print(f"cpu time:           {time.process_time() - c0:.1f} s (user + system, this process)")
    return 1 if report.differences else 0


def _print(report: _harness.Report, seconds: float, show: int) -> None:
    print(f"groups run:         {report.groups}")
    print(f"samples run:        {report.samples} (each untraced twice, then traced x {len(report.configs)})")
    print(f"observer paths:     {sorted(report.observer_paths)}")
    print(f"unstable keys:      {report.unstable} (untraced runs disagree; not compared)")
    uninit = report.uninitialised
    print(f"uninitialised:      {len(uninit)} (torch read uninitialised memory: equal once it is filled)")
    if uninit:
        print("  " + ", ".join(sorted({f"{d.case} [{d.config}]" for d in uninit}))[:600])
    print(f"differences:        {len(report.differences)} in {len(report.by_case())} case(s)")
    if report.differences:
        print("  " + ", ".join(sorted(report.by_case()))[:600])
    for kind, n in report.by_kind().items():
        print(f"  {kind:<18}{n}")
    print(f"internal errors:    {report.internal_errors}")
    print("by configuration:   samples, differences, internal errors")
    for name, (n, errors) in report.by_config().items():
        print(f"  {name:<16}{report.samples:>8}{n:>8}{errors:>8}")
    print(f"time:               {seconds:.1f} s")
    seen: set = set()
    for d in report.differences:  # the first of each kind of key, then the rest
        shape = (d.kind, d.key.split("/")[0], d.config)
        if shape not in seen and len(seen) < show:
            seen.add(shape)
            print(d.describe())
    for tb in report.first_errors[:3]:
        print("first internal error:", tb)


if __name__ == "__main__":
    sys.exit(main())
